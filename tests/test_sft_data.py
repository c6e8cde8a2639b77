"""What ``sft_data.tokenize`` makes of each data format ``peft-slim train --dataset`` accepts, pinned token by token
on the tiny chat tokenizer of the command-line tests: the input ids, and which of them carry a label (the others are
-100). Also the inputs where TRL's data utilities would give another result, pinned to this module's result."""

from __future__ import annotations

import copy

import pytest
from tiny_chat import save_tiny_chat_llama
from transformers import PreTrainedTokenizerFast

from peft_slim.cli import sft_data
from peft_slim.token_selection.loss import IGNORE_INDEX

SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "Who wrote Hamlet?"}
ANSWER = {"role": "assistant", "content": "William Shakespeare wrote it."}
USER_2 = {"role": "user", "content": "Which planet is red?"}
ANSWER_2 = {"role": "assistant", "content": "Mars is the red planet."}
QA = {"prompt": "Who wrote Hamlet?", "completion": "William Shakespeare wrote it."}
SKY = {"text": "The sky is blue on a clear day."}

# fmt: off
# SKY's text
SKY_IDS = [
    55, 75, 72, 224, 86, 78, 92, 224, 76, 86, 224, 69, 79, 88, 72, 224, 82, 81, 224, 68, 224, 70, 79, 72, 68, 85,
    224, 71, 68, 92, 17,
]
# 'Mars is red.<|end|>' and the end-of-sequence token <|end|> (id 0)
TEXT_EOS_IDS = [
    48, 68, 85, 86, 224, 76, 86, 224, 85, 72, 71, 17, 0, 0,
]
# '<|user|>\nWho wrote Hamlet?<|end|>\n<|assistant|>\nWilliam Shakespeare wrote it.<|end|>\n'
CHAT_QA_IDS = [
    1, 202, 58, 75, 82, 224, 90, 85, 82, 87, 72, 224, 43, 68, 80, 79, 72, 87, 34, 0, 202, 2, 202, 58, 76, 79, 79,
    76, 68, 80, 224, 54, 75, 68, 78, 72, 86, 83, 72, 68, 85, 72, 224, 90, 85, 82, 87, 72, 224, 76, 87, 17, 0, 202,
]
# 'Who wrote Hamlet?' ' William Shakespeare wrote it.' '<|end|>'
PLAIN_QA_IDS = [
    58, 75, 82, 224, 90, 85, 82, 87, 72, 224, 43, 68, 80, 79, 72, 87, 34, 224, 58, 76, 79, 79, 76, 68, 80, 224, 54,
    75, 68, 78, 72, 86, 83, 72, 68, 85, 72, 224, 90, 85, 82, 87, 72, 224, 76, 87, 17, 0,
]
# 'Who wrote Ham' 'let?' '<|end|>'
CUT_QA_IDS = [
    58, 75, 82, 224, 90, 85, 82, 87, 72, 224, 43, 68, 80, 79, 72, 87, 34, 0,
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

# name: (row, tokenize's keyword arguments, input ids, the [start, end) spans of the ids that carry a label)
FORMATS = {
    "text": (SKY, {}, SKY_IDS, [(0, 31)]),
    "text, no template": (SKY, {"chat_template": False}, SKY_IDS + [0], [(0, 32)]),
    "prompt-completion": (QA, {}, CHAT_QA_IDS, [(23, 54)]),
    "prompt-completion, all labels": (QA, {"completion_only": False}, CHAT_QA_IDS, [(0, 54)]),
    "prompt-completion, no template": (
        {"prompt": QA["prompt"], "completion": " " + QA["completion"]},
        {"chat_template": False},
        PLAIN_QA_IDS,
        [(17, 48)],
    ),
    "messages": ({"messages": [SYSTEM, USER, ANSWER, USER_2, ANSWER_2]}, {}, CHAT_IDS, [(36, 67), (93, 118)]),
    "messages, all labels": ({"messages": [USER, ANSWER]}, {"completion_only": False}, CHAT_QA_IDS, [(0, 54)]),
    # Where TRL's data utilities differ (see sft_data.py): a text already ending in the end-of-sequence token gets
    # another one (TRL's SFTTrainer adds none); prompt and completion are tokenised apart (TRL tokenises them as one
    # text: the same ids here, the tiny vocabulary merging nothing across the cut); an assistant turn after an
    # assistant turn, or after a system turn, follows the generation prompt (trl.apply_chat_template continues the
    # earlier assistant turn, labelling its end marker, or refuses the system turn).
    "text ending in eos, no template": (
        {"text": "Mars is red.<|end|>"},
        {"chat_template": False},
        TEXT_EOS_IDS,
        [(0, 14)],
    ),
    "prompt-completion, word cut": (
        {"prompt": "Who wrote Ham", "completion": "let?"},
        {"chat_template": False},
        CUT_QA_IDS,
        [(13, 18)],
    ),
    "messages, two assistant turns": (
        {"messages": [USER, ANSWER, ANSWER_2]},
        {},
        TWO_ANSWERS_IDS,
        [(23, 54), (56, 81)],
    ),
    "messages, system before assistant": ({"messages": [USER, SYSTEM, ANSWER]}, {}, SYSTEM_LAST_IDS, [(36, 67)]),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return PreTrainedTokenizerFast.from_pretrained(save_tiny_chat_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_tokenizes_to_its_pinned_ids_and_labels(name, tokenizer):
    row, options, input_ids, labelled = FORMATS[name]
    (example,), dropped = sft_data.tokenize([row], sft_data.find_columns([row]), tokenizer, 512, **options)
    assert dropped == 0
    assert example["input_ids"] == input_ids
    labels = [IGNORE_INDEX] * len(input_ids)
    for start, end in labelled:
        labels[start:end] = input_ids[start:end]
    assert example["labels"] == labels


def test_an_example_labelled_only_at_its_first_position_is_dropped(tokenizer):
    """The first position is never scored (a causal LM predicts position t from t-1), so one token is not enough
    (TRL's SFTTrainer keeps any example with a label)."""
    rows = [SKY, {"text": "Mars is red."}]
    examples, dropped = sft_data.tokenize(rows, sft_data.find_columns(rows), tokenizer, 2)
    assert dropped == 0 and [example["labels"] for example in examples] == [SKY_IDS[:2], TEXT_EOS_IDS[:2]]
    with pytest.raises(sft_data.DataError, match="--max-length 1: no example keeps a labelled token"):
        sft_data.tokenize(rows, sft_data.find_columns(rows), tokenizer, 1)


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
        sft_data.tokenize(rows, sft_data.find_columns(rows), templated, 512, completion_only)


def test_a_template_whose_turns_cannot_be_located_trains_on_every_token_without_completion_only_loss(tokenizer):
    """The bug: the refusal said to pass --no-completion-only-loss, which was refused the same way."""
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = NOT_A_PREFIX
    rows = [{"messages": [USER, ANSWER]}]
    with pytest.raises(sft_data.DataError, match="pass --no-completion-only-loss to train on every token"):
        sft_data.tokenize(rows, sft_data.find_columns(rows), templated, 512)
    (example,), _ = sft_data.tokenize(rows, sft_data.find_columns(rows), templated, 512, completion_only=False)
    text = "<|user|>Who wrote Hamlet?<|end|>\n<|assistant|>William Shakespeare wrote it.<|end|>\n"
    assert example["input_ids"] == example["labels"] == templated(text, add_special_tokens=False)["input_ids"]
