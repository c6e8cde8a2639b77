"""TokenTuneConfig.activation_compression: serialised with the adapter, on in training forwards only."""

from __future__ import annotations

import copy
import gc
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny_models import LORA_TARGETS, build, make_batch

import peft_slim
from peft_slim import ActivationCompressionConfig, TokenTuneConfig
from peft_slim.memory import SavedActivationBytes

COMPRESSION = ActivationCompressionConfig(bits=8, group_size=32, min_numel=0)


def _peft_model(base, config):
    torch.manual_seed(1)  # the same random LoRA weights for every model
    return get_peft_model(base, config)


def _config(compression=COMPRESSION, arch="llama") -> TokenTuneConfig:
    return TokenTuneConfig(
        task_type="CAUSAL_LM" if arch == "llama" else "SEQ_CLS",
        token_ratio=0.5,
        seed=0,
        lora=LoraConfig(r=4, target_modules=LORA_TARGETS[arch], init_lora_weights=False),
        modules_to_save=None if arch == "llama" else ["classifier"],
        activation_compression=compression,
    )


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


def test_the_field_round_trips_through_adapter_config_json(tmp_path):
    config = _config(ActivationCompressionConfig(bits=4, group_size=64, kinds=["attention", "other"], min_numel=0))
    model = get_peft_model(build("llama"), config)
    model.save_pretrained(tmp_path)
    # The method's settings are saved beside the adapter (its adapter_config.json is plain LoRA's when it has LoRA).
    record = "peft_slim_config.json" if config.lora is not None else "adapter_config.json"
    with open(tmp_path / record) as handle:
        saved = json.load(handle)
    assert saved["activation_compression"] == config.activation_compression.to_dict()
    loaded = peft_slim.load_config(str(tmp_path))
    assert isinstance(loaded.activation_compression, ActivationCompressionConfig)
    assert loaded.activation_compression == config.activation_compression
    reloaded = peft_slim.from_pretrained(build("llama"), tmp_path, is_trainable=True).train()
    reloaded(**make_batch("llama")).loss.backward()
    assert reloaded.base_model.last_compression_stats.compressed > 0


def test_the_field_accepts_a_dict_and_rejects_other_types():
    assert _config({"bits": 2}).activation_compression == ActivationCompressionConfig(bits=2)
    assert _config(None).to_dict()["activation_compression"] is None
    with pytest.raises(ValueError, match="TokenTuneConfig.activation_compression must be"):
        _config(8)
    with pytest.raises(ValueError, match="ActivationCompressionConfig.bits must be"):
        _config({"bits": 3})


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_training_forward_compresses_with_close_gradients(arch):
    base = build(arch)
    batch = make_batch(arch, batch=4, length=32)
    plain = _peft_model(copy.deepcopy(base), _config(None, arch)).train()
    compressed = _peft_model(base, _config(COMPRESSION, arch)).train()
    plain(**batch).loss.backward()
    token_mask = plain.base_model.last_token_mask  # the same tokens for both
    with SavedActivationBytes(compressed.parameters()) as outside:
        loss = compressed(**batch, token_mask=token_mask).loss
    loss.backward()
    # The compression hooks are the innermost for the whole forward, the selected-token loss included.
    assert outside.bytes == 0
    stats = compressed.base_model.last_compression_stats
    # Each block keeps its selected inputs and every token's keys and values (saved in the block: kind "other").
    assert stats.compressed > 5 and stats.ratio < 0.5, stats
    cosine = torch.nn.functional.cosine_similarity(_grads(plain), _grads(compressed), dim=0).item()
    assert cosine >= 0.999, cosine


def test_nothing_is_compressed_in_eval_mode_or_without_grad():
    base = build("llama")
    batch = make_batch("llama", batch=4, length=32)
    plain = get_peft_model(copy.deepcopy(base), _config(None)).eval()
    compressed = get_peft_model(base, _config()).eval()
    with SavedActivationBytes(plain.parameters()) as expected:
        plain(**batch)
    with SavedActivationBytes(compressed.parameters()) as seen:
        compressed(**batch)
    assert seen.bytes == expected.bytes > 0  # nothing hid the saved tensors from the outer counter
    compressed.train()
    with torch.no_grad():
        compressed(**batch)
    assert compressed.base_model.last_compression_stats is None


def test_a_failing_training_forward_leaves_no_hook_behind():
    model = get_peft_model(build("llama"), _config(ActivationCompressionConfig(bits=2, group_size=32, min_numel=0)))
    model.train()
    batch = make_batch("llama", batch=4, length=32)
    with pytest.raises(ValueError, match="token_mask selects no position"):
        model(**batch, token_mask=torch.zeros(4, 32, dtype=torch.bool))
    # Outside the model, autograd saves exact tensors again: a 2-bit hook left installed would change this gradient.
    # (A counting hook entered here would not tell: only the innermost saved-tensor hooks see the tensors.)
    x = torch.randn(64, 64, requires_grad=True)
    (x.exp() * 2).sum().backward()
    assert torch.equal(x.grad, 2 * x.detach().exp()), "a saved-tensor hook was left installed"


def test_the_uncompressed_inputs_of_the_selected_pass_go_when_the_forward_returns():
    """Compressed, each block keeps its selected pass's inputs (every token's keys and values) packed: the
    originals must be freed as soon as the forward is over, not at some later garbage collection (as a reference
    cycle holding them did, so that what a forward left allocated depended on when the collector ran)."""
    model = _peft_model(build("llama"), _config()).train()
    batch = make_batch("llama")
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds is kept in gc.garbage instead of freed
    try:
        loss = model(**batch).loss
        gc.collect()
        cyclic = [tuple(o.shape) for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert model.base_model.last_compression_stats.compressed > 0
    assert cyclic == []
    loss.backward()
