"""Operators' results on meta tensors remembered by their arguments' metadata (``trace.MetaResults``): a remembered
result is the one the meta kernel gives (shape, strides, dtype, storage bytes, a storage of its own; an in-place
operator's target returned), operators that alias are never remembered, and a traced step's estimate is the same
with or without them."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers.planner_cases import llama_config

import peft_slim
from peft_slim.compat import storage_key
from peft_slim.planner import estimate, trace

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def described(tensor: torch.Tensor) -> tuple:
    return tensor.shape, tensor.stride(), tensor.dtype, tensor.storage_offset(), tensor.untyped_storage().nbytes()


def meta(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


CALLS = {  # operator, arguments: each run twice on arguments alike, the second from what was remembered
    "strides follow the input's": (aten.empty_like.default, lambda: (meta(8, 4).t(),)),
    "dtype promotion by a python scalar's type": (aten.add.Tensor, lambda: (meta(4, dtype=torch.int64), 1.5)),
    "an int scalar keeps the dtype": (aten.add.Tensor, lambda: (meta(4, dtype=torch.int64), 1)),
    "several results": (aten.native_layer_norm.default, lambda: (meta(2, 3, 8), [8], meta(8), meta(8), 1e-5)),
    "broadcasting": (aten.mul.Tensor, lambda: (meta(3, 1), meta(1, 5))),
}


@pytest.mark.parametrize("name", CALLS)
def test_a_remembered_result_is_the_meta_kernels(name):
    func, make = CALLS[name]
    results = trace.MetaResults()
    kernel = func(*make())
    first, again = results.run(func, make(), {}), results.run(func, make(), {})
    assert len(results._results) == 1 and next(iter(results._results.values())) is not None
    for found in (first, again):
        expected = kernel if isinstance(kernel, tuple) else (kernel,)
        found = found if isinstance(found, tuple) else (found,)
        assert [described(t) for t in found] == [described(t) for t in expected]
        assert len({storage_key(t) for t in found}) == len(found)


def test_arguments_of_other_strides_dtypes_or_scalar_types_are_other_keys():
    base = meta(8, 8)
    calls = [(base, 2), (base, 2.0), (base, True), (base.t(), 2), (base[1:], 2), (base.to(torch.bfloat16), 2)]
    assert len({trace._key(aten.mul.Tensor, args, {}) for args in calls}) == len(calls)
    assert trace._key(aten.mul.Tensor, (torch.empty(2), 2), {}) is None  # a real tensor: its kernel runs


def test_a_result_on_arguments_of_other_strides_is_not_taken_from_the_first():
    results = trace.MetaResults()
    for tensor in (meta(8, 4), meta(4, 8).t(), meta(8, 4)):
        assert described(results.run(aten.empty_like.default, (tensor,), {})) == described(torch.empty_like(tensor))


def test_an_in_place_operator_returns_its_target_and_views_are_never_remembered():
    results = trace.MetaResults()
    target = meta(4, 4)
    for _ in range(2):
        assert results.run(aten.add_.Tensor, (target, meta(4)), {}) is target
    assert trace._kind(aten.view.default) is None and trace._kind(aten.add.out) == trace.OUT
    assert trace._kind(aten.unsqueeze_.default) is None  # changes its target's shape
    assert trace._kind(aten._unsafe_view.default) == trace.NEW  # returns its input's storage: found on its first run
    viewed = meta(2, 6)
    results.run(aten._unsafe_view.default, (viewed, [3, 4]), {})
    again = results.run(aten._unsafe_view.default, (viewed, [3, 4]), {})
    assert storage_key(again) == storage_key(viewed)


def test_an_out_operator_returns_its_out_and_one_that_resizes_it_is_not_remembered():
    results = trace.MetaResults()
    scores = meta(3, 5)
    for _ in range(2):  # the chunked loss's log-softmax, written over its input
        assert results.run(aten._log_softmax.out, (scores, -1, False), {"out": scores}) is scores
    assert described(scores) == described(meta(3, 5)) and list(results._results.values()) == [(True, ())]
    for _ in range(2):  # an out of another shape is resized by the kernel: its result is the kernel's every time
        out = meta(0)
        assert results.run(aten.add.out, (meta(2, 3), meta(3)), {"out": out}) is out and out.shape == (2, 3)
    assert list(results._results.values())[1] is None
    assert trace._kind(aten.split_with_sizes_copy.out) is None  # writes several tensors: never remembered


def test_a_traced_step_is_estimated_alike_with_and_without_remembered_results(monkeypatch):
    config = llama_config(num_hidden_layers=2)
    tokentune = peft_slim.TokenTuneConfig(task_type="CAUSAL_LM", token_ratio=0.3, activation_compression={"bits": 8})
    step = (tokentune, 2, 64, "adamw", "bfloat16", None, True)
    monkeypatch.setattr(trace, "META_RESULTS", trace.MetaResults())
    remembered = [estimate.traced(config, step) for _ in range(2)]  # the second one from what the first remembered
    monkeypatch.setattr(trace.MetaResults, "run", lambda self, func, args, kwargs: func(*args, **kwargs))
    assert remembered == [estimate.traced(config, step)] * 2


def test_a_model_without_weights_is_built_without_drawing_values():
    """Inside ``values_not_drawn`` torch.nn.init leaves tensors as they are (PEFT's adapters are drawn on the CPU,
    then moved to the meta device); outside it, it draws again."""
    from peft_slim.planner import setup

    tensor = torch.zeros(4, 4)
    with setup.values_not_drawn():
        assert torch.nn.init.kaiming_uniform_(tensor, a=5**0.5) is tensor and not tensor.any()
        assert torch.nn.Linear(4, 4).weight.shape == (4, 4)
    torch.nn.init.kaiming_uniform_(tensor, a=5**0.5)
    assert tensor.any()


def test_the_selected_queries_causal_mask_is_built_on_meta_with_the_same_estimate(monkeypatch):
    """In a meta trace TokenTune's causal mask of the selected queries is built on the keys' meta device (its values
    are not computed), a tensor like the real one, and the step's estimate is the one with the mask built for real."""
    from peft_slim.token_selection.selection import TokenSelection

    selection = TokenSelection.from_mask(torch.tensor([[True, False, True, True], [False, True, True, False]]))
    real = selection.causal_mask(torch.zeros(2, 1, 4, 8))
    on_meta = TokenSelection(selection.mask, selection.index, selection.valid).causal_mask(
        torch.zeros(2, 1, 4, 8, device="meta")
    )
    assert on_meta.is_meta and described(on_meta) == described(real) and not selection.index.is_meta
    assert real.equal(torch.arange(4)[None, None, :] <= selection.index[:, None, :, None])
    config = llama_config(num_hidden_layers=2)
    tokentune = peft_slim.TokenTuneConfig(task_type="CAUSAL_LM", token_ratio=0.3)
    step = (tokentune, 2, 64, "adamw", "bfloat16", None, False)
    built = estimate.traced(config, step)
    on_index_device = TokenSelection.causal_mask

    def with_values(self, key):  # the mask computed for real, on the index's device, then moved to the keys'
        stand_in = torch.empty(0, 0, key.shape[2], 0, device=self.index.device)  # the length, on the index's device
        return on_index_device(self, stand_in).to(key.device)

    monkeypatch.setattr(TokenSelection, "causal_mask", with_values)
    assert estimate.traced(config, step) == built
