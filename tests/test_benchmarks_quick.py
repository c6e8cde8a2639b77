"""The equal-budget runner (``benchmarks.bench_budget``) on a tiny random chat Llama."""

from __future__ import annotations

import contextlib
import gc
import json
import math

import pytest
import torch
from transformers.utils import logging as hf_logging

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@contextlib.contextmanager
def restored_global_state():
    """A runner sets torch's threads, flush-denormal and RNG, transformers' logging and freezes the garbage
    collector's objects for the run: undo it."""
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    verbosity, progress = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
        torch.set_flush_denormal(False)
        hf_logging.set_verbosity(verbosity)
        (hf_logging.enable_progress_bar if progress else hf_logging.disable_progress_bar)()
        gc.unfreeze()


# ---- benchmarks.bench_budget: parts on a tiny chat Llama, then --merge -------------------------------------


@pytest.fixture
def budget_run(tmp_path, monkeypatch):
    """Three parts (the budget's method, the reference, TokenTune) of the QA task, on a tiny random chat Llama."""
    from benchmarks import bench_budget
    from peft_slim.cli import models
    from tests.tiny_chat import save_tiny_chat_llama

    folder = save_tiny_chat_llama(tmp_path / "model")
    monkeypatch.setattr(models, "resolve_model", lambda model, gguf: (str(folder), None, "tiny chat llama"))
    monkeypatch.setattr(bench_budget, "METHODS", dict(bench_budget.METHODS))
    out = tmp_path / "out"
    common = ["--quick", "--tasks", "qa", "--out", str(out), "--steps", "4", "--eval-every", "2", "--cap", "2"]
    with restored_global_state():
        with pytest.raises(SystemExit, match="no time budget: run the 'lora\\+ckpt' part"):
            bench_budget.main([*common, "--part", "qa", "tokentune-0.3", "0"])
        for method in ("lora+ckpt", "lora", "tokentune-0.3", "tokentune-0.5+ckpt-attention"):
            bench_budget.main([*common, "--part", "qa", method, "0"])
        # A task with its own length (the tiny byte-level tokenizer needs more tokens than the real one).
        bench_budget.main([*common, "--max-length", "400", "--part", "pydocs", "lora+ckpt", "0"])
        report = bench_budget.main([*common, "--merge"])
    parts = {p.stem: json.loads(p.read_text()) for p in (out / "qa").glob("*.json")}
    return report, parts, out


def test_budget_parts_train_to_the_budget_and_merge_into_ratios(budget_run):
    report, parts, out = budget_run
    ckpt, lora, tokentune = parts["lora+ckpt_s0"], parts["lora_s0"], parts["tokentune-0.3_s0"]
    assert ckpt["steps_run"] == 4 and ckpt["stopped"] == "steps"
    budget = ckpt["train_cpu_seconds"]
    assert math.isclose(budget, sum(ckpt["step_cpu_seconds"]))
    for part in (lora, tokentune):  # at least --steps, then to the budget or the cap (2 x 4 steps)
        assert part["budget_seconds"] == budget
        assert part["steps_run"] >= 4
        assert part["train_cpu_seconds"] >= budget or part["steps_run"] == 8
        assert part["step_peak_bytes"] > 0
        # evaluated at step 0, every 2 steps and at the last
        assert [p["step"] for p in part["curve"]] == sorted(
            {0, *range(2, part["steps_run"] + 1, 2), part["steps_run"]}
        )
    # The ratios, computed here from the parts' curves by the definitions of the report.
    target = next(p for p in lora["curve"] if p["step"] == 4)["answer_perplexity"]
    row = report["seeds"]["qa"]["tokentune-0.3"][0]
    at_four = next(p for p in tokentune["curve"] if p["step"] == 4)["answer_perplexity"]
    assert math.isclose(row["perplexity_at_steps_ratio"], at_four / target)
    inside = [p["answer_perplexity"] for p in tokentune["curve"] if p["cpu_seconds"] <= budget]
    assert math.isclose(row["best_within_budget_ratio"], min(inside) / target)
    reached = [p["cpu_seconds"] for p in tokentune["curve"] if p["answer_perplexity"] <= 1.02 * target]
    assert row.get("time_to_reference_ratio") == (reached[0] / budget if reached else None)
    assert math.isclose(row["peak_ratio_to_budget_method"], tokentune["step_peak_bytes"] / ckpt["step_peak_bytes"])
    text = (out / "budget.md").read_text()
    assert "| tokentune-0.3 |" in text and "| lora+ckpt | 1.00 | 1.00 |" in text
    assert (out / "budget_qa.png").read_bytes().startswith(PNG_MAGIC)
    assert not list((out / "qa").glob("*.partial.json"))  # finished parts leave no partial file
    probed = parts["tokentune-0.5+ckpt-attention_s0"]  # its mask chosen by the probe each step, timed with the step
    assert probed["probe"] == ["attention", 0.5] and len(probed["probe_cpu_seconds"]) == probed["steps_run"]
    assert all(0 < p < s for p, s in zip(probed["probe_cpu_seconds"], probed["step_cpu_seconds"]))


def test_budget_tasks_keep_their_own_length_and_a_task_mixing_settings_is_refused(budget_run):
    from benchmarks import bench_budget

    report, parts, out = budget_run
    lengths = {task: report["tasks"][task]["max_length"] for task in ("qa", "pydocs")}
    assert lengths == {"qa": bench_budget.TASK_DEFAULTS["qa"]["max_length"], "pydocs": 400}
    assert "64 (qa), 400 (pydocs)" in report["protocol"]
    assert report["probes"] == {"tokentune-0.5+ckpt-attention": ["attention", 0.5]}
    odd = json.loads((out / "qa" / "lora_s0.json").read_text())
    odd["config"]["max_length"] = 32
    (out / "qa" / "lora_s0.json").write_text(json.dumps(odd))
    with pytest.raises(SystemExit, match="the qa parts under .* ran with different settings"):
        bench_budget.main(["--quick", "--out", str(out), "--merge"])


def test_budget_method_rows_are_added_by_flags_and_checked():
    from benchmarks import bench_budget

    saved = dict(bench_budget.METHODS)
    try:
        args = bench_budget.parse_args(["--add-method", "tt-0.4=--token-ratio 0.4 --lora-r 8"])
        assert bench_budget.METHODS["tt-0.4"] == ["--token-ratio", "0.4", "--lora-r", "8"]
        assert args.methods[-1] == "tt-0.4"
        # seed-major, the budget's method first in every seed: the others read its time
        order = bench_budget.schedule(bench_budget.parse_args(["--methods", "lora", "lora+ckpt", "--seeds", "0", "1"]))
        assert order[:4] == [("qa", "lora+ckpt", 0), ("qa", "lora", 0), ("qa", "lora+ckpt", 1), ("qa", "lora", 1)]
        with pytest.raises(SystemExit):
            bench_budget.parse_args(["--add-method", "lora=--token-ratio 0.4"])
        with pytest.raises(SystemExit):
            bench_budget.parse_args(["--methods", "no-such-method"])
    finally:
        bench_budget.METHODS.clear()
        bench_budget.METHODS.update(saved)
