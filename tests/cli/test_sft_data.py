"""What ``sft_data.to_dataset`` makes of chat rows (the format it tokenises itself: TRL's assistant-only loss needs a
template with ``{% generation %}`` markers), pinned token by token on the tiny chat tokenizer of the command-line
tests: the input ids, and which of them are in the completion mask. The other formats go to TRL as rows."""

from __future__ import annotations

import copy

import pytest
from helpers.tiny_chat import save_tiny_chat_llama
from transformers import PreTrainedTokenizerFast

from peft_slim.cli import sft_data

SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "Who wrote Hamlet?"}
ANSWER = {"role": "assistant", "content": "William Shakespeare wrote it."}
USER_2 = {"role": "user", "content": "Which planet is red?"}
ANSWER_2 = {"role": "assistant", "content": "Mars is the red planet."}

# fmt: off
# '<|user|>\nWho wrote Hamlet?<|end|>\n<|assistant|>\nWilliam Shakespeare wrote it.<|end|>\n'
CHAT_QA_IDS = [
    1, 202, 58, 75, 82, 224, 90, 85, 82, 87, 72, 224, 43, 68, 80, 79, 72, 87, 34, 0, 202, 2, 202, 58, 76, 79, 79,
    76, 68, 80, 224, 54, 75, 68, 78, 72, 86, 83, 72, 68, 85, 72, 224, 90, 85, 82, 87, 72, 224, 76, 87, 17, 0, 202,
]
# SYSTEM, USER, ANSWER, USER_2, ANSWER_2 through the template
CHAT_IDS = [
    3, 202, 37, 72, 224, 69, 85, 76, 72, 73, 17, 0, 202, 1, 202, 58, 75, 82, 224, 90, 85, 82, 87, 72, 224, 43, 68,
    80, 79, 72, 87, 34, 0, 202, 2, 202, 58, 76, 79, 79, 76, 68, 80, 224, 54, 75, 68, 78, 72, 86, 83, 72, 68, 85, 72,
    224, 90, 85, 82, 87, 72, 224, 76, 87, 17, 0, 202, 1, 202, 58, 75, 76, 70, 75, 224, 83, 79, 68, 81, 72, 87, 224,
    76, 86, 224, 85, 72, 71, 34, 0, 202, 2, 202, 48, 68, 85, 86, 224, 76, 86, 224, 87, 75, 72, 224, 85, 72, 71, 224,
    83, 79, 68, 81, 72, 87, 17, 0, 202,
]
# USER, ANSWER, ANSWER_2 through the template
TWO_ANSWERS_IDS = [
    1, 202, 58, 75, 82, 224, 90, 85, 82, 87, 72, 224, 43, 68, 80, 79, 72, 87, 34, 0, 202, 2, 202, 58, 76, 79, 79,
    76, 68, 80, 224, 54, 75, 68, 78, 72, 86, 83, 72, 68, 85, 72, 224, 90, 85, 82, 87, 72, 224, 76, 87, 17, 0, 202,
    2, 202, 48, 68, 85, 86, 224, 76, 86, 224, 87, 75, 72, 224, 85, 72, 71, 224, 83, 79, 68, 81, 72, 87, 17, 0, 202,
]
# USER, SYSTEM, ANSWER through the template
SYSTEM_LAST_IDS = [
    1, 202, 58, 75, 82, 224, 90, 85, 82, 87, 72, 224, 43, 68, 80, 79, 72, 87, 34, 0, 202, 3, 202, 37, 72, 224, 69,
    85, 76, 72, 73, 17, 0, 202, 2, 202, 58, 76, 79, 79, 76, 68, 80, 224, 54, 75, 68, 78, 72, 86, 83, 72, 68, 85, 72,
    224, 90, 85, 82, 87, 72, 224, 76, 87, 17, 0, 202,
]
# fmt: on

# name: (messages, to_dataset's keyword arguments, input ids, the [start, end) spans of the ids in the mask)
FORMATS = {
    "messages": ([SYSTEM, USER, ANSWER, USER_2, ANSWER_2], {}, CHAT_IDS, [(36, 67), (93, 118)]),
    "messages, all labels": ([USER, ANSWER], {"completion_only": False}, CHAT_QA_IDS, [(0, 54)]),
    # Where TRL's data utilities differ: an assistant turn after an assistant turn, or after a system turn, follows
    # the generation prompt (trl.apply_chat_template continues the earlier assistant turn, labelling its end marker,
    # or refuses the system turn).
    "messages, two assistant turns": ([USER, ANSWER, ANSWER_2], {}, TWO_ANSWERS_IDS, [(23, 54), (56, 81)]),
    "messages, system before assistant": ([USER, SYSTEM, ANSWER], {}, SYSTEM_LAST_IDS, [(36, 67)]),
}


def chat(rows: list[dict], tokenizer, completion_only: bool = True) -> list[dict]:
    return list(sft_data.to_dataset(rows, sft_data.find_columns(rows), tokenizer, completion_only))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return PreTrainedTokenizerFast.from_pretrained(save_tiny_chat_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_chat_row_tokenizes_to_its_pinned_ids_and_mask(name, tokenizer):
    messages, options, input_ids, labelled = FORMATS[name]
    (example,) = chat([{"messages": messages}], tokenizer, **options)
    assert example["input_ids"] == input_ids
    mask = [0] * len(input_ids)
    for start, end in labelled:
        mask[start:end] = [1] * (end - start)
    assert example["completion_mask"] == mask


def test_other_formats_go_to_trl_as_its_rows(tokenizer):
    rows = [{"question": "Who?", "answer": "Me."}]
    columns = sft_data.find_columns(rows, prompt="question", completion="answer")
    assert list(sft_data.to_dataset(rows, columns, tokenizer, chat_template=False)) == [
        {"prompt": "Who?", "completion": "Me."}
    ]
    (conversational,) = sft_data.to_dataset(rows, columns, tokenizer)  # the tokenizer has a template
    assert conversational == {
        "prompt": [{"role": "user", "content": "Who?"}],
        "completion": [{"role": "assistant", "content": "Me."}],
    }
    text = [{"body": "Sky."}]
    assert list(sft_data.to_dataset(text, sft_data.find_columns(text, text="body"), tokenizer)) == [{"text": "Sky."}]


# A template without the assistant turns (with and without a generation prompt), and one whose generation prompt
# (a newline after the marker) is not a prefix of the assistant turn it rendered.
SKIPS_ANSWERS = (
    "{% for m in messages %}{% if m['role'] != 'assistant' %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
    "{% endif %}{% endfor %}"
)
NOT_A_PREFIX = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.mark.parametrize("completion_only", [True, False])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_a_chat_template_that_renders_no_assistant_turn_is_refused(generation_prompt, completion_only, tokenizer):
    """The bug: every row was dropped as if --max-length had cut its labels away ("raise --max-length"), or, with
    --no-completion-only-loss, the run trained on the prompts alone."""
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = SKIPS_ANSWERS + (
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}" * generation_prompt
    )
    rows = [{"messages": [USER, ANSWER]}]
    with pytest.raises(sft_data.DataError, match=r"row 1: .* renders message 2 \(role 'assistant'\) as nothing"):
        chat(rows, templated, completion_only)


def test_a_template_whose_turns_cannot_be_located_trains_on_every_token_without_completion_only_loss(tokenizer):
    """The bug: the refusal said to pass --no-completion-only-loss, which was refused the same way."""
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = NOT_A_PREFIX
    rows = [{"messages": [USER, ANSWER]}]
    with pytest.raises(sft_data.DataError, match="pass --no-completion-only-loss to train on every token"):
        chat(rows, templated)
    (example,) = chat(rows, templated, completion_only=False)
    text = "<|user|>Who wrote Hamlet?<|end|>\n<|assistant|>William Shakespeare wrote it.<|end|>\n"
    assert example["input_ids"] == templated(text, add_special_tokens=False)["input_ids"]
    assert set(example["completion_mask"]) == {1}
