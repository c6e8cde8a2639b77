"""compress_activations on tiny models: gradient accuracy, exactness when off, what is never compressed, nesting."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading

import pytest
import torch
from helpers.tiny_models import LORA_TARGETS, build, make_batch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.autograd.graph import save_on_cpu

import peft_slim.compression.hooks as hooks
from peft_slim import ActivationCompressionConfig, compress_activations
from peft_slim.compression.classify import module_kind
from peft_slim.compression.tensor import CompressedTensor
from peft_slim.memory import SavedActivationBytes

# Tiny models have rows (tokens) of 32 values: one group per token, and every saved tensor is considered.
TINY = dict(group_size=32, min_numel=0)


def _model(arch: str, lora: bool, dtype=torch.float32) -> nn.Module:
    model = build(arch).to(dtype)
    if lora:
        # B = 0 at init would leave A without gradient: start from random A and B, so every adapter weight learns.
        model = get_peft_model(model, LoraConfig(r=4, target_modules=LORA_TARGETS[arch], init_lora_weights=False))
    return model.train()


def _grads(model: nn.Module, batch: dict, context=None) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    with context if context is not None else contextlib.nullcontext():
        loss = model(**batch).loss
    loss.backward()
    return torch.cat([p.grad.flatten().float() for p in model.parameters() if p.requires_grad])


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()


def _recording(context):
    """Record (saved tensor, what the pack hook stored for it, its kind, the innermost module) for every tensor
    autograd saves in ``context``."""
    calls = []
    pack = context.pack_hook

    def recording_pack(tensor):
        module = context._modules.innermost
        saved = pack(tensor)  # the stored form: a tensor or a CompressedTensor
        kind = "other" if module is None else module_kind(type(module))
        calls.append((tensor.detach(), saved.value, kind, module))
        return saved

    context.pack_hook = recording_pack
    return calls


@pytest.mark.parametrize("arch", ["llama", "bert"])
@pytest.mark.parametrize("lora", [False, True])
def test_bits_none_is_exact_and_counts_what_autograd_saves(arch, lora):
    model = _model(arch, lora)
    batch = make_batch(arch, batch=4, length=32)
    reference = _grads(model, batch)
    context = compress_activations(bits=None, **TINY)
    assert torch.equal(_grads(model, batch, context), reference)
    with SavedActivationBytes(model.parameters()) as saved:
        model(**batch)
    assert context.stats.original_bytes == context.stats.stored_bytes == saved.bytes
    assert context.stats.compressed == 0


@pytest.mark.parametrize("arch", ["llama", "bert"])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("bits, min_cosine, max_ratio", [(8, 0.999, 0.45), (4, 0.99, 0.32)])
def test_gradients_stay_close_to_uncompressed(arch, lora, bits, min_cosine, max_ratio):
    model = _model(arch, lora)
    batch = make_batch(arch, batch=4, length=32)  # padded rows included
    reference = _grads(model, batch)
    context = compress_activations(bits=bits, **TINY)
    cosine = _cosine(_grads(model, batch, context), reference)
    assert cosine >= min_cosine, cosine
    # Tiny models save many small integer and statistics tensors, which stay as they are.
    assert context.stats.compressed > 10
    assert context.stats.ratio <= max_ratio, context.stats


@pytest.mark.parametrize("autocast", [False, True])
def test_weights_and_their_views_and_casts_are_never_compressed(autocast):
    model = _model("llama", lora=True)
    weights = [p.detach() for p in model.parameters()]
    before = [w.clone() for w in weights]
    batch = make_batch("llama", batch=4, length=32)
    context = compress_activations(bits=4, **TINY)
    calls = _recording(context)
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with cast, context:
        loss = model(**batch).loss
    loss.backward()

    def is_weight_copy(tensor):
        for weight in weights:
            copy = weight.to(tensor.dtype)
            for form in (copy, copy.t()) if copy.dim() == 2 else (copy,):
                if form.shape == tensor.shape and torch.equal(form, tensor):
                    return True
        return False

    seen = [packed for tensor, packed, *_ in calls if is_weight_copy(tensor)]
    assert seen  # frozen base weights (as views, or autocast's bf16 copies) are saved for the input gradient
    assert not any(isinstance(packed, CompressedTensor) for packed in seen)
    assert any(isinstance(packed, CompressedTensor) for _, packed, *_ in calls)
    assert all(torch.equal(w, b) for w, b in zip(weights, before))


def test_integer_boolean_and_small_tensors_are_left_alone():
    x = torch.randn(64, 64, requires_grad=True)
    mask = torch.rand(64, 64) > 0.5
    index = torch.randint(0, 64, (64,))
    context = compress_activations(bits=2, group_size=32, min_numel=1000)
    calls = _recording(context)
    with context:
        h = x * 2
        out = torch.where(mask, h, h * 3)[index].sum() + (h[:2, :2] ** 2).sum()
    out.backward()
    for tensor, packed, *_ in calls:
        compressed = isinstance(packed, CompressedTensor)
        assert compressed == (tensor.is_floating_point() and tensor.numel() >= 1000), tensor.shape
        if not compressed:
            assert packed.data_ptr() == tensor.data_ptr()  # the tensor itself, not a copy
    dtypes = {tensor.dtype for tensor, *_ in calls}
    assert {torch.bool, torch.int64, torch.float32} <= dtypes


def test_a_tensor_saved_several_times_is_compressed_once(monkeypatch):
    compressed = []
    compress = hooks.compress
    monkeypatch.setattr(hooks, "compress", lambda tensor, *args: compressed.append(tensor) or compress(tensor, *args))
    torch.manual_seed(0)
    layers = [nn.Linear(32, 32) for _ in range(3)]
    x = torch.randn(64, 32, requires_grad=True)
    with compress_activations(bits=8, **TINY) as context:
        h = nn.functional.gelu(x * 1.0)  # gelu saves its input
        out = sum(layer(h) for layer in layers)  # each layer saves `h` for its weight gradient
    out.pow(2).sum().backward()
    assert len(compressed) == context.stats.compressed == 2
    # two tensors of 64 x 32 values: one byte each, plus an fp32 scale and minimum per row of 32
    assert context.stats.stored_bytes == 2 * (64 * 32 + 64 * 2 * 4)
    assert context.stats.original_bytes == 2 * 64 * 32 * 4


def test_kinds_select_what_is_compressed():
    model = _model("llama", lora=False)
    batch = make_batch("llama", batch=4, length=32)
    counts = {}
    for kinds in ("all", "attention", "norm", "activation", "linear", "other"):
        with compress_activations(bits=8, kinds=kinds, **TINY) as context:
            model(**batch)
        counts[kinds] = context.stats.compressed
    assert counts["activation"] == model.config.num_hidden_layers  # one SiLU input per MLP
    assert all(counts[kind] > 0 for kind in counts)
    assert counts["all"] <= sum(count for kind, count in counts.items() if kind != "all")


def test_module_kinds_of_the_supported_architectures():
    llama, bert, gpt2 = build("llama"), build("bert"), build("gpt2")
    layer = llama.model.layers[0]
    assert module_kind(type(layer.self_attn)) == "attention"
    assert module_kind(type(layer.self_attn.q_proj)) == "linear"
    assert module_kind(type(layer.input_layernorm)) == "norm"
    assert module_kind(type(layer.mlp.act_fn)) == "activation"
    assert module_kind(type(layer.mlp)) == "other"
    assert module_kind(type(bert.bert.encoder.layer[0].attention.self)) == "attention"
    assert module_kind(type(bert.bert.encoder.layer[0].intermediate.intermediate_act_fn)) == "activation"
    assert module_kind(type(bert.bert.embeddings.LayerNorm)) == "norm"
    assert module_kind(type(gpt2.transformer.h[0].attn.c_attn)) == "linear"  # transformers' Conv1D
    assert module_kind(type(gpt2.transformer.h[0].mlp)) == "other"


def test_pruning_applies_to_its_kinds_only():
    model = _model("llama", lora=False)
    batch = make_batch("llama", batch=4, length=32)
    context = compress_activations(bits=None, prune_ratio=0.5, prune_kinds=["norm"], **TINY)
    calls = _recording(context)
    gradients = _grads(model, batch, context)
    pruned = [packed for _, packed, *_ in calls if isinstance(packed, CompressedTensor)]
    assert pruned and all(packed.positions is not None for packed in pruned)
    assert len({id(p) for p in pruned}) == context.stats.compressed
    # only what norms save is pruned; the other kinds' (floating-point, large enough) activations are kept as they are
    assert {kind for _, packed, kind, _ in calls if isinstance(packed, CompressedTensor)} == {"norm"}
    kept = {
        kind for _, packed, kind, _ in calls if not isinstance(packed, CompressedTensor) and packed.is_floating_point()
    }
    assert {"attention", "activation", "linear"} <= kept
    assert torch.isfinite(gradients).all()


@pytest.mark.parametrize("reentrant", [False, True])
def test_nesting_with_activation_checkpointing(reentrant):
    model = _model("llama", lora=False)
    batch = make_batch("llama", batch=4, length=32)
    reference = _grads(model, batch)
    plain = compress_activations(bits=8, **TINY)
    _grads(model, batch, plain)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    context = compress_activations(bits=8, **TINY)
    assert _cosine(_grads(model, batch, context), reference) >= 0.999
    # Inside the checkpointed layers, checkpointing's own hooks are the innermost: only what is saved
    # outside them (and, with the reentrant variant, the layers' inputs) is compressed.
    assert 0 < context.stats.compressed < plain.stats.compressed


def test_nesting_with_save_on_cpu():
    model = _model("llama", lora=True)
    batch = make_batch("llama", batch=4, length=32)
    reference = _grads(model, batch)
    outer = compress_activations(bits=8, **TINY)
    with outer, save_on_cpu():  # save_on_cpu is the innermost: it handles every tensor (exactly, on CPU)
        assert torch.equal(_grads(model, batch), reference)
    assert outer.stats.compressed == 0
    inner = compress_activations(bits=8, **TINY)
    with save_on_cpu():
        gradients = _grads(model, batch, inner)
    assert inner.stats.compressed > 0
    assert _cosine(gradients, reference) >= 0.999


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_activations(dtype):
    model = _model("llama", lora=True, dtype=dtype)
    batch = make_batch("llama", batch=4, length=32)
    reference = _grads(model, batch)
    context = compress_activations(bits=8, **TINY)
    gradients = _grads(model, batch, context)
    assert _cosine(gradients, reference) >= 0.999
    assert context.stats.compressed > 10 and context.stats.ratio < 0.7


def test_an_exception_inside_leaves_nothing_installed():
    model = _model("llama", lora=True)
    batch = make_batch("llama", batch=4, length=32)
    reference = _grads(model, batch)
    with pytest.raises(RuntimeError, match="boom"), compress_activations(bits=2, **TINY):
        model(**batch)
        raise RuntimeError("boom")
    assert torch.equal(_grads(model, batch), reference)  # no compression hook left behind


def test_offload_alone_is_a_no_op_on_cpu():
    model = _model("llama", lora=True)
    batch = make_batch("llama", batch=4, length=32)
    reference = _grads(model, batch)
    context = compress_activations(bits=None, offload=True, **TINY)
    assert torch.equal(_grads(model, batch, context), reference)
    assert context.stats.compressed == 0


@pytest.mark.cuda
@pytest.mark.parametrize("offload", [False, True])
def test_cuda(offload):
    model = _model("llama", lora=True).cuda()
    batch = {key: value.cuda() for key, value in make_batch("llama", batch=4, length=32).items()}
    reference = _grads(model, batch)
    context = compress_activations(bits=8, offload=offload, **TINY)
    assert _cosine(_grads(model, batch, context), reference) >= 0.999
    assert context.stats.compressed > 10


def test_kind_bits_store_each_kind_at_its_width():
    """4-bit GELU inputs and 8-bit elsewhere: the activation kind's stored bytes shrink to about half."""
    stored = {}
    for name, kind_bits in (("uniform", None), ("mixed", {"activation": 4})):
        model = build("bert")
        model.train()
        config = ActivationCompressionConfig(bits=8, min_numel=0, kind_bits=kind_bits)
        with compress_activations(config) as compression:
            model(**make_batch("bert", batch=4, length=64)).loss.backward()
        stored[name] = compression.stats.stored_bytes
        assert compression.stats.compressed > 0
    assert stored["mixed"] < stored["uniform"]


def test_kind_bits_apply_per_kind_even_outside_kinds():
    model = _model("llama", lora=True)
    batch = make_batch("llama", batch=4, length=32)
    config = ActivationCompressionConfig(
        bits=8, kinds=["attention", "norm"], kind_bits={"activation": 4, "norm": None}, **TINY
    )
    context = compress_activations(config)
    calls = _recording(context)
    _grads(model, batch, context)
    widths = {}
    for _, packed, kind, _ in calls:
        if isinstance(packed, CompressedTensor):
            widths.setdefault(kind, set()).add(packed.values.bits)
            # codes at the kind's width plus an fp32 scale and minimum per group of 32
            numel = packed.shape.numel()
            assert packed.nbytes == numel * packed.values.bits // 8 + numel // 32 * 8
    # activation: listed in kind_bits though not in kinds; norm: in kinds but kept by kind_bits
    assert widths == {"attention": {8}, "activation": {4}}


def test_prune_frozen_only_leaves_trainable_norms_exact():
    model = _model("llama", lora=False)
    frozen_norm = model.model.layers[0].input_layernorm
    frozen_norm.weight.requires_grad_(False)
    batch = make_batch("llama", batch=4, length=32)
    context = compress_activations(bits=None, prune_ratio=0.1, prune_frozen_only=True, **TINY)
    calls = _recording(context)
    _grads(model, batch, context)
    norms = [(module, packed) for _, packed, kind, module in calls if kind == "norm"]
    pruned = [module for module, packed in norms if isinstance(packed, CompressedTensor)]
    assert pruned and all(module is frozen_norm for module in pruned)
    assert all(packed.positions is not None for _, packed in norms if isinstance(packed, CompressedTensor))
    trainable = [packed for module, packed in norms if module is not frozen_norm]
    assert trainable and not any(isinstance(packed, CompressedTensor) for packed in trainable)
    # without the restriction every norm is pruned
    context = compress_activations(bits=None, prune_ratio=0.1, **TINY)
    calls = _recording(context)
    _grads(model, batch, context)
    assert {module for _, packed, _, module in calls if isinstance(packed, CompressedTensor)} > {frozen_norm}


# ---------------------------------------------------------------- one thread and one context only

# GELU inputs at 4 bits, the rest at 8: a tensor taken for another module's kind is stored at the wrong width.
_SCOPED = ActivationCompressionConfig(bits=8, kind_bits={"activation": 4}, **TINY)


def _scoped_models():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
    b = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32))
    return a, b, torch.randn(64, 32), torch.randn(64, 32)


def _forward(model, x):
    return model(x).pow(2).sum()


def _weight_grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _alone(model_a, model_b, x_a, x_b):
    """Each model trained by itself: A inside its own compression context, B without any."""
    with compress_activations(_SCOPED) as context:
        loss = _forward(model_a, x_a)
    return _weight_grads(model_a, loss), context.stats, _weight_grads(model_b, _forward(model_b, x_b))


def _pause(arrived: threading.Event, resume: threading.Event):
    """A forward pre-hook that says it has arrived, then waits for ``resume`` (on the module stack by then)."""

    def hook(module, args):
        arrived.set()
        assert resume.wait(timeout=60), "the other thread never got there"  # a deadlock guard, not a timing check

    return hook


@pytest.mark.parametrize("b_context", ["new thread", "copy of A's context"])
def test_another_threads_model_is_untouched_and_does_not_disturb_the_context(b_context):
    """Thread A trains model A inside compress_activations while thread B trains model B without it.

    Interleaved by events: A stops inside its GELU (on A's module stack), B runs until it is inside its
    LayerNorm, A saves the GELU's input and finishes its forward, then B finishes. Global module hooks see
    both threads; a stack shared between them would take A's GELU input for B's LayerNorm (a norm: 8 bits).
    "copy of A's context" starts B as ``asyncio.to_thread`` does, with A's contextvars.
    """
    model_a, model_b, x_a, x_b = _scoped_models()
    grads_a, stats_a, grads_b = _alone(model_a, model_b, x_a, x_b)
    a_inside, b_inside, a_done, b_done = (threading.Event() for _ in range(4))
    model_a[1].register_forward_pre_hook(_pause(a_inside, b_inside))
    model_b[1].register_forward_pre_hook(_pause(b_inside, a_done))
    result = {}

    def train_b():
        try:
            assert a_inside.wait(timeout=60)
            result["b"] = _weight_grads(model_b, _forward(model_b, x_b))
        finally:
            b_done.set()

    with compress_activations(_SCOPED) as context:
        run = contextvars.copy_context().run if b_context != "new thread" else (lambda f: f())
        thread = threading.Thread(target=run, args=(train_b,))
        thread.start()
        try:
            loss = _forward(model_a, x_a)
        finally:
            a_done.set()
            b_done.wait(timeout=60)  # B's whole forward and backward happen while A's context is open
    thread.join()
    assert torch.equal(result["b"], grads_b)  # not compressed: bit-identical to B trained alone
    assert context.stats.compressed > 0
    assert context.stats == stats_a  # A's tensors: the same kinds, widths and bytes as A trained alone
    assert torch.equal(_weight_grads(model_a, loss), grads_a)


def test_an_asyncio_task_created_outside_the_context_is_untouched():
    """torch's saved-tensor hooks are per thread: task B, started before task A entered the context, runs while
    A's hooks are installed in the same thread, and must be neither compressed nor counted."""
    model_a, model_b, x_a, x_b = _scoped_models()
    grads_a, stats_a, grads_b = _alone(model_a, model_b, x_a, x_b)
    result = {}

    async def main():
        a_inside, b_done = asyncio.Event(), asyncio.Event()

        async def task_a():
            with compress_activations(_SCOPED) as context:
                a_inside.set()
                await b_done.wait()  # B trains while A's context is open
                loss = _forward(model_a, x_a)
            result["a"] = _weight_grads(model_a, loss), context.stats

        async def task_b():
            await a_inside.wait()
            result["b"] = _weight_grads(model_b, _forward(model_b, x_b))
            b_done.set()

        await asyncio.gather(task_a(), task_b())  # each task runs in a copy of this (compression-free) context

    asyncio.run(main())
    assert torch.equal(result["b"], grads_b)
    assert result["a"][1] == stats_a and stats_a.compressed > 0
    assert torch.equal(result["a"][0], grads_a)


class _Gelu(nn.Module):
    def forward(self, x):
        return torch.nn.functional.gelu(x)


_SHARED_GELU = _Gelu()  # a module-level module, as transformers' kernelized functions are (not a submodule)


class _CallsAModuleItDoesNotHold(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return _SHARED_GELU(self.linear(x))


def test_a_model_runs_modules_that_are_not_its_submodules():
    """Why the module stack needs global module hooks (classify.py): tensors saved inside a module the model calls
    but does not hold (transformers' kernelized functions, e.g. Llama's apply_rotary_pos_emb on recent releases)
    take that module's kind; hooks on the model's own modules would never see it."""
    model = _CallsAModuleItDoesNotHold()
    assert all(module is not _SHARED_GELU for module in model.modules())
    context = compress_activations(ActivationCompressionConfig(bits=None))
    calls = _recording(context)
    with context:
        model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert any(module is _SHARED_GELU for *_, module in calls)  # gelu saves its input inside _SHARED_GELU
