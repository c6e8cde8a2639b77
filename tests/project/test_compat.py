"""Every private API peft_slim uses (through ``peft_slim.compat``) still exists and behaves as relied upon.

One test per compat entry (and per private API of the planner, ``peft_slim.planner.fake``) runs the real private API
of the installed torch / transformers / PEFT / TRL / Python and fails with the name of the API that moved; CI runs
them on the oldest and the newest supported versions. Where an entry guards against a silently wrong result (a build
without the row-wise kernels, a changed autograd graph, a modeling file without eager attention, enum internals), a
second test takes the API away and checks the guard. A last test keeps private APIs out of the rest of the package.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import enum
import os
import pickle
import sys
import types

import peft
import peft.utils.other
import pytest
import torch
import torch.distributed as dist
import transformers
import transformers.trainer_callback
from helpers.tiny_models import build, make_batch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import peft_slim
from peft_slim import compat
from peft_slim.compression import quant
from peft_slim.compression.classify import is_weight, module_kind
from peft_slim.planner import fake

PACKAGE = os.path.dirname(os.path.abspath(peft_slim.__file__))


def moved(api: str) -> str:
    return f"private API moved or changed behaviour: {api} (see peft_slim/compat.py)"


# ---------------------------------------------------------------------------------------------- DDP


@pytest.fixture
def process_group(tmp_path):
    """A one-process gloo group (the default group of the test process, destroyed afterwards)."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def test_active_ddp_module_is_the_wrapper_during_its_forward_only(process_group):
    api = "DistributedDataParallel._get_active_ddp_module"
    assert hasattr(DistributedDataParallel, "_get_active_ddp_module"), moved(api)
    seen = []

    class Probe(nn.Linear):
        def forward(self, x):
            seen.append(compat.active_ddp_module())
            return super().forward(x)

    ddp = DistributedDataParallel(Probe(4, 4), find_unused_parameters=True)
    assert compat.active_ddp_module() is None, moved(f"{api} (not None outside a DDP forward)")
    ddp(torch.randn(2, 4)).sum().backward()
    assert seen == [ddp], moved(f"{api} (not the running wrapper inside its forward)")
    assert compat.active_ddp_module() is None, moved(f"{api} (not reset after the forward)")
    # What SlimFit's check_ddp reads from it.
    assert ddp.find_unused_parameters is True and ddp.static_graph is False, moved("DDP.find_unused_parameters")


# ---------------------------------------------------------------------------------------------- optimizer step hooks


def test_the_optimizer_running_step_hooks_is_the_one_a_wrapper_forwards_to():
    api = "Optimizer._optimizer_step_pre_hooks"
    param = nn.Parameter(torch.ones(2))
    inner = torch.optim.SGD([param], lr=0.1)
    assert compat.optimizer_running_step_hooks(inner) is inner, moved(api)

    class Forwarder(torch.optim.Optimizer):  # as accelerate's AcceleratedOptimizer: skips Optimizer.__init__
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self, closure=None):
            return self.optimizer.step(closure)

    wrapper = Forwarder(Forwarder(inner))
    assert compat.optimizer_running_step_hooks(wrapper) is inner, moved(api)
    fired = []
    compat.optimizer_running_step_hooks(wrapper).register_step_pre_hook(lambda *args: fired.append(True))
    param.grad = torch.ones(2)
    wrapper.step()
    assert fired == [True], moved(f"{api} (the wrapped optimizer's step runs the hooks)")


# ---------------------------------------------------------------------------------------------- row-wise kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rowwise_byte_kernels_round_trip(dtype):
    api = "torch.ops.quantized.embedding_bag_byte_prepack/unpack"
    kernels = compat.rowwise_byte_kernels()
    assert kernels is not None, moved(api)
    prepack, unpack = kernels
    values = torch.randn(3, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    rows = prepack(values)
    assert rows.dtype == torch.uint8 and rows.shape == (3, 24), moved(f"{api} (layout [rows, n + 8] uint8)")
    stats = rows[:, 16:].view(torch.float32)
    exact = values.float()
    assert torch.equal(stats[:, 1], exact.amin(dim=1)), moved(f"{api} (fp32 minimum after the codes)")
    restored = unpack(rows)
    assert restored.shape == (3, 16), moved(api)
    bound = stats[:, :1] / 2 * (1 + 1e-5) + 1e-6
    assert ((restored.float() - exact).abs() <= bound).all(), moved(f"{api} (round trip within half a step)")
    # The stricter check peft_slim.compression.quant makes before using them.
    assert quant._rowwise_kernels() is not None, moved(f"{api} (quant's grid check)")


def test_rowwise_byte_kernels_missing_falls_back_to_the_packed_path(monkeypatch):
    values = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    try:
        with monkeypatch.context() as patch:
            patch.setattr(torch.ops, "quantized", types.SimpleNamespace())
            assert compat.rowwise_byte_kernels() is None
            quant._rowwise_kernels.cache_clear()
            assert quant._rowwise_kernels() is None
            quantized = quant.quantize(values.view(-1), 8, 128)
            assert not quantized.rowwise
            restored = quant.dequantize(quantized, torch.float32).view(64, 128)
            span = values.amax(dim=1, keepdim=True) - values.amin(dim=1, keepdim=True)
            assert ((restored - values).abs() <= span / 255 / 2 * (1 + 1e-4) + 1e-6).all()
    finally:
        quant._rowwise_kernels.cache_clear()
    assert quant._rowwise_kernels() is not None


# ---------------------------------------------------------------------------------------------- module classes


NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LazyBatchNorm2d)
NORMS += (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LazyInstanceNorm2d, nn.LazyBatchNorm3d)
CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
CONVS += (nn.LazyConv2d, nn.LazyConvTranspose1d)


def assert_private_base(module, name: str, bases: tuple, classes: tuple, kind: str) -> None:
    """``bases`` starts with torch's private ``module.name``, the base of every class of ``classes``, each of
    which ``module_kind`` calls ``kind``."""
    api = f"{module.__name__}.{name}"
    private = getattr(module, name, None)
    assert private is not None and bases[0] is private, moved(api)
    for cls in classes:
        assert issubclass(cls, bases), moved(f"{api} (base of {cls.__name__})")
        assert module_kind(cls) == kind


def test_norm_base_covers_batch_and_instance_norms():
    assert_private_base(nn.modules.batchnorm, "_NormBase", compat.NORM_BASE_CLASSES, NORMS, "norm")
    assert not issubclass(nn.LayerNorm, compat.NORM_BASE_CLASSES)


def test_conv_base_covers_convolutions():
    assert_private_base(nn.modules.conv, "_ConvNd", compat.CONV_BASE_CLASSES, CONVS, "linear")


def test_activation_classes_live_in_the_listed_modules():
    import transformers.activations

    classes = [nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Softmax, nn.LeakyReLU]
    classes += [transformers.activations.GELUActivation, type(transformers.activations.ACT2FN["gelu"])]
    for cls in classes:
        assert cls.__module__ in compat.ACTIVATION_MODULES, moved(f"module path of {cls.__qualname__}")
        assert module_kind(cls) == "activation"


# ---------------------------------------------------------------------------------------------- tensor internals


def test_storage_base_is_the_root_of_a_view_chain():
    api = "Tensor._base"
    tensor = torch.randn(4, 6)
    assert compat.storage_base(tensor) is tensor, moved(f"{api} (None for a non-view)")
    view = tensor.t()[1:]
    assert compat.storage_base(view) is tensor, moved(f"{api} (the root of a view of a view)")
    weight = nn.Parameter(torch.randn(3, 3))
    assert compat.storage_base(weight.t()) is weight, moved(f"{api} (a Parameter behind its transpose)")
    assert is_weight(weight.t(), None)
    assert not is_weight(torch.randn(3, 3).t(), None)


def test_tensor_version_counts_in_place_changes_of_the_storage():
    api = "Tensor._version"
    tensor = torch.zeros(4)
    view = tensor[1:]
    before = compat.tensor_version(tensor)
    assert isinstance(before, int), moved(api)
    tensor + 1  # noqa: B018 - out of place: no change
    assert compat.tensor_version(tensor) == before, moved(f"{api} (changed without an in-place op)")
    tensor.add_(1)
    assert compat.tensor_version(tensor) > before, moved(f"{api} (unchanged by an in-place op)")
    assert compat.tensor_version(view) == compat.tensor_version(tensor), moved(f"{api} (not shared with views)")


def test_autocast_copy_source_finds_the_weight_behind_its_dtype_copy():
    api = "autograd ToCopyBackward0 / AccumulateGrad.variable"
    assert compat._copy_graph_problem() is None, moved(f"{api}: {compat._copy_graph_problem()}")
    weight = nn.Parameter(torch.randn(4, 4))
    assert compat.autocast_copy_source(weight.to(torch.bfloat16).grad_fn) is weight, moved(api)
    assert compat.autocast_copy_source((weight * 2).grad_fn) is None, moved(f"{api} (matched another node)")
    # What autocast really saves for a trainable weight: its bf16 copy, recognised as the weight.
    saved = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
        torch.nn.functional.linear(torch.randn(2, 4, requires_grad=True), weight)
    roots = [compat.storage_base(t) for t in saved]
    copies = [t for t in roots if t.grad_fn is not None and compat.autocast_copy_source(t.grad_fn) is weight]
    assert copies, moved(f"{api} (autocast's saved weight copy not recognised)")
    assert all(is_weight(t, None) for t in copies)


@pytest.mark.parametrize("attr", ["_TO_COPY_NODE", "_LEAF_ATTR"])
def test_autocast_copy_source_raises_when_the_graph_changed(monkeypatch, attr):
    try:
        monkeypatch.setattr(compat, attr, "renamed_by_a_future_torch")
        compat._copy_graph_problem.cache_clear()
        weight = nn.Parameter(torch.randn(2))
        with pytest.raises(RuntimeError, match=r"torch .* has no .*(ToCopyBackward0|renamed_by_a_future_torch)"):
            compat.autocast_copy_source(weight.to(torch.float16).grad_fn)
    finally:
        monkeypatch.undo()
        compat._copy_graph_problem.cache_clear()
    assert compat._copy_graph_problem() is None


# ---------------------------------------------------------------------------------------------- attention


PROBE = "peft_slim_compat_probe"


def test_attn_implementation_switches_what_the_model_dispatches_to():
    api = "PretrainedConfig._attn_implementation"
    calls = []

    def probe(module, query, key, value, attention_mask, **kwargs):
        calls.append(type(module).__name__)
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(PROBE, probe)
    AttentionMaskInterface.register(PROBE, sdpa_mask)
    model = build("llama").train()
    batch = make_batch("llama")
    assert compat.get_attn_implementation(model.config) == "sdpa", moved(api)
    reference = model(**batch).loss
    compat.set_attn_implementation(model.config, PROBE)
    assert compat.get_attn_implementation(model.config) == PROBE, moved(api)
    probed = model(**batch).loss
    assert calls == ["LlamaAttention"] * model.config.num_hidden_layers, moved(f"{api} (not read at each forward)")
    torch.testing.assert_close(probed, reference)
    compat.set_attn_implementation(model.config, "sdpa")
    calls.clear()
    model(**batch)
    assert calls == [], moved(f"{api} (switching back had no effect)")
    # Not a transformers config: None, for the caller to refuse the model.
    assert compat.get_attn_implementation(types.SimpleNamespace()) is None


def _blocks(model):
    return model.model.layers if hasattr(model, "model") else model.bert.encoder.layer


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_checkpointing_function_is_what_the_block_checkpoints_through(arch):
    api = "GradientCheckpointingLayer._gradient_checkpointing_func"
    model = build(arch)
    blocks = _blocks(model)
    assert compat.checkpointing_function(blocks[0]) is None  # off by default
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    original = compat.checkpointing_function(blocks[0])
    assert callable(original), moved(api)
    calls = []

    def spy(function, *args, **kwargs):
        calls.append(function)
        return original(function, *args, **kwargs)

    compat.set_checkpointing_function(blocks[0], spy)
    assert compat.checkpointing_function(blocks[0]) is spy
    model.train()
    model(**make_batch(arch)).loss.backward()
    assert len(calls) == 1, moved(f"{api} (the block's forward did not checkpoint through it)")


def _attention_module(model):
    if hasattr(model, "model"):
        return model.model.layers[0].self_attn
    return model.bert.encoder.layer[0].attention.self


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_eager_attention_function_matches_sdpa(arch):
    module = _attention_module(build(arch))
    eager = compat.eager_attention_function(module)
    assert callable(eager), moved(f"module-level eager_attention_forward of {type(module).__module__}")
    generator = torch.Generator().manual_seed(0)
    kv_heads = getattr(module.config, "num_key_value_heads", module.config.num_attention_heads)
    query = torch.randn(2, module.config.num_attention_heads, 5, 8, generator=generator)
    key, value = (torch.randn(2, kv_heads, 5, 8, generator=generator) for _ in range(2))
    mask = torch.zeros(2, 1, 5, 5)
    mask[1, ..., :2] = torch.finfo(torch.float32).min
    module.eval()
    out, _ = eager(module, query, key, value, mask, scaling=module.scaling, dropout=0.0)
    expected, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, mask, scaling=module.scaling, dropout=0.0)
    torch.testing.assert_close(out, expected, msg=lambda m: moved(f"eager_attention_forward's signature: {m}"))


def test_eager_attention_function_missing_is_refused_with_a_hint(monkeypatch):
    from peft_slim.token_selection.attention import _original_attention

    module = _attention_module(build("llama"))
    monkeypatch.delattr(sys.modules[type(module).__module__], "eager_attention_forward")
    assert compat.eager_attention_function(module) is None
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        _original_attention(module, "eager")


# ---------------------------------------------------------------------------------------------- Trainer state


def test_exportable_state_is_what_the_trainer_saves():
    api = "transformers.trainer_callback.ExportableState"
    cls = compat.ExportableState
    assert cls is getattr(transformers.trainer_callback, "ExportableState", None), moved(api)
    callback = peft_slim.SlimFitCallback()
    assert isinstance(callback, cls), moved(api)
    state = transformers.TrainerState(stateful_callbacks=[callback])
    saved = {"SlimFitCallback": callback.state()}
    assert state.stateful_callbacks == saved, moved(f"{api} (not saved by the Trainer)")


def test_stored_callback_attribute_reads_the_trainer_states_format():
    api = "TrainerState.stateful_callbacks (the format ExportableState is saved in)"

    class Stateful(transformers.TrainerCallback, compat.ExportableState):
        def __init__(self, value):
            self.value = value

        def state(self) -> dict:
            return {"args": {}, "attributes": {"value": self.value}}

    one = transformers.TrainerState(stateful_callbacks=[Stateful([1, 2])])
    assert compat.stored_callback_attribute(one, Stateful(None), "value") == [1, 2], moved(api)
    two = transformers.TrainerState(stateful_callbacks=[Stateful("first"), Stateful("second")])
    assert compat.stored_callback_attribute(two, Stateful(None), "value") == "first", moved(api)
    assert compat.stored_callback_attribute(one, peft_slim.SlimFitCallback(), "value") is None


# ---------------------------------------------------------------------------------------------- PEFT


def _peft_llama(**lora):
    return get_peft_model(build("llama"), LoraConfig(r=2, target_modules=["q_proj"], **lora))


def test_lora_input_cast_is_what_a_lora_layer_casts_its_input_through():
    api = "LoraLayer._cast_input_dtype"
    model = _peft_llama()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    calls = []

    def spy(x, dtype):
        calls.append(dtype)
        return x.to(dtype)

    compat.set_lora_input_cast(layer, spy)
    model(**make_batch("llama"))
    assert calls == [layer.lora_A["default"].weight.dtype], moved(f"{api} (not called once by the LoRA forward)")


def test_auxiliary_training_wrapper_is_the_base_of_modules_to_save():
    api = "peft.utils.other.AuxiliaryTrainingWrapper"
    cls = compat.AuxiliaryTrainingWrapper
    assert cls is getattr(peft.utils.other, "AuxiliaryTrainingWrapper", None), moved(api)
    model = _peft_llama(modules_to_save=["lm_head"])
    wrapped = [name for name, module in model.named_modules() if isinstance(module, cls)]
    assert wrapped == ["base_model.model.lm_head"], moved(f"{api} (not the wrapper of modules_to_save)")


# ---------------------------------------------------------------------------------------------- enum members


def _colours():
    class Colour(str, enum.Enum):
        RED = "RED"

    Colour.__module__, Colour.__qualname__ = __name__, "Colour"
    globals()["Colour"] = Colour  # so that pickle finds the class
    return Colour


def test_add_enum_member_is_a_full_member_and_idempotent():
    api = "enum internals _member_map_ / _value2member_map_ / _member_names_"
    colour = _colours()
    blue = compat.add_enum_member(colour, "BLUE")
    assert compat.add_enum_member(colour, "BLUE") is blue
    assert colour["BLUE"] is blue and colour("BLUE") is blue and colour.BLUE is blue, moved(api)
    assert list(colour) == [colour.RED, blue] and "BLUE" in colour.__members__, moved(api)
    assert blue in colour, moved(api)
    assert colour._member_names_.count("BLUE") == 1
    assert isinstance(blue, str) and blue == "BLUE" and blue.name == blue.value == "BLUE", moved(api)
    assert pickle.loads(pickle.dumps(blue)) is blue, moved(api)
    assert compat.add_enum_member(colour, "RED") is colour.RED  # (PEFT's enum: tests/tuner/test_registration.py)


def test_add_enum_member_refuses_what_it_cannot_do(monkeypatch):
    colour = _colours()
    monkeypatch.delattr(colour, "_value2member_map_")
    with pytest.raises(RuntimeError, match=r"Python .* has no enum internals \['_value2member_map_'\]"):
        compat.add_enum_member(colour, "GREEN")
    monkeypatch.undo()
    assert "GREEN" not in colour.__members__  # nothing half-added

    class Number(enum.Enum):
        ONE = 1

    with pytest.raises(TypeError, match=r"\(str, Enum\)"):
        compat.add_enum_member(Number, "TWO")


# ---------------------------------------------------------------------------------------------- TRL


def test_trl_fused_output_is_trls_class():
    trl_utils = pytest.importorskip("trl.trainer.utils")
    api = "trl.trainer.utils.FusedCausalLMOutput"
    cls = compat.trl_fused_output_cls()
    assert cls is getattr(trl_utils, "FusedCausalLMOutput", None), moved(api)
    fields = {f.name for f in dataclasses.fields(cls)}
    assert {"loss", "log_probs", "entropy", "is_top1", "label_mask", "aux_loss"} <= fields, moved(api)


# ---------------------------------------------------------------------------------------------- loading marks


def _headless_bert(path: str) -> None:
    """A BertModel checkpoint without a pooler: loaded as BertForSequenceClassification, the pooler and the
    classifier are initialised."""
    config = transformers.BertConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=50, num_labels=3
    )
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(path)


def test_newly_initialized_parameters_are_the_missing_keys(tmp_path):
    _headless_bert(str(tmp_path))
    model, info = transformers.BertForSequenceClassification.from_pretrained(str(tmp_path), output_loading_info=True)
    assert info["missing_keys"], "the checkpoint lacks the pooler and the classifier"
    assert set(compat.newly_initialized_parameters(model)) == set(info["missing_keys"]), moved("_is_hf_initialized")
    assert compat.newly_initialized_parameters(transformers.BertForSequenceClassification(model.config)) is None
    copied = copy.deepcopy(model)
    assert compat.newly_initialized_parameters(copied) is None  # a deep copy drops the marks ...
    compat.copy_loading_marks(model, copied)
    assert set(compat.newly_initialized_parameters(copied)) == set(info["missing_keys"])  # ... which this copies


# ---------------------------------------------------------------------------------------------- one place


# Private APIs that compat wraps: no other module of the package may use them directly.
PRIVATE_ATTRIBUTES = {
    "_get_active_ddp_module",
    "_NormBase",
    "_ConvNd",
    "_attn_implementation",
    "_gradient_checkpointing_func",
    "_base",
    "_version",
    "_member_map_",
    "_value2member_map_",
    "_member_names_",
    "_name_",
    "_value_",
    "next_functions",
    "eager_attention_forward",
    "_global_optimizer_pre_hooks",
    "_global_optimizer_post_hooks",
    "_optimizer_step_pre_hooks",
    "_is_hf_initialized",
    "_cdata",
    "_cast_input_dtype",
    "find_packed_sequence_indices",
}
PRIVATE_MODULES = {
    "peft.utils.other",
    "torch._subclasses.fake_tensor",
    "torch.utils._pytree",
    "torch.utils._python_dispatch",
    "transformers.trainer_callback",
    "torch.nn.modules.batchnorm",
    "trl.trainer.utils",
}


def _private_uses(path: str) -> list[str]:
    with open(path) as handle:
        tree = ast.parse(handle.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRIBUTES:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr == "ops" and ast.unparse(node.value) == "torch":
            found.append(f"line {node.lineno}: torch.ops")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "setattr", "hasattr"):
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and name.value in PRIVATE_ATTRIBUTES:
                found.append(f"line {node.lineno}: {node.func.id}(..., {name.value!r})")
        elif isinstance(node, ast.Constant) and node.value == "ToCopyBackward0":
            found.append(f"line {node.lineno}: 'ToCopyBackward0'")
        elif isinstance(node, ast.ImportFrom) and node.module in PRIVATE_MODULES:
            found.append(f"line {node.lineno}: from {node.module} import ...")
    return found


def test_private_apis_are_used_only_through_compat():
    offenders = {}
    for folder, _, files in os.walk(PACKAGE):
        for file in files:
            path = os.path.join(folder, file)
            if file.endswith(".py") and path not in (compat.__file__, fake.__file__):
                uses = _private_uses(path)
                if uses:
                    offenders[os.path.relpath(path, PACKAGE)] = uses
    assert not offenders, f"use these private APIs through peft_slim.compat (add an entry there): {offenders}"
    assert _private_uses(compat.__file__), "the scan no longer finds the private APIs in compat.py itself"
    assert _private_uses(fake.__file__), "the scan no longer finds the planner's private APIs in planner/fake.py"


# ---------------------------------------------------------------------------------------------- fake tensors
# compat's storage_key / is_fake_tensor / outside_fake_mode, and the planner's own (peft_slim.planner.fake).


def test_storage_key_is_shared_by_views_and_works_without_data():
    api = "UntypedStorage._cdata"
    real = torch.zeros(8)
    assert compat.storage_key(real[2:]) == compat.storage_key(real) == real.untyped_storage().data_ptr()
    meta, other = torch.empty(8, device="meta"), torch.empty(8, device="meta")
    assert compat.storage_key(meta[1:]) == compat.storage_key(meta), moved(api)
    assert compat.storage_key(meta) != compat.storage_key(other), moved(api)


def test_fake_tensor_mode_computes_shapes_only_and_can_be_left():
    api = "torch._subclasses.fake_tensor (FakeTensorMode, unset_fake_temporarily)"
    with fake.fake_tensor_mode():
        shaped = torch.ones(3, 4) @ torch.ones(4, 5)
        with compat.outside_fake_mode():
            real = torch.ones(2) + 1
    assert compat.is_fake_tensor(shaped) and shaped.shape == (3, 5), moved(api)
    assert not compat.is_fake_tensor(real) and real.tolist() == [2.0, 2.0], moved(api)
    assert not compat.is_fake_tensor(torch.ones(1))


def test_torch_dispatch_mode_sees_every_operator():
    seen = []

    class Spy(fake.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Spy():
        torch.ones(2).sin()
    assert torch.ops.aten.sin.default in seen, moved("torch.utils._python_dispatch.TorchDispatchMode")


def test_one_sequence_per_row_leaves_sdpa_its_causal_mask_on_fake_position_ids():
    """Real position ids of one sequence per row: no packing found, no mask built (SDPA's is_causal). Fake ones
    have no values, so transformers keeps a packed-sequence tensor and builds a mask unless the planner says."""
    api = "transformers.masking_utils.find_packed_sequence_indices (called through the module by create_causal_mask)"
    masking = transformers.masking_utils
    config = transformers.LlamaConfig(hidden_size=8, num_attention_heads=2, num_hidden_layers=1)
    config._attn_implementation = "sdpa"
    find = masking.find_packed_sequence_indices

    def causal_mask():
        embeds, positions = torch.zeros(2, 6, 8), torch.arange(6)[None]
        return masking.create_causal_mask(config, embeds, None, None, position_ids=positions)

    assert find(torch.arange(6)[None].expand(2, 6)) is None, moved(api)
    assert find(torch.tensor([[0, 1, 2, 0, 1, 2]])).tolist() == [[0, 0, 0, 1, 1, 1]], moved(api)
    assert causal_mask() is None, moved(api)
    with fake.fake_tensor_mode():
        assert causal_mask() is not None, moved(f"{api}: a fake trace now finds no packing by itself")
        with fake.one_sequence_per_row():
            assert causal_mask() is None, moved(api)
    with fake.one_sequence_per_row():  # real position ids are still read
        packed = masking.find_packed_sequence_indices(torch.tensor([[0, 1, 0, 1]]))
        assert packed.tolist() == [[0, 0, 1, 1]]
    assert masking.find_packed_sequence_indices is find


def test_tree_leaves_are_the_nested_values():
    tree = (torch.ones(1), [2, {"a": 3}])
    assert [type(x) for x in fake.tree_leaves(tree)] == [torch.Tensor, int, int], moved("torch.utils._pytree")
