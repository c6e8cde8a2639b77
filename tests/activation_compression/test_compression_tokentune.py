"""TokenTuneConfig.activation_compression: serialised with the adapter, on in training forwards only."""

from __future__ import annotations

import copy
import gc
import json
import weakref

import pytest
import torch
from helpers.tiny_models import LORA_TARGETS, build, make_batch
from helpers.tokentune_cases import reference_loss_and_grads, training_step
from peft import LoraConfig, get_peft_model

import peft_slim
from peft_slim import ActivationCompressionConfig, SlimFitConfig, TokenSelectionConfig, TokenTuneConfig
from peft_slim.compression.format import Quantized
from peft_slim.compression.tensor import CompressedTensor
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


# Every token's keys and values enter the selected pass's attention in backward. The selected tokens' ones are
# recomputed there; the unselected ones are what the forward keeps for backward, as inputs of the selected pass
# (recompute.py's `save_for_backward`), so activation compression stores them like any other saved activation.


def _held_keys_values(monkeypatch) -> list[dict]:
    """For each key/value tensor a block keeps for its selected pass: a weak reference, an exact copy, and what
    activation compression stored for it (``stored``: None if the pack hook never saw it)."""
    from peft_slim.compression import hooks
    from peft_slim.token_selection import blocks

    recorded = []

    def recording_selected_pass(run, output, arguments, parameters, check=None):
        for tensor in arguments[2:]:  # (args, kwargs, key, value)
            recorded.append({"tensor": weakref.ref(tensor), "copy": tensor.detach().clone(), "stored": None})
        return selected_pass(run, output, arguments, parameters, check)

    def recording_pack(self, tensor):
        saved = pack(self, tensor)
        for entry in recorded:
            if entry["tensor"]() is tensor:
                entry["stored"] = saved.value
        return saved

    selected_pass, pack = blocks.selected_pass, hooks.ActivationCompression._pack
    monkeypatch.setattr(blocks, "selected_pass", recording_selected_pass)
    monkeypatch.setattr(hooks.ActivationCompression, "_pack", recording_pack)
    return recorded


def _selecting_config(method: str, compression: ActivationCompressionConfig):
    """TokenTune's config, or SlimFit's with token selection, both with ``compression``."""
    if method == "tokentune":
        return _config(compression)
    lora = LoraConfig(r=4, target_modules=LORA_TARGETS["llama"], init_lora_weights=False)
    selection = TokenSelectionConfig(token_ratio=0.5, seed=0)
    return SlimFitConfig(
        task_type="CAUSAL_LM",
        freeze_ratio=0.5,
        lora=lora,
        token_selection=selection,
        activation_compression=compression,
    )


@pytest.mark.parametrize("method", ["tokentune", "slimfit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_keys_and_values_kept_for_backward_are_stored_quantized(monkeypatch, dtype, method):
    recorded = _held_keys_values(monkeypatch)
    config = _selecting_config(method, ActivationCompressionConfig(bits=8, min_numel=0))
    model = _peft_model(build("llama").to(dtype), config).train()
    loss = model(**make_batch("llama", batch=4, length=32)).loss
    text = model.base_model.model.config
    assert len(recorded) == 2 * text.num_hidden_layers
    original_bytes = held_bytes = 0
    for entry in recorded:
        original, stored = entry["copy"], entry["stored"]
        # Grouped-query attention: the key/value heads themselves, not copies repeated to every query head.
        assert original.shape[1:] == (text.num_key_value_heads, text.head_dim) and original.dtype == dtype
        # Only the compressed form is held: the tensor itself is gone once the forward has returned.
        assert entry["tensor"]() is None
        assert isinstance(stored, CompressedTensor), "a key/value tensor held for backward was not stored quantized"
        quantized = stored.values
        assert isinstance(quantized, Quantized) and quantized.bits == 8 and quantized.group_size == 128
        # Each value within half a quantization step (its group's `scale`) of the original: the quantizer's error,
        # plus, in bf16, the one rounding of the decoded value to bf16.
        restored = stored.decompress()
        assert restored.shape == original.shape and restored.dtype == dtype
        size = quantized.group_size
        error = (restored.float() - original.float()).flatten().abs()
        error = torch.nn.functional.pad(error, (0, (-error.numel()) % size)).view(-1, size).amax(dim=1)
        rounding = 0 if dtype == torch.float32 else torch.finfo(dtype).eps * original.abs().max().float()
        assert (error <= quantized.scale.float() / 2 * (1 + 1e-5) + 1e-7 + rounding).all()
        original_bytes += original.numel() * original.element_size()
        held_bytes += stored.nbytes
        # One byte per value plus an fp32 scale and minimum per group of 128 values (the last group padded).
        assert stored.nbytes == -(-original.numel() // 128) * (128 + 8)
    # About 1/4 of the fp32 bytes, 1/2 of bf16's (a little more here: short tensors, each with a padded group).
    assert held_bytes / original_bytes < 1.2 * (1 + 8 / 128) / original.element_size(), (held_bytes, original_bytes)
    loss.backward()


@pytest.mark.parametrize("method", ["tokentune", "slimfit"])
@pytest.mark.parametrize(
    ("settings", "bits"),
    [
        ({"bits": 8, "kinds": ["attention"]}, 8),
        ({"bits": None, "kind_bits": {"attention": 4}}, 4),
        ({"bits": 8, "kinds": ["other"]}, None),
        ({"bits": 8, "kind_bits": {"attention": None}}, None),
    ],
    ids=["kinds", "kind_bits", "other-only", "attention-exempt"],
)
def test_the_kept_keys_and_values_are_attention_tensors(monkeypatch, method, settings, bits):
    """`kinds` and `kind_bits` name them as 'attention', the kind of the attention that computed them, although the
    block (kind 'other') saves them."""
    recorded = _held_keys_values(monkeypatch)
    config = _selecting_config(method, ActivationCompressionConfig(min_numel=0, **settings))
    model = _peft_model(build("llama"), config).train()
    model(**make_batch("llama", batch=4, length=32)).loss.backward()
    assert len(recorded) == 2 * model.base_model.model.config.num_hidden_layers
    for entry in recorded:
        stored = entry["stored"]
        if bits is None:
            assert stored is not None and not isinstance(stored, CompressedTensor)
        else:
            assert isinstance(stored, CompressedTensor) and stored.values.bits == bits


@pytest.mark.parametrize(("bits", "cosine_at_least"), [(8, 0.999), (4, 0.99)])
def test_gradients_with_compressed_keys_and_values_stay_close_to_the_exact_ones(bits, cosine_at_least):
    """Against the independent reference (tests/helpers/reference.py), in the terms docs/compression.md gives for saved
    activations: the gradient's cosine similarity to the exact one. The loss is exact: the forward's outputs come
    from the no-grad pass, only backward reads the stored keys and values."""
    config = _config(ActivationCompressionConfig(bits=bits, min_numel=0))
    model = get_peft_model(build("llama"), config)
    batch = make_batch("llama", batch=4, length=32)
    output, mask, grads = training_step(model, batch)
    assert model.base_model.last_compression_stats.compressed > 0
    exact_loss, exact = reference_loss_and_grads(model, "llama", batch, mask)
    torch.testing.assert_close(output.loss.detach(), exact_loss, rtol=1e-5, atol=1e-6)
    assert all(grads[name].abs().sum() > 0 for name in grads if "lora_" in name)
    flat, flat_exact = (torch.cat([g[name].flatten() for name in exact]) for g in (grads, exact))
    assert not torch.equal(flat, flat_exact)  # compressed indeed
    cosine = torch.nn.functional.cosine_similarity(flat, flat_exact, dim=0).item()
    assert cosine >= cosine_at_least, cosine


def test_unquantized_compression_and_no_compression_give_the_same_gradients():
    """`bits=None` keeps every saved tensor (the keys and values included) as it is: bit-identical gradients to a
    model without `activation_compression`, which tests/tokentune/test_tokentune_gradients.py checks against the
    reference."""
    batch = make_batch("llama", batch=4, length=32)
    plain = get_peft_model(build("llama"), _config(None))
    _, mask, expected = training_step(plain, batch)
    kept = get_peft_model(build("llama"), _config(ActivationCompressionConfig(bits=None, min_numel=0)))
    _, _, grads = training_step(kept, batch, token_mask=mask)
    assert kept.base_model.last_compression_stats.compressed == 0
    assert grads.keys() == expected.keys()
    assert all(torch.equal(grads[name], expected[name]) for name in expected)
