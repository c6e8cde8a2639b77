"""Bad input to TokenTune fails with a clear ValueError, never with silent full-token (or wrong) training."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.tiny_models import (
    TEXT_SIZES,
    VOCAB,
    FullFineTuned,
    bloom,
    build,
    deberta_v2,
    decoder_config,
    gpt_neo,
    make_batch,
)
from helpers.tokentune_cases import tokentune_config, tokentune_model
from peft import IA3Config, LoraConfig, get_peft_model
from transformers import (
    BertConfig,
    BertForQuestionAnswering,
    CLIPConfig,
    CLIPModel,
    LlamaForSequenceClassification,
)

from peft_slim import TokenTuneConfig, tokentune_
from peft_slim.token_selection.attention import REGISTERED_NAMES

# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"token_ratio": 0}, "token_ratio"),
        ({"token_ratio": 0.0}, "token_ratio"),
        ({"token_ratio": 1.5}, "token_ratio"),
        ({"token_ratio": -1}, "token_ratio"),
        ({"token_ratio": "0.3"}, "token_ratio"),
        ({"token_ratio": True}, "token_ratio"),
        ({"token_ratio": float("nan")}, "token_ratio"),
        ({"num_tokens": 0}, "num_tokens"),
        ({"num_tokens": -3}, "num_tokens"),
        ({"num_tokens": 2.5}, "num_tokens"),
        ({"num_tokens": True}, "num_tokens"),
        ({"num_tokens": "4"}, "num_tokens"),
        ({"token_ratio": 0.3, "num_tokens": 4}, "num_tokens"),
        ({"selection": "foo"}, "selection"),
        ({"selection": None}, "selection"),
        ({"seed": "x"}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"lora": 42}, "lora"),
        ({"lora": IA3Config(target_modules=["q_proj"])}, "lora"),
        ({"lora": LoraConfig(r=4, target_modules=["q_proj"]), "trainable_modules": ["q_proj"]}, "trainable_modules"),
    ],
    ids=lambda value: repr(value) if not isinstance(value, dict) else None,
)
def test_invalid_config_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        TokenTuneConfig(**kwargs)


def test_valid_config_values_are_normalised():
    assert (TokenTuneConfig().token_ratio, TokenTuneConfig().prompt_ratio) == (0.5, 0.3)  # the defaults
    assert TokenTuneConfig(token_ratio=1).token_ratio == 1.0
    assert TokenTuneConfig(num_tokens=16).num_tokens == 16
    config = TokenTuneConfig(lora={"r": 4, "target_modules": ["q_proj"]})
    assert isinstance(config.lora, LoraConfig) and config.lora.r == 4


def test_trainable_modules_matching_nothing():
    with pytest.raises(ValueError, match="trainable_modules"):
        tokentune_model("llama", lora=False, trainable_modules=["no_such_module"])


# ---------------------------------------------------------------------------------------------- token_mask


def _decoder_mask(batch: dict) -> torch.Tensor:
    return batch["attention_mask"].bool().clone()


@pytest.mark.parametrize(
    ("make_mask", "message"),
    [
        (lambda real: real[:, :-1], "shape"),
        (lambda real: real[:1], "shape"),
        (lambda real: real.T, "shape"),
        (lambda real: real.long(), "bool"),
        (lambda real: real.float(), "bool"),
        (lambda real: real.tolist(), "bool"),
        (lambda real: torch.zeros_like(real), "selects no position"),
        (lambda real: torch.ones_like(real), "padding"),
    ],
    ids=["short", "batch", "transposed", "long", "float", "list", "nothing", "padding"],
)
def test_bad_token_mask(make_mask, message):
    model = tokentune_model("llama")
    batch = make_batch("llama")
    model.train()
    with pytest.raises(ValueError, match=message):
        model(**batch, token_mask=make_mask(batch["attention_mask"].bool()))
    assert model.get_base_model().config._attn_implementation == "peft_slim_tokentune_sdpa"


def test_token_mask_must_select_cls_for_encoder_classification():
    model = tokentune_model("bert")
    batch = make_batch("bert")
    token_mask = batch["attention_mask"].bool().clone()
    token_mask[1, 0] = False  # row 1 misses [CLS]
    model.train()
    with pytest.raises(ValueError, match="classification head"):
        model(**batch, token_mask=token_mask)
    token_mask[1, 0] = True
    model(**batch, token_mask=token_mask).loss.backward()  # the same mask with [CLS] is fine


def test_token_mask_must_select_last_token_for_decoder_classification():
    torch.manual_seed(0)
    config = decoder_config(num_labels=3)
    base = LlamaForSequenceClassification._from_config(config, attn_implementation="sdpa")
    model = get_peft_model(
        base, TokenTuneConfig(task_type="SEQ_CLS", token_ratio=0.5, lora=LoraConfig(r=4, target_modules=["q_proj"]))
    )
    batch = make_batch("llama")  # left padding: the last position is every row's last real token
    batch["labels"] = torch.tensor([0, 1, 2])
    token_mask = batch["attention_mask"].bool().clone()
    token_mask[2, -1] = False
    model.train()
    with pytest.raises(ValueError, match="classification head"):
        model(**batch, token_mask=token_mask)
    # the drawn selection always keeps it
    model(**batch)
    assert model.base_model.last_token_mask[:, -1].all()


# ---------------------------------------------------------------------------------------------- models


@pytest.mark.parametrize("implementation", ["flex_attention", "flash_attention_2"])
def test_unsupported_attention_implementation_at_wrap_time(implementation):
    base = build("llama")
    base.config._attn_implementation = implementation  # (flash-attn is not installed; set it directly)
    with pytest.raises(ValueError, match=f"(?s)LlamaForCausalLM.*{implementation}"):
        get_peft_model(base, tokentune_config("llama"))


def test_unsupported_attention_implementation_built_with_flex():
    base = build("llama", "flex_attention")
    with pytest.raises(ValueError, match="attn_implementation"):
        get_peft_model(base, tokentune_config("llama"))


def test_attention_implementation_switched_after_wrapping():
    model = tokentune_model("llama")
    model.get_base_model().set_attn_implementation("flex_attention")
    model.train()
    with pytest.raises(ValueError, match="flex_attention"):
        model(**make_batch("llama"))
    assert model.get_base_model().config._attn_implementation == "flex_attention"


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize(
    ("builder", "block_class", "lora_targets"),
    [
        (gpt_neo, "GPTNeoBlock", ["q_proj"]),
        (bloom, "BloomBlock", ["query_key_value"]),
        (deberta_v2, "DebertaV2Layer", ["query_proj"]),
    ],
    ids=["gpt_neo", "bloom", "deberta_v2"],
)
def test_blocks_without_registry_attention_are_refused(builder, block_class, lora_targets, lora):
    """Models whose attention bypasses transformers' attention registry: an error naming the block class.

    GPT-Neo and BLOOM call their own attention code (no registry call: TokenTune could not make unselected
    keys/values constants); DeBERTa-v2's layer takes no **kwargs. Without the check, the selected pass would
    silently let gradients reach unselected tokens.
    """
    torch.manual_seed(0)
    classifier = block_class == "DebertaV2Layer"
    config = TokenTuneConfig(
        task_type="SEQ_CLS" if classifier else "CAUSAL_LM",
        lora=LoraConfig(r=4, target_modules=lora_targets) if lora else None,
    )
    base = builder()
    model = get_peft_model(base, config) if lora else FullFineTuned(base, tokentune_(base, config))
    batch = {"input_ids": torch.randint(3, VOCAB, (2, 8)), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    batch["labels"] = torch.tensor([0, 1]) if classifier else batch["input_ids"]
    model.train()
    with pytest.raises(ValueError, match=f"(?s){block_class}.*without token selection"):
        model(**batch)
    assert all(p.grad is None for p in model.parameters())  # nothing was trained
    assert model.get_base_model().config._attn_implementation == "peft_slim_tokentune_eager"
    # Inference is unaffected.
    model.eval()
    with torch.no_grad():
        assert model(**batch).logits.isfinite().all()


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_attention_outside_the_blocks_is_refused(implementation):
    """A model with two stacks of blocks: token selection runs one (CLIPModel: the text model's), and the other's
    attention (the vision tower's) once trained every token, silently. Refused at the first training forward,
    naming the module; the model's attention implementation is restored and inference is unaffected."""
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=TEXT_SIZES | {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
        vision_config={k: v for k, v in TEXT_SIZES.items() if k != "vocab_size"} | {"image_size": 16, "patch_size": 4},
        projection_dim=16,
    )
    base = CLIPModel._from_config(config, attn_implementation=implementation)
    model = get_peft_model(base, TokenTuneConfig(lora=LoraConfig(r=4, target_modules=["q_proj", "v_proj"])))
    batch = {"input_ids": torch.randint(3, VOCAB, (2, 8)), "pixel_values": torch.randn(2, 3, 16, 16)}
    model.train()
    where = "CLIPModel.vision_model.encoder.layers.0.self_attn (CLIPAttention, outside text_model.encoder.layers)"
    with pytest.raises(ValueError, match=f"(?s){re.escape(where)}.*not supported"):
        model(**batch, return_loss=True)
    assert base.config._attn_implementation == REGISTERED_NAMES[implementation]  # runs the original outside training
    model.eval()
    with torch.no_grad():
        assert model(**batch).logits_per_text.isfinite().all()


def test_unknown_head_class_refused_at_get_peft_model():
    torch.manual_seed(0)
    config = BertConfig(**TEXT_SIZES)
    base = BertForQuestionAnswering._from_config(config, attn_implementation="sdpa")
    for task_type in (None, "QUESTION_ANS"):
        with pytest.raises(ValueError, match="BertForQuestionAnswering"):
            get_peft_model(base, TokenTuneConfig(task_type=task_type, lora=LoraConfig(r=4, target_modules=["query"])))


def test_disable_adapter_and_unload_with_lora_are_peft_s():
    model = tokentune_model("llama").eval()
    batch = make_batch("llama")
    base = build("llama").eval()
    with torch.no_grad(), model.disable_adapter():
        assert torch.equal(model(**batch).logits, base(**batch).logits)
    unloaded = model.unload()
    assert all(torch.equal(p, q) for p, q in zip(unloaded.parameters(), base.parameters()))


@pytest.mark.parametrize("given", ["tensor", "list", "dict"])
def test_a_block_argument_holding_tensors_that_cannot_be_cut_is_refused(given):
    """A block argument TokenTune cannot restrict to the selected tokens, holding tensors directly or in a list or a
    dict: refused naming it, since the selected pass would otherwise get it whole (rows of unselected tokens too)."""
    torch.manual_seed(0)
    base = build("llama")
    layer_class = type(base.model.layers[0])

    class LayerWithMemory(layer_class):
        def forward(self, hidden_states, memory=None, **kwargs):
            return super().forward(hidden_states, **kwargs)

    memory = torch.randn(2, 8, 4)
    value = {"tensor": memory, "list": [memory], "dict": {"keys": memory}}[given]
    for layer in base.model.layers:
        layer.__class__ = LayerWithMemory
        layer.register_forward_pre_hook(lambda m, a, k: (a, {**k, "memory": value}), with_kwargs=True, prepend=True)
    model = get_peft_model(base, tokentune_config("llama"))
    model.train()
    with pytest.raises(ValueError, match="restrict argument `memory` of LayerWithMemory"):
        model(**make_batch("llama", 2, 8))


def test_a_dict_valued_attention_mask_is_named_as_unsupported():
    """A per-position argument given as a dict (one mask per layer type, say) is refused as something token selection
    does not support, naming the block and the argument, not as the caller's mistake."""
    torch.manual_seed(0)
    base = build("llama")
    for layer in base.model.layers:
        layer.register_forward_pre_hook(
            lambda m, a, k: (a, {**k, "attention_mask": {"full_attention": k.get("attention_mask")}}),
            with_kwargs=True,
            prepend=True,
        )
    model = get_peft_model(base, tokentune_config("llama"))
    model.train()
    message = r"(?s)cannot train LlamaDecoderLayer.*without token selection.*`attention_mask` is a dict"
    with pytest.raises(ValueError, match=message):
        model(**make_batch("llama", 2, 8))
