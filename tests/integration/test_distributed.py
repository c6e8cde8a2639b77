"""Training under 2 processes on CPU (gloo): DDP and FSDP2, torchrun, transformers.Trainer.

One torchrun launch (tests/helpers/distributed_worker.py) runs every available case of
tests/helpers/distributed_cases.py and two Trainer runs (TokenTune; SlimFit + SlimFitCallback); the tests below check
its results against single-process runs in this process. The launch sets PEFT_SLIM_CHECK_RANKS=1 (SlimFit's
cross-rank check).
FSDP means FSDP2 ``fully_shard``: FSDP1 refuses a machine without an accelerator (see the last test).
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from helpers.distributed_cases import (
    CASES,
    LR,
    SEED,
    SLIMFIT_TRAINER_INIT,
    TRAINER_INIT,
    WORLD,
    global_batches,
    labelled,
    load_model,
    new_model,
    peft_config,
    shard,
    slimfit_trainer_config,
    train_step,
    trainable_names,
    trainer_config,
)
from helpers.reference import reference_forward, selected_causal_lm_loss

from peft_slim.token_selection.selection import selection_generator

WORKER = Path(__file__).parents[1] / "helpers" / "distributed_worker.py"
CASE_PARAMS = [pytest.param(case, id=case.name) for case in CASES]


class Runs:
    """Results of the launch: ``result(name)`` is the list of the ranks' results."""

    def __init__(self, out: Path, init: Path, process: subprocess.CompletedProcess, init_errors: dict[str, str]):
        self.out, self.init, self.process, self.init_errors = out, init, process, init_errors

    def result(self, name: str) -> list[dict]:
        if name in self.init_errors:
            pytest.fail(f"{name}: building its starting checkpoint failed:\n{self.init_errors[name]}")
        files = [self.out / name / f"rank{rank}.pt" for rank in range(WORLD)]
        if not all(f.exists() for f in files):
            output = (self.process.stdout + self.process.stderr)[-6000:]
            pytest.fail(f"torchrun exited with {self.process.returncode} before {name} finished:\n{output}")
        results = [torch.load(f, weights_only=False) for f in files]
        for rank, result in enumerate(results):
            if "error" in result:
                pytest.fail(f"{name} failed on rank {rank}:\n{result['error']}")
        return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    out = tmp_path_factory.mktemp("distributed")
    init = out / "init"
    # Every rank starts from a checkpoint written here by one process.
    failed = {}
    for case in CASES:
        if case.skip_reason is None and not (init / case.init_name).exists() and case.init_name not in failed:
            try:
                new_model(peft_config(case)).save_pretrained(init / case.init_name)
            except Exception:  # a method under construction fails its own cases only
                failed[case.init_name] = traceback.format_exc()
    new_model(trainer_config()).save_pretrained(init / TRAINER_INIT)
    new_model(slimfit_trainer_config()).save_pretrained(init / SLIMFIT_TRAINER_INIT)
    active = [case for case in CASES if case.skip_reason is None and case.init_name not in failed]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}"]
    command += [
        str(WORKER),
        str(out),
        str(init),
        *(case.name for case in active),
        "trainer",
        "slimfit_trainer",
        "errors",
    ]
    # PEFT_SLIM_CHECK_RANKS: SlimFit asserts at every step that both processes froze the same units.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PEFT_SLIM_CHECK_RANKS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(WORKER.parents[1]), env.get("PYTHONPATH")]))  # helpers
    process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    init_errors = {case.name: failed[case.init_name] for case in CASES if case.init_name in failed}
    return Runs(out, init, process, init_errors)


def skip_unavailable(case) -> None:
    if case.skip_reason is not None:
        pytest.skip(case.skip_reason)


# ---------------------------------------------------------------------------------------------- every case


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_all_ranks_hold_the_same_weights_and_trainable_set(runs, case):
    skip_unavailable(case)
    ranks = runs.result(case.name)
    assert ranks[0]["weights"].keys() == ranks[1]["weights"].keys()
    for name, tensor in ranks[0]["weights"].items():
        assert torch.equal(tensor, ranks[1]["weights"][name]), name
    assert ranks[0]["trainable"] == ranks[1]["trainable"]  # e.g. SlimFit's freeze decisions, step by step
    start = load_model(str(runs.init / case.init_name)).state_dict()
    trainable = [name for name in trainable_names(load_model(str(runs.init / case.init_name))) if name in start]
    moved = [name for name in trainable if not torch.equal(start[name], ranks[0]["weights"][name])]
    assert moved, "nothing trained"
    if case.method == "tokentune":  # SlimFit may keep some units frozen throughout
        assert moved == trainable


@pytest.mark.parametrize("case", [p for p in CASE_PARAMS if p.values[0].deterministic])
def test_deterministic_case_matches_one_process_on_the_global_batch(runs, case):
    skip_unavailable(case)
    ranks = runs.result(case.name)
    model = load_model(str(runs.init / case.init_name))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    model.train()
    losses = [train_step(model, model, optimizer, batch, case) for batch in global_batches(case)]
    # DDP / FSDP average the ranks' gradients, so the global loss is the mean of the ranks' losses.
    rank_means = [sum(r["losses"][step] for r in ranks) / WORLD for step in range(len(losses))]
    assert rank_means == pytest.approx(losses, rel=1e-5)
    expected = model.state_dict()
    for name, tensor in ranks[0]["weights"].items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", [p for p in CASE_PARAMS if p.values[0].setup == "random"])
def test_checkpoint_written_by_rank0_loads_in_one_process(runs, case):
    skip_unavailable(case)
    ranks = runs.result(case.name)
    loaded = load_model(str(runs.out / case.name / "checkpoint")).state_dict()
    assert loaded.keys() == ranks[0]["weights"].keys()
    for name, tensor in ranks[0]["weights"].items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("case", [p for p in CASE_PARAMS if p.values[0].setup == "random"])
def test_each_rank_draws_its_own_reproducible_selection(runs, case, monkeypatch):
    """Rank r draws from seed + r: one process with RANK=r replays rank r's masks exactly."""
    skip_unavailable(case)
    if not case.uses_tokentune:
        pytest.skip("no token selection")
    ranks = runs.result(case.name)
    for rank in range(WORLD):
        monkeypatch.setenv("RANK", str(rank))
        model = load_model(str(runs.init / case.init_name))
        model.train()
        for step, batch in enumerate(global_batches(case)):
            model(**shard(batch, rank))
            assert torch.equal(model.base_model.last_token_mask, ranks[rank]["masks"][step]), (rank, step)
    # Rank 1 did not draw what rank 0's generator draws on the same rows.
    monkeypatch.setenv("RANK", "0")
    model = load_model(str(runs.init / case.init_name))
    model.train()
    rank0_draws = []
    for batch in global_batches(case):
        model(**shard(batch, 1))
        rank0_draws.append(model.base_model.last_token_mask)
    assert any(not torch.equal(a, b) for a, b in zip(rank0_draws, ranks[1]["masks"]))


# ---------------------------------------------------------------------------------------------- Trainer


def test_trainer_under_two_processes_logs_and_applies_the_selected_token_mean(runs):
    """Trainer counts num_items_in_batch over both ranks and multiplies the loss by 2; DDP averages.
    The logged loss and the applied update must be sum_k mean_k * labelled_k / num_items_in_batch over all
    4 micro-batches (2 per rank), recomputed here from the recorded masks: never twice it."""
    ranks = runs.result("trainer")
    assert {r["wrapper"] for r in ranks} == {"DistributedDataParallel"}
    calls = [call for r in ranks for call in r["calls"]]
    assert len(calls) == 2 * WORLD
    total = sum(int(labelled(call["labels"])) for call in calls)
    assert all(int(call["num_items_in_batch"]) == total for call in calls)
    for name, tensor in ranks[0]["weights"].items():
        assert torch.equal(tensor, ranks[1]["weights"][name]), name

    model = load_model(str(runs.init / TRAINER_INIT))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.eval()
    inner = model.base_model.model
    expected = 0.0
    for call in calls:
        assert int(call["mask"].sum()) < int(call["attention_mask"].sum())  # TokenTune was active
        with reference_forward(inner, inner.model.layers, call["mask"]):
            logits = model(input_ids=call["input_ids"], attention_mask=call["attention_mask"]).logits
        loss = selected_causal_lm_loss(logits, call["labels"], call["mask"]) * int(labelled(call["labels"])) / total
        loss.backward()
        expected += loss.item()
        torch.testing.assert_close(call["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
    for r in ranks:
        assert r["logged"] == [pytest.approx(expected, rel=1e-5)]
        for name, grad in ((n, p.grad) for n, p in model.named_parameters() if p.requires_grad):
            # SGD, lr=1: the update is minus the gradient DDP averaged.
            torch.testing.assert_close(before[name] - r["weights"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_trainer_with_slimfit_callback_under_two_processes(runs):
    """Trainer's default DDP options for a PeftModel (find_unused_parameters=True) are what SlimFit needs."""
    ranks = runs.result("slimfit_trainer")
    assert all(r["wrapper"] == "DistributedDataParallel" and r["find_unused_parameters"] for r in ranks)
    history = ranks[0]["history"]
    assert history == ranks[1]["history"] and len(history["trained"]) == 3
    assert all(0 < sum(row) < len(history["units"]) for row in history["trained"])  # freezing happened
    assert len(ranks[0]["logged"]) == 3
    start = load_model(str(runs.init / SLIMFIT_TRAINER_INIT)).state_dict()
    moved = [name for name, tensor in ranks[0]["weights"].items() if not torch.equal(tensor, start[name])]
    assert moved
    for name, tensor in ranks[0]["weights"].items():
        assert torch.equal(tensor, ranks[1]["weights"][name]), name


# ---------------------------------------------------------------------------------------------- what cannot work


def test_what_refuses_to_work_under_two_processes(runs):
    """FSDP1 needs an accelerator (so CPU tests use FSDP2); SlimFit refuses DDP without unused-parameter detection
    at the first training forward (instead of a hang), and its debug check (PEFT_SLIM_CHECK_RANKS=1) catches freeze
    decisions that differ by rank. (A sharded model's plain save_pretrained on rank 0 alone is not run here: PEFT
    0.21 raises on the shards, later releases gather them, a collective the other rank never joins.)"""
    ranks = runs.result("errors")
    for r in ranks:
        assert "FSDP needs a non-CPU accelerator device" in r["fsdp1_on_cpu"]
        assert "find_unused_parameters=True" in r["slimfit_ddp_without_find_unused"]
        assert "processes disagree on which units train" in r["slimfit_ranks_disagree"]


# ---------------------------------------------------------------------------------------------- no launch


def test_selection_generator_is_offset_by_the_rank(monkeypatch):
    draws = {}
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        draws[rank] = torch.rand(8, generator=selection_generator(SEED))
    monkeypatch.delenv("RANK")
    assert torch.equal(draws["0"], torch.rand(8, generator=selection_generator(SEED)))
    assert torch.equal(draws["1"], torch.rand(8, generator=torch.Generator().manual_seed(SEED + 1)))
    assert not torch.equal(draws["0"], draws["1"])
