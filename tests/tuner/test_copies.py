"""Every method kind deep-copies and pickles, and the copy trains exactly and on its own.

Trainer, accelerate and EMA / model-averaging code deep-copy models; ``torch.save(model)`` pickles one.
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from helpers.slimfit_cases import slimfit_model
from helpers.tiny_models import make_batch
from helpers.tokentune_cases import grads_of_trainable, tokentune_model

from peft_slim import (
    ActivationCompressionConfig,
    SlimFitCallback,
    SlimFitConfig,
    TokenSelectionConfig,
    TokenTuneCallback,
    TokenTuneConfig,
    compress_activations,
)

COMPRESSION = ActivationCompressionConfig(bits=8, min_numel=0)
TOKENTUNE = {
    "tokentune+lora": dict(),
    "tokentune": dict(lora=False),
    "tokentune+lora+compression": dict(activation_compression=COMPRESSION),
}
SLIMFIT = {
    "slimfit": dict(),
    "slimfit+lora": dict(lora=True),
    "slimfit+compression": dict(activation_compression=COMPRESSION),
    "slimfit+tokentune": dict(token_selection=TokenSelectionConfig(token_ratio=0.5)),
}
KINDS = [*TOKENTUNE, *SLIMFIT]


def _model(kind: str):
    torch.manual_seed(0)
    if kind in TOKENTUNE:
        return tokentune_model("llama", **TOKENTUNE[kind])
    return slimfit_model("llama", freeze_ratio=0.5, **SLIMFIT[kind])


def _step(model, seed: int) -> tuple[dict, dict]:
    """One training step (forward, backward, SGD step, SlimFit's step); returns the gradients and the new weights."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.1)
    if hasattr(model.base_model, "slimfit_attach"):
        model.slimfit_attach(optimizer)
    model(**make_batch("llama", seed=seed)).loss.backward()
    grads = grads_of_trainable(model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if hasattr(model.base_model, "slimfit_step"):
        model.slimfit_step()
    return grads, {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    assert all(torch.equal(actual[name], expected[name]) for name in expected), "the copy trains differently"


def _pickled(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_copy_answers_and_trains_exactly_and_on_its_own(kind, how):
    model = _model(kind)
    _step(model, seed=0)  # every hook has run once (gradient checkpointing's replay too, where on)
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    duplicate = copy.deepcopy(model) if how == "deepcopy" else _pickled(model)
    batch = make_batch("llama", seed=5)
    model.eval(), duplicate.eval()
    with torch.no_grad():
        assert torch.equal(duplicate(**batch).logits, model(**batch).logits)
    # The copy's steps: the same selections (its generator is a copy), the same gradients, the same schedule...
    copy_steps = [_step(duplicate, seed) for seed in (1, 2, 3)]
    # ...while the original has not moved.
    _assert_equal({name: p.detach() for name, p in model.named_parameters()}, original)
    for seed, (grads, weights) in zip((1, 2, 3), copy_steps):
        expected_grads, expected_weights = _step(model, seed)
        _assert_equal(grads, expected_grads)
        _assert_equal(weights, expected_weights)
    if kind in SLIMFIT:
        assert duplicate.base_model.slimfit_history() == model.base_model.slimfit_history()
        assert len({tuple(row) for row in model.base_model.slimfit_history()["trained"]}) > 1  # the schedule moved


def _draw(module, args, output):
    """A random draw that changes nothing: the block then takes the step of a block with dropout (replayed)."""
    torch.rand(1)


def test_a_copy_under_gradient_checkpointing_replays_its_own_attention():
    model = _model("tokentune+lora")
    model.base_model.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.base_model.model.model.layers[0].mlp.register_forward_hook(_draw)
    with pytest.warns(UserWarning, match="draws random numbers"):
        _step(model, seed=0)  # installs the replay wrapper on the block that draws
    duplicate = copy.deepcopy(model)
    for seed in (1, 2):
        _assert_equal(_step(duplicate, seed)[0], _step(model, seed)[0])
    replay = duplicate.base_model.model.model.layers[0]._gradient_checkpointing_func
    assert replay.config is duplicate.base_model.model.config
    # torch.save of the whole model fails in transformers' own input-grad hook (a closure), as for vanilla LoRA;
    # TokenTune's replay wrapper pickles.
    assert pickle.loads(pickle.dumps(replay))._tokentune_replay


_FRESH_PROCESS = """
import json, sys, torch
sys.path.insert(0, sys.argv[2])
from helpers.tiny_models import make_batch
from helpers.tokentune_cases import grads_of_trainable
results = {}
for kind, path in json.loads(sys.argv[1]).items():
    model = torch.load(path, weights_only=False).train()
    model(**make_batch("llama", seed=1)).loss.backward()
    results[kind] = {name: grad.flatten().tolist() for name, grad in grads_of_trainable(model).items()}
print(json.dumps(results))
"""


def test_torch_load_in_a_fresh_process_gives_the_same_gradients(tmp_path):
    paths, expected = {}, {}
    for kind in KINDS:
        model = _model(kind)
        _step(model, seed=0)
        paths[kind] = str(tmp_path / f"{kind}.pt")
        torch.save(model, paths[kind])
        model.train()
        model(**make_batch("llama", seed=1)).loss.backward()
        expected[kind] = grads_of_trainable(model)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS, json.dumps(paths), tests], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    for kind in KINDS:
        got = {name: torch.tensor(values) for name, values in loaded[kind].items()}
        want = {name: grad.flatten() for name, grad in expected[kind].items()}
        _assert_equal(got, want)


@pytest.mark.parametrize(
    "value",
    [
        TokenTuneConfig(token_ratio=0.5, activation_compression=COMPRESSION),
        SlimFitConfig(freeze_ratio=0.5, token_selection=TokenSelectionConfig(num_tokens=4)),
        COMPRESSION,
        TokenSelectionConfig(token_ratio=0.25),
    ],
    ids=type,
)
def test_configs_copy_and_pickle(value):
    assert copy.deepcopy(value) == value
    assert pickle.loads(pickle.dumps(value)) == value


@pytest.mark.parametrize("make", [TokenTuneCallback, SlimFitCallback, lambda: compress_activations(bits=4)])
def test_callbacks_and_an_unused_compression_context_copy_and_pickle(make):
    for duplicate in (copy.deepcopy(make()), pickle.loads(pickle.dumps(make()))):
        assert type(duplicate) is type(make())


def test_a_copied_compression_context_compresses_on_its_own():
    context = compress_activations(bits=8, min_numel=0)
    duplicate = pickle.loads(pickle.dumps(context))
    weight = torch.randn(16, 16, requires_grad=True)
    with duplicate:
        (torch.randn(4, 16) @ weight).tanh().sum().backward()
    assert duplicate.stats.compressed > 0 and context.stats.compressed == 0
