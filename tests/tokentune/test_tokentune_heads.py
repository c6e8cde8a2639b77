"""Which positions a head reads: transformers' rules, kept selected; pooling heads refused; docs/tokentune.md's list.

The head tables of ``peft_slim.token_selection.heads`` are checked against what transformers' heads really read:
the positions of the last block's output whose gradient (of the classification logits) is non-zero. Gradients
of decoder classifiers with ``pad_token_id == eos_token_id`` are checked against the reference definition
(tests/helpers/reference.py), for right and left padding.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers
from helpers.tiny_models import BUILDERS, IMAGE_SIZES, TEXT_SIZES, VOCAB, bloom, build, deberta_v2, gpt_neo
from helpers.tokentune_cases import (
    assert_grads_match,
    build_decoder_classifier,
    reference_loss_and_grads,
    tokentune_config,
    training_step,
)
from peft import LoraConfig, get_peft_model
from transformers import LlamaForSequenceClassification, ModernBertConfig, Wav2Vec2Config

from peft_slim import TokenTuneConfig, tokentune_
from peft_slim.token_selection.attention import SUPPORTED_IMPLEMENTATIONS
from peft_slim.token_selection.blocks import find_blocks
from peft_slim.token_selection.heads import (
    AUDIO_INPUTS,
    CAUSAL_LM_SUFFIXES,
    FIRST_POSITION,
    FIRST_POSITION_HEADS,
    GENERIC_SEQUENCE_CLASSIFIER,
    LAST_NON_PAD,
    LAST_NON_PAD_HEADS,
    PER_POSITION_SUFFIXES,
    head_of,
)

TOKENTUNE_PAGE = Path(__file__).resolve().parents[2] / "docs" / "tokentune.md"
PAD = 0
EOS = 2
TEXT = dict(TEXT_SIZES, num_key_value_heads=2, num_labels=3, max_position_embeddings=64, head_dim=8)
IMAGE = dict(IMAGE_SIZES, num_labels=3)
# Another value of each pooling field FIRST_POSITION_HEADS names: the head then averages over positions.
POOLING_OTHER_VALUE = {"classifier_pooling": "mean", "use_mean_pooling": True}
# Some of transformers' GenericForSequenceClassification subclasses.
GENERIC_EXAMPLES = (
    "LlamaForSequenceClassification",
    "Qwen2ForSequenceClassification",
    "MistralForSequenceClassification",
)


def tiny(name: str, **overrides) -> torch.nn.Module:
    """A tiny random transformers model of class ``name`` (sdpa where the class supports it, else eager)."""
    cls = getattr(transformers, name)
    image = cls.main_input_name == "pixel_values"
    kwargs = dict(IMAGE if image else dict(TEXT, pad_token_id=PAD))
    condition = FIRST_POSITION_HEADS.get(name)
    if condition is not None:
        kwargs[condition[0]] = condition[1]
    kwargs.update(overrides)
    config = cls.config_class(**kwargs)
    torch.manual_seed(0)
    try:
        return cls._from_config(config, attn_implementation="sdpa")
    except ValueError:  # e.g. DeBERTa-v2: eager only
        return cls._from_config(config, attn_implementation="eager")


def transformers_reads(model: torch.nn.Module, **inputs) -> torch.Tensor:
    """Bool [B, L]: the positions of the last block's output that the model's logits depend on (its own head)."""
    _, blocks = find_blocks(model)
    leaves = []

    def make_leaf(module, args, output):
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        leaf = hidden.detach().requires_grad_(True)
        leaves.append(leaf)
        return (leaf, *output[1:]) if isinstance(output, tuple) else leaf

    handle = blocks[-1].register_forward_hook(make_leaf)
    try:
        model.eval()
        logits = model(**inputs).logits
    finally:
        handle.remove()
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0))
    (logits.float() * weights).sum().backward()
    return leaves[-1].grad.abs().sum(dim=-1) > 0


def text_rows(pad: int = PAD, eos: int = EOS) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids / attention_mask [5, 9]: no padding, right and left padding, an EOS (== pad when eos == pad)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (5, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    ids[3, 5] = eos  # right padding after an EOS that is attended to
    mask[3, 6:] = 0
    ids[4, 8] = eos  # left padding, the sequence ends with EOS
    mask[4, :2] = 0
    return ids.masked_fill(mask == 0, pad), mask


def _read_rule(model, input_ids, length: int | None = None) -> torch.Tensor:
    batch = input_ids.shape[0] if input_ids is not None else 1
    length = input_ids.shape[1] if length is None else length
    return head_of(model).read_positions(model.config, input_ids, batch, length, torch.device("cpu"))


# ---------------------------------------------------------------------------------------------- the tables are true


@pytest.mark.parametrize("name", sorted(FIRST_POSITION_HEADS))
def test_first_position_heads_read_position_zero(name):
    model = tiny(name)
    assert head_of(model).rule == FIRST_POSITION
    if model.main_input_name == "pixel_values":
        reads = transformers_reads(model, pixel_values=torch.randn(2, 3, 16, 16))
        expected = _read_rule(model, None, reads.shape[1]).expand(2, -1)
    else:
        ids, mask = text_rows()  # right and left padding: position 0 is padding in two rows
        reads = transformers_reads(model, input_ids=ids, attention_mask=mask)
        expected = _read_rule(model, ids)
    assert torch.equal(reads, expected)


@pytest.mark.parametrize("name", sorted(LAST_NON_PAD_HEADS[1:]) + list(GENERIC_EXAMPLES))
@pytest.mark.parametrize("pad", [PAD, EOS], ids=["pad_ne_eos", "pad_eq_eos"])
def test_last_non_pad_heads_follow_transformers_rule(name, pad):
    model = tiny(name, pad_token_id=pad, eos_token_id=EOS)
    assert head_of(model).rule == LAST_NON_PAD
    ids, mask = text_rows(pad=pad)
    reads = transformers_reads(model, input_ids=ids, attention_mask=mask)
    assert torch.equal(reads, _read_rule(model, ids))
    if pad == EOS:  # the head does not read the last attended token of the rows that end with EOS
        assert not reads[3, 5] and reads[3, 4] and not reads[4, 8] and reads[4, 7]
    # inputs_embeds: the last position, whatever the padding
    embeds = model.get_input_embeddings()(ids).detach()
    reads = transformers_reads(model, inputs_embeds=embeds, attention_mask=mask)
    assert torch.equal(reads, _read_rule(model, None, ids.shape[1]).expand(5, -1))
    assert reads[:, -1].all()


def test_generic_subclass_that_overrides_forward_is_refused():
    class PooledEverywhere(LlamaForSequenceClassification):
        def forward(self, *args, **kwargs):  # a different head: its read positions are not the generic rule's
            return super().forward(*args, **kwargs)

    class Unchanged(LlamaForSequenceClassification):
        pass

    config = build_decoder_classifier("llama").config
    assert head_of(Unchanged._from_config(config)).rule == LAST_NON_PAD
    with pytest.raises(ValueError, match="PooledEverywhere"):
        head_of(PooledEverywhere._from_config(config))


def test_no_pad_token_reads_the_last_position():
    model = tiny("LlamaForSequenceClassification", pad_token_id=None)
    ids = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    ids[0, -2:] = PAD  # without pad_token_id nothing is padding to the head
    reads = transformers_reads(model, input_ids=ids)
    assert reads[0, -1] and reads.sum() == 1
    assert torch.equal(reads, _read_rule(model, ids))


# ---------------------------------------------------------------------------------------------- pad == eos gradients


def _pad_eos_batch(padding_side: str) -> dict:
    """Rows of 4, 6 and 8 tokens, each ending with EOS (attended), padded to 10 with EOS (pad_token_id == eos)."""
    generator = torch.Generator().manual_seed(3)
    rows, masks = [], []
    for length in (4, 6, 8):
        tokens = torch.cat([torch.randint(3, VOCAB, (length - 1,), generator=generator), torch.tensor([EOS])])
        pad = torch.full((10 - length,), EOS)
        ones, zeros = torch.ones(length, dtype=torch.long), torch.zeros(10 - length, dtype=torch.long)
        if padding_side == "right":
            rows.append(torch.cat([tokens, pad]))
            masks.append(torch.cat([ones, zeros]))
        else:
            rows.append(torch.cat([pad, tokens]))
            masks.append(torch.cat([zeros, ones]))
    return {"input_ids": torch.stack(rows), "attention_mask": torch.stack(masks), "labels": torch.tensor([0, 1, 2])}


@pytest.mark.parametrize("set_pad", ["before_wrapping", "after_wrapping"])
@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_decoder_classifier_with_pad_equal_to_eos(arch, padding_side, set_pad):
    """The head reads the token before the final EOS (EOS is the pad id): it is selected; the gradient is exact.

    Also when ``config.pad_token_id`` is set after ``get_peft_model`` (as scripts often do with the tokenizer's).
    """
    base = build_decoder_classifier(arch)
    if set_pad == "before_wrapping":
        base.config.pad_token_id = base.config.eos_token_id = EOS
    model = get_peft_model(base, tokentune_config(arch, task_type="SEQ_CLS", num_tokens=2))
    if set_pad == "after_wrapping":
        model.get_base_model().config.pad_token_id = model.get_base_model().config.eos_token_id = EOS
    batch = _pad_eos_batch(padding_side)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    read = transformers_reads(model.get_base_model(), **inputs)
    output, mask, grads = training_step(model, batch)

    last_real = batch["attention_mask"].cumsum(1).argmax(1)
    assert not read[torch.arange(3), last_real].any()  # the case: the last attended token (EOS) is not read
    assert (mask & read).sum() == 3, "the position the head reads is not selected"
    assert (mask.sum(dim=1) < batch["attention_mask"].sum(dim=1)).all()  # a genuine subset

    ref_loss, ref_grads = reference_loss_and_grads(model, "seq_cls", batch, mask)
    torch.testing.assert_close(output.loss.detach(), ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_match(grads, ref_grads)
    lora = {name: grad for name, grad in grads.items() if "lora_" in name}
    assert lora and all(grad.abs().max() > 0 for grad in lora.values()), "zero LoRA gradient"


def test_decoder_classifier_inputs_embeds_right_padding_selects_the_padded_last_position():
    """With inputs_embeds transformers reads the last position even where it is padding: it is selected."""
    base = build_decoder_classifier("llama")
    model = get_peft_model(base, tokentune_config("llama", task_type="SEQ_CLS", num_tokens=2))
    batch = _pad_eos_batch("right")
    embeds = model.get_base_model().get_input_embeddings()(batch["input_ids"]).detach()
    batch = {"inputs_embeds": embeds, "attention_mask": batch["attention_mask"], "labels": batch["labels"]}
    output, mask, grads = training_step(model, batch)
    assert mask[:, -1].all() and not batch["attention_mask"][:2, -1].any()
    ref_loss, ref_grads = reference_loss_and_grads(model, "seq_cls", batch, mask)
    torch.testing.assert_close(output.loss.detach(), ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_match(grads, ref_grads)


def test_encoder_classifier_left_padding_reads_position_zero():
    """BERT's head reads position 0 even when it is padding (left padding): selected, gradient exact."""
    model = get_peft_model(build("bert"), tokentune_config("bert", num_tokens=2))
    ids, mask = text_rows()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 2, 0, 1])}
    output, selected, grads = training_step(model, batch)
    assert selected[:, 0].all() and not mask[2, 0]
    ref_loss, ref_grads = reference_loss_and_grads(model, "bert", batch, selected)
    torch.testing.assert_close(output.loss.detach(), ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_match(grads, ref_grads)


def test_token_mask_must_cover_the_read_position_with_pad_equal_to_eos():
    base = build_decoder_classifier("llama")
    base.config.pad_token_id = base.config.eos_token_id = EOS
    model = get_peft_model(base, tokentune_config("llama", task_type="SEQ_CLS"))
    batch = _pad_eos_batch("right")
    token_mask = batch["attention_mask"].bool().clone()
    token_mask[0, 2] = False  # row 0 reads position 2 (position 3 is its EOS)
    model.train()
    with pytest.raises(ValueError, match="row 0: position 2"):
        model(**batch, token_mask=token_mask)
    token_mask[0, 2] = True
    model(**batch, token_mask=token_mask).loss.backward()


# ---------------------------------------------------------------------------------------------- refused heads


def _lora(targets) -> LoraConfig:
    return LoraConfig(r=4, target_modules=targets)


@pytest.mark.parametrize("field", sorted({c[0] for c in FIRST_POSITION_HEADS.values() if c}))
def test_pooling_settings_other_than_the_listed_one_are_refused(field):
    for name, condition in FIRST_POSITION_HEADS.items():
        if condition is None or condition[0] != field:
            continue
        other = POOLING_OTHER_VALUE[field]
        model = tiny(name, **{field: other})
        if model.main_input_name == "pixel_values":
            reads = transformers_reads(model, pixel_values=torch.randn(1, 3, 16, 16))
        else:
            ids, mask = text_rows()
            reads = transformers_reads(model, input_ids=ids, attention_mask=mask)
        assert (reads.sum(dim=1) > 1).all(), f"{name} with {field}={other!r} should pool several positions"
        with pytest.raises(ValueError, match=rf"(?s){name}.*{field}={other!r}.*{field}={condition[1]!r}"):
            head_of(model)


def test_modernbert_mean_pooling_refused_and_cls_pooling_accepted():
    def modernbert(pooling):
        config = ModernBertConfig(**TEXT, pad_token_id=PAD, classifier_pooling=pooling)
        torch.manual_seed(0)
        return transformers.ModernBertForSequenceClassification._from_config(config, attn_implementation="sdpa")

    config = TokenTuneConfig(task_type="SEQ_CLS", lora=_lora(["Wqkv"]), seed=0)
    refusal = r"(?s)ModernBertForSequenceClassification.*classifier_pooling='mean'.*classifier_pooling='cls'"
    with pytest.raises(ValueError, match=refusal):
        get_peft_model(modernbert("mean"), config)

    model = get_peft_model(modernbert("cls"), TokenTuneConfig(task_type="SEQ_CLS", lora=_lora(["Wqkv"]), seed=0))
    ids, mask = text_rows()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 2, 0, 1])}
    output, selected, grads = training_step(model, batch)
    assert selected[:, 0].all()
    ref_loss, ref_grads = reference_loss_and_grads(model, "modernbert", batch, selected)
    torch.testing.assert_close(output.loss.detach(), ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_match(grads, ref_grads)

    model.get_base_model().config.classifier_pooling = "mean"  # changed after wrapping: refused in training
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match=refusal):
        model(**batch)
    assert all(p.grad is None for p in model.parameters())
    assert model.get_base_model().config._attn_implementation == "peft_slim_tokentune_sdpa"


def test_wav2vec2_classifier_refused():
    config = Wav2Vec2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 4),
        conv_kernel=(10, 8),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4,
        num_labels=3,
    )
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForSequenceClassification._from_config(config, attn_implementation="sdpa")
    reads = transformers_reads(model, input_values=torch.randn(2, 400))
    assert (reads.sum(dim=1) > 1).all()  # why: the head averages over frames
    with pytest.raises(ValueError, match=r"(?s)Wav2Vec2ForSequenceClassification.*audio.*pools"):
        get_peft_model(model, TokenTuneConfig(lora=_lora(["q_proj", "v_proj"])))


# ---------------------------------------------------------------------------------------- the list in the docs


def _section() -> str:
    text = TOKENTUNE_PAGE.read_text()
    return text.split("\n## Supported and refused\n", 1)[1].split("\n## ", 1)[0]


def _ticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def _paragraph(section: str, title: str) -> str:
    return section.split(f"**{title}.**", 1)[1].split("\n\n", 1)[0]


def test_readme_attention_implementations():
    supported, refused = _paragraph(_section(), "Attention implementations").split("Refused", 1)
    assert tuple(_ticked(supported)) == SUPPORTED_IMPLEMENTATIONS
    assert not set(_ticked(refused)) & set(SUPPORTED_IMPLEMENTATIONS)


def test_readme_architectures():
    paragraph = " ".join(_paragraph(_section(), "Architectures").split())
    tested = paragraph.split("Tested against the reference gradient:", 1)[1].split(".", 1)[0]
    names = {name.strip().lower().replace("-", "") for name in tested.split(",")}
    assert names == set(BUILDERS)  # the architectures tests/tokentune/test_tokentune_gradients.py checks
    refused = paragraph.split("e.g.", 1)[1].rstrip(".")
    builders = {"GPT-Neo": gpt_neo, "BLOOM": bloom, "DeBERTa-v2": deberta_v2}
    assert {name.strip() for name in refused.split(",")} == set(builders)
    for builder in builders.values():  # refused at the first training forward, naming the block class
        torch.manual_seed(0)
        model = builder()
        head = head_of(model).kind
        tokentune_(model, TokenTuneConfig(task_type="SEQ_CLS" if head == "classification" else "CAUSAL_LM"))
        ids = torch.randint(3, VOCAB, (2, 8))
        labels = torch.tensor([0, 1]) if head == "classification" else ids
        model.train()
        with pytest.raises(ValueError, match="not supported|without token selection"):
            model(input_ids=ids, labels=labels)


def _table_rows(section: str) -> list[tuple[str, str]]:
    rows = []
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| head |"):
            cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
            rows.append((cells[0], cells[1]))
    return rows


def test_readme_heads_table_lists_exactly_the_code_tables():
    rows = _table_rows(_section().split("**Heads.**", 1)[1].split("Refused at", 1)[0])
    assert len(rows) == 5
    (lm, lm_reads), (per_position, _), (bare, _), (last, last_reads), (first, first_reads) = rows
    assert _ticked(lm) == [f"*{suffix}" for suffix in CAUSAL_LM_SUFFIXES]
    assert _ticked(per_position) == [f"*{suffix}" for suffix in PER_POSITION_SUFFIXES]
    assert _ticked(bare) == ["*Model"]
    assert {name for name in _ticked(last) if "For" in name} == set(LAST_NON_PAD_HEADS)
    assert GENERIC_SEQUENCE_CLASSIFIER in _ticked(last)
    assert last_reads == (
        "the last non-pad token, by transformers' rule: the rightmost position whose input id is not `pad_token_id` "
        "(whatever the padding side, also when `pad_token_id == eos_token_id`); the last position when the config "
        "has no `pad_token_id` or the input is `inputs_embeds`"
    )
    assert first_reads == "position 0 (the [CLS] token), whatever the padding"
    listed = {name for name in _ticked(first) if "For" in name}
    assert listed == set(FIRST_POSITION_HEADS)
    conditions = {name: (field, value) for name, field, value in re.findall(r"`(\w+)` with `(\w+)=([^`]+)`", first)}
    expected = {name: (c[0], repr(c[1])) for name, c in FIRST_POSITION_HEADS.items() if c is not None}
    assert conditions == expected


def test_readme_refused_heads_are_refused():
    refused = _section().split("Refused at `get_peft_model`:", 1)[1]
    ticked = _ticked(refused)
    settings = [item for item in ticked if "=" in item]
    fields = {c[0]: c[1] for c in FIRST_POSITION_HEADS.values() if c is not None}
    assert settings and all(item.split("=")[0] in fields for item in settings)
    assert all(item.split("=")[1] != repr(fields[item.split("=")[0]]) for item in settings)
    assert [item for item in ticked if item.startswith("input_")] == list(AUDIO_INPUTS)
    classes = [item for item in ticked if "For" in item]
    assert len(classes) >= 6
    for name in classes:
        cls = getattr(transformers, name)
        with torch.device("meta"):  # only the class and its config matter: no weights needed
            model = cls._from_config(cls.config_class())
        with pytest.raises(ValueError, match=name):
            head_of(model)
