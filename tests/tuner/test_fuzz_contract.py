"""The input contract, fuzzed: every generated case either is refused at once with an error naming the problem,
or trains, and then its loss and gradient equal the reference definition and a save -> load round trip is exact.

Cases: TokenTune configs (valid and invalid field values) x tiny architectures x task heads x padding sides x
dtypes x LoRA or base weights; and SlimFit fields x compression configs x architectures x LoRA or base
weights (frozen units bit-identical, trained units the ordinary gradient when exact, exact round trip). The
default suite runs a fixed, derandomised sample of 30 cases each; set PEFT_SLIM_FUZZ_EXAMPLES (e.g. 600) for a
longer, randomised run.
"""

from __future__ import annotations

import copy
import os
import tempfile

import numpy as np
import torch
from helpers.slimfit_cases import TASK, loss_of
from helpers.tiny_models import CAUSAL_LM, LORA_TARGETS, FullFineTuned, build, make_batch
from helpers.tokentune_cases import (
    TASK_TYPES,
    assert_grads_match,
    build_decoder_classifier,
    reference_loss_and_grads,
    tokentune_config,
    training_step,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import LoraConfig, PeftModel, get_peft_model

from peft_slim import SlimFitConfig, slimfit_, tokentune_

EXAMPLES = int(os.environ.get("PEFT_SLIM_FUZZ_EXAMPLES", "30"))

# (field, value, valid?) pairs: invalid ones must be refused naming the field.
_FIELD_VALUES = [
    ("token_ratio", 0.25, True),
    ("token_ratio", np.float32(0.5), True),
    ("token_ratio", 1.0, True),
    ("token_ratio", 0.0, False),
    ("token_ratio", 1.5, False),
    ("token_ratio", float("nan"), False),
    ("token_ratio", "0.3", False),
    ("num_tokens", 3, True),
    ("num_tokens", np.int64(4), True),
    ("num_tokens", 10**6, True),  # more than the sequence: every real token trains
    ("num_tokens", 0, False),
    ("num_tokens", 2.0, False),
    ("num_tokens", 2**70, False),
    ("seed", 2**64, False),
    ("seed", -3, False),
    ("selection", "supervised", False),
    ("selection", "answer", True),
    ("selection", "importance", False),
    ("modules_to_save", ["score", None], False),
    ("trainable_modules", "([", False),
]
# Heads: causal LMs, encoder and decoder sequence classifiers, ViT image classification.
_HEADS = [(arch, "lm") for arch in CAUSAL_LM] + [("bert", "cls"), ("roberta", "cls"), ("vit", "cls")]
_HEADS += [("llama", "seq_cls"), ("qwen2", "seq_cls")]


def _trained(base, config):
    """``config`` on ``base``: through PEFT with `lora`, else the method's full fine-tuning transform."""
    if config.lora is not None:
        return get_peft_model(base, config)
    return FullFineTuned(base, (slimfit_ if isinstance(config, SlimFitConfig) else tokentune_)(base, config))


def _saved_and_loaded(model, fresh, folder: str):
    """``model`` saved to ``folder`` and loaded onto ``fresh``: a LoRA adapter, or the plain checkpoint."""
    if isinstance(model, FullFineTuned):
        model.get_base_model().save_pretrained(folder)
        return type(fresh).from_pretrained(folder, dtype=next(fresh.parameters()).dtype)
    model.save_pretrained(folder)
    return PeftModel.from_pretrained(fresh, folder)


def _model(arch: str, head: str, dtype: torch.dtype):
    base = build_decoder_classifier(arch) if head == "seq_cls" else build(arch)
    return base.to(dtype)


def _batch(arch: str, head: str, padding_side: str, dtype: torch.dtype) -> dict:
    batch = make_batch(arch, batch=3, length=9, seed=1)
    if "attention_mask" in batch and padding_side == "right" and arch in CAUSAL_LM:
        # make_batch pads decoders on the left; move the padding to the right, keeping each row's tokens.
        for key in ("input_ids", "attention_mask", "labels"):
            if key in batch and batch[key].dim() == 2:
                rows = [row[batch["attention_mask"][i].bool()] for i, row in enumerate(batch[key])]
                pad = -100 if key == "labels" else 0
                batch[key] = torch.stack([torch.cat([r, r.new_full((9 - len(r),), pad)]) for r in rows])
    if head == "seq_cls":
        batch["labels"] = torch.tensor([0, 2, 1])
    if "pixel_values" in batch:
        batch["pixel_values"] = batch["pixel_values"].to(dtype)
    return batch


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="PEFT_SLIM_FUZZ_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    head=st.sampled_from(_HEADS),
    field_value=st.sampled_from(_FIELD_VALUES),
    lora=st.booleans(),
    padding_side=st.sampled_from(["left", "right"]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_each_case_is_refused_clearly_or_trains_exactly(head, field_value, lora, padding_side, dtype):
    arch, kind = head
    field, value, valid = field_value
    task_type = "SEQ_CLS" if kind == "seq_cls" else TASK_TYPES[arch]
    kwargs = {field: value}
    try:
        config = tokentune_config(arch, lora=lora, task_type=task_type, **kwargs)
    except (ValueError, TypeError) as error:
        assert not valid, f"a valid value was refused: {field}={value!r}: {error}"
        assert field in str(error), f"the error does not name `{field}`: {error}"
        return
    assert valid, f"an invalid value was accepted: {field}={value!r}"

    torch.manual_seed(0)
    model = _trained(_model(arch, kind, dtype), config)
    batch = _batch(arch, kind, padding_side, dtype)
    output, mask, grads = training_step(model, batch)
    assert torch.isfinite(output.loss)
    reference_arch = arch if kind != "seq_cls" else "bert"  # the reference scores a classifier by its own loss
    ref_loss, ref_grads = reference_loss_and_grads(model, reference_arch, batch, mask)
    torch.testing.assert_close(output.loss.detach(), ref_loss.to(output.loss.dtype), rtol=1e-5, atol=1e-6)
    assert_grads_match(grads, ref_grads)

    model.eval()
    inputs = {key: v for key, v in batch.items() if key != "labels"}
    with torch.no_grad():
        expected = model(**inputs).logits
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        loaded = _saved_and_loaded(model, _model(arch, kind, dtype), folder)
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, expected)


# SlimFit and compression fields: (field, value, valid?); invalid ones must be refused naming the field.
_SLIMFIT_VALUES = [
    ("freeze_ratio", 0.5, True),
    ("freeze_ratio", np.float64(0.8), True),
    ("freeze_ratio", 1.0, False),
    ("freeze_ratio", -0.1, False),
    ("max_frozen_steps", np.int32(2), True),
    ("max_frozen_steps", 2.0, False),
    ("schedule_every", 0, False),
    ("epsilon", float("inf"), False),
    ("metric", "update_norm", True),
    ("metric", "gradient", True),
    ("metric", "hessian", False),
    ("units", [r".*(?:layers?|h)\.(\d+)\..*"], True),
    ("units", ["(bad"], False),
    ("always_trainable", ["classifier"], True),
    ("always_trainable", r".*\.(", False),
    ("lora_units", "matrix", True),
    ("lora_units", "rows", False),
    ("seed", 2**64, False),
]
_COMPRESSION_VALUES = [
    (None, True),
    ({"bits": 8}, True),
    ({"bits": 4, "group_size": 32}, True),
    ({"bits": 4.0}, False),
    ({"bits": 8, "group_size": 12}, False),
    ({"bitz": 8}, False),
]


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="PEFT_SLIM_FUZZ_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    arch=st.sampled_from(["bert", "gpt2", "llama"]),
    field_value=st.sampled_from(_SLIMFIT_VALUES),
    compression=st.sampled_from(_COMPRESSION_VALUES),
    lora=st.booleans(),
)
def test_slimfit_case_is_refused_clearly_or_trains_as_defined(arch, field_value, compression, lora):
    field, value, valid = field_value
    compression_value, compression_valid = compression
    if field == "always_trainable" and valid and arch != "bert":
        value = ["ln_f"] if arch == "gpt2" else ["norm"]
    fields = {field: value, "activation_compression": compression_value}
    if lora:
        fields["lora"] = LoraConfig(r=4, lora_alpha=8, target_modules=set(LORA_TARGETS[arch]))
        fields["task_type"] = TASK[arch]
    try:
        model = _trained(build(arch), SlimFitConfig(**fields))
    except (ValueError, TypeError) as error:
        assert not (valid and compression_valid), f"a valid case was refused: {error}"
        named = field in str(error) or "activation_compression" in str(error)
        assert named, f"the error names neither `{field}` nor `activation_compression`: {error}"
        return
    assert valid and compression_valid, f"an invalid case was accepted: {field}={value!r}, {compression_value!r}"

    tuner = model.base_model
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    model.slimfit_attach(optimizer)
    model.train()
    loss = loss_of(model, make_batch(arch))
    assert torch.isfinite(loss)
    loss.backward()
    frozen = [p for unit, t in zip(tuner._state.units, tuner.scheduler.trained) if not t for p in unit.params]
    trained = [p for unit, t in zip(tuner._state.units, tuner.scheduler.trained) if t for p in unit.params]
    assert trained and all(p.grad is None for p in frozen)
    if compression_value is None:  # exact: the trained units' gradient is the ordinary one
        reference = copy.deepcopy(model)
        if isinstance(reference, FullFineTuned):
            reference.base_model.remove()
        else:
            reference.base_model.remove_hooks()
        reference.requires_grad_(True)
        reference.zero_grad(set_to_none=True)
        loss_of(reference, make_batch(arch)).backward()
        ordinary = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            if param.grad is not None:
                torch.testing.assert_close(param.grad, ordinary[name].grad, rtol=1e-5, atol=1e-6)
    optimizer.step()
    model.slimfit_step()
    after = dict(model.named_parameters())
    frozen_ids = {id(p) for p in frozen}
    for name, param in after.items():
        if id(param) in frozen_ids:
            assert torch.equal(param, before[name]), f"a frozen unit changed: {name}"

    model.eval()
    inputs = {key: v for key, v in make_batch(arch).items() if key != "labels"}
    with torch.no_grad():
        expected = model(**inputs)
    expected = expected.logits if hasattr(expected, "logits") else expected[0]
    with tempfile.TemporaryDirectory() as folder:
        loaded = _saved_and_loaded(model, build(arch), folder)
    loaded.eval()
    with torch.no_grad():
        result = loaded(**inputs)
    assert torch.equal(result.logits if hasattr(result, "logits") else result[0], expected)
