"""Full fine-tuning with TokenTune or SlimFit on the tiny architectures: the cases, and a few AdamW steps that
record every gradient and the parameters after the last step, as digests
(``tests/helpers/data/full_finetuning.json``)."""

from __future__ import annotations

import hashlib
import json
import os

import torch

from helpers.slimfit_cases import PAPER
from helpers.tiny_models import BUILDERS, build, make_batch

STEPS = 3
DATA = os.path.join(os.path.dirname(__file__), "data", "full_finetuning.json")

# Compression that acts on the tiny models' saved tensors (the default min_numel keeps them all).
COMPRESSION = {"bits": 4, "kind_bits": {"activation": 2}, "group_size": 32, "min_numel": 0}
# name -> (method, architecture, config fields)
CASES: dict[str, tuple[str, str, dict]] = {
    **{f"tokentune-{arch}": ("tokentune", arch, {}) for arch in BUILDERS},
    "tokentune-llama-compressed": ("tokentune", "llama", {"activation_compression": COMPRESSION}),
    "tokentune-gpt2-modules": ("tokentune", "gpt2", {"trainable_modules": ["c_attn"]}),
    **{
        f"slimfit-{arch}": ("slimfit", arch, {**PAPER, "activation_compression": None})
        for arch in ("bert", "vit", "gpt2", "llama")
    },
    "slimfit-llama-defaults": ("slimfit", "llama", {}),
    "slimfit-gpt2-compressed": ("slimfit", "gpt2", {**PAPER, "activation_compression": COMPRESSION}),
    "slimfit-llama-tokentune": (
        "slimfit",
        "llama",
        {"activation_compression": None, "token_selection": {"token_ratio": 0.5, "seed": 0}},
    ),
}


def config_fields(method: str, arch: str, fields: dict) -> dict:
    """The config's fields of a case: TokenTune selects 40% of the tokens (seed 0); both seeded."""
    if method == "tokentune":
        return {"token_ratio": 0.4, "seed": 0, **fields}
    return {"seed": 0, **fields}


def digest(tensor: torch.Tensor) -> list:
    """[sha256 of the fp32 bytes, their float64 sum]: equal digests mean bit-identical tensors."""
    data = tensor.detach().contiguous().cpu()
    return [hashlib.sha256(data.numpy().tobytes()).hexdigest(), float(data.double().sum())]


def run_case(name: str, wrap) -> dict:
    """Build the case's model (seed 0), ``wrap(model, method, fields)`` it (returning what to call and what steps
    the schedule, or None), train ``STEPS`` AdamW steps; digests of every gradient (by step) and of the parameters
    after the last step, by the plain model's parameter names."""
    method, arch, fields = CASES[name]
    model = build(arch)
    trained, stepper = wrap(model, method, config_fields(method, arch, fields))
    trained.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if stepper is not None:
        stepper.slimfit_attach(optimizer)
    record: dict = {"grads": [], "params": {}}
    for step in range(STEPS):
        torch.manual_seed(step)
        output = trained(**make_batch(arch, seed=step))
        output.loss.backward()
        record["grads"].append({n: digest(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if stepper is not None:
            stepper.slimfit_step()
    record["params"] = {n: digest(p) for n, p in model.named_parameters()}
    return record


def recorded() -> dict:
    with open(DATA) as handle:
        return json.load(handle)
