"""``python -m benchmarks.run --quick``: tiny random models, every task, well-formed tables, JSON and plots.

The default suite runs the benchmark in this process (``benchmarks.run.main``) on a reduced set: the three tasks
with the baselines, TokenTune and SlimFit, and one task with every other kind of method (checkpointing, offload,
LoRA-FA, SlimFit without compression, the full stack); then ``--merge --retime`` of the two reports, and one
``--jobs 2`` run of the command line in a subprocess. ``pytest -m bench`` runs the whole quick mode (every method
on every task) as the command line does.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers.utils import logging as hf_logging

pytest.importorskip("matplotlib")

from benchmarks import run  # noqa: E402  (after the importorskip: the benchmark plots with matplotlib)
from benchmarks.summary import SLIMFIT, STACK, TOKENTUNE  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TASK_NAMES = ["minilm-drugs", "smollm2-pydocs", "vit-mnist"]
# Every task: the two baselines, TokenTune and SlimFit (with its default compression).
EVERY_TASK = ["full-ft", "lora", TOKENTUNE, SLIMFIT]
# One task: every other way a method is built (the variants of ratio only differ by a number).
ONE_TASK = "smollm2-pydocs"
OTHER_KINDS = ["full-ft", "lora", "lora+ckpt", "lora+offload", "lora-fa", "slimfit-0.9", STACK]


@contextlib.contextmanager
def restored_global_state():
    """``main`` sets torch's threads, flush-denormal and RNG, transformers' logging and freezes the garbage
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


def run_main(*argv: str) -> None:
    with restored_global_state():
        assert run.main(list(argv)) == 0, argv


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    run_main("--quick", "--out", str(out), "--stem", "tasks", "--methods", *EVERY_TASK)
    run_main("--quick", "--out", str(out), "--stem", "kinds", "--tasks", ONE_TASK, "--methods", *OTHER_KINDS)
    files = [str(out / "tasks.json"), str(out / "kinds.json")]
    run_main("--merge", *files, "--retime", "--rounds", "1", "--threads", "1", "--out", str(out), "--stem", "merged")
    return out


def _load(out, stem: str) -> dict:
    return json.loads((out / f"{stem}.json").read_text())


def check_report(out, stem: str, expected: list[tuple[str, list[str]]]) -> dict:
    """What every report holds; ``expected``: (task, its methods) in order. Returns the JSON report."""
    report = _load(out, stem)
    assert [task["name"] for task in report["tasks"]] == [name for name, _ in expected]
    for task, (_, methods) in zip(report["tasks"], expected):
        # Nothing skipped: neither failed, nor left out (e.g. SlimFit's methods when SlimFitConfig is missing).
        assert task["skipped"] == {}, task["skipped"]
        assert list(task["methods"]) == methods
        for name, summary in task["methods"].items():
            memory = summary["memory"]
            parts = ("parameters", "gradients", "optimizer_state", "activations")
            assert memory["total_bytes"] == sum(memory[k] for k in parts) == summary["total_bytes"], name
            assert memory["parameters"] > 0 and memory["optimizer_state"] > 0 and memory["gradients"] > 0, name
            assert summary["saved_activation_bytes"] > 0, name
            assert summary["median_step_seconds"] > 0 and summary["tokens_per_second"] > 0, name
            assert summary["timing"]["median_step_seconds"] == summary["median_step_seconds"], name
            assert set(summary["ratios"]) == {
                f"{quantity}_vs_{baseline}"
                for quantity in ("saved_activation_bytes", "total_bytes", "median_step_seconds")
                for baseline in ("lora", "full-ft")
            }, name
            assert all(ratio > 0 for ratio in summary["ratios"].values()), name
            assert task["metric"] in summary["metrics"], name
            assert summary["seeds"] == [0]
            (first,) = task["runs"][name]  # one seed, profiled
            assert first["seed"] == 0 and "memory" in first and len(first["losses"]) == 4, name
        assert task["methods"]["lora"]["ratios"]["median_step_seconds_vs_lora"] == 1.0
        assert task["methods"]["full-ft"]["ratios"]["total_bytes_vs_full-ft"] == 1.0
        assert len(task["targets"]) == 7 and all(
            verdict in (True, False, None) for verdict in task["targets"].values()
        )

    markdown = (out / f"{stem}.md").read_text()
    for task in report["tasks"]:
        assert f"### {task['name']}" in markdown
        assert f"Setup: {task['description']}; seeds [0]." in markdown
    assert markdown.count("| method | saved activations | vs LoRA | vs full FT |") == len(expected)
    assert markdown.count("Peak training memory by category") == len(expected)
    assert markdown.count("Targets (issue 5):") == len(expected)
    assert "FAILED" not in markdown and "skipped" not in markdown
    for method in {method for _, methods in expected for method in methods}:
        # one row per task that ran it, in each of the task's two tables
        runs = sum(method in methods for _, methods in expected)
        assert markdown.count(f"| {method} | ") == 2 * runs, method
    for figure in report["figures"]:
        assert (out / figure).read_bytes()[:8] == PNG_MAGIC, figure
        assert f"![{figure}]({figure})" in markdown
    return report


def test_every_task_with_the_baselines_tokentune_and_slimfit(reports):
    report = check_report(reports, "tasks", [(name, EVERY_TASK) for name in TASK_NAMES])
    assert report["setup"]["mode"] == "quick" and report["setup"]["seeds"] == [0]
    assert report["setup"]["command"].startswith("python -m benchmarks.run --quick")
    assert report["figures"] == [
        "tasks_memory.png",
        "tasks_pareto.png",
        *(f"tasks_slimfit_{name}.png" for name in TASK_NAMES),  # SlimFit's freeze pattern on every task
    ]
    for task in report["tasks"]:
        methods = task["methods"]
        # TokenTune saves activations for a fifth of the tokens: fewer bytes than LoRA even on a tiny model.
        assert methods[TOKENTUNE]["saved_activation_bytes"] < methods["lora"]["saved_activation_bytes"]
        # SlimFit trains a tenth of the units: fewer gradient bytes than full fine-tuning.
        assert methods[SLIMFIT]["memory"]["gradients"] < methods["full-ft"]["memory"]["gradients"]
        history = task["runs"][SLIMFIT][0]["slimfit_history"]
        assert len(history["trained"]) == 4 and all(len(row) == len(history["units"]) for row in history["trained"])


def test_one_task_with_every_other_kind_of_method(reports):
    report = check_report(reports, "kinds", [(ONE_TASK, OTHER_KINDS)])
    methods = report["tasks"][0]["methods"]
    # LoRA-FA keeps no optimizer state for A: less than LoRA's.
    assert methods["lora-fa"]["memory"]["optimizer_state"] < methods["lora"]["memory"]["optimizer_state"]
    # The full stack (SlimFit + TokenTune + LoRA + compression) saves fewer activation bytes than LoRA.
    assert methods[STACK]["saved_activation_bytes"] < methods["lora"]["saved_activation_bytes"]
    markdown = (reports / "kinds.md").read_text()
    assert "`lora+ckpt`: transformers' activation checkpointing" in markdown  # the methods' notes
    # Without slimfit-0.9+comp, the freeze pattern shown is the first SlimFit method's.
    assert report["figures"] == ["kinds_memory.png", "kinds_pareto.png", f"kinds_slimfit_{ONE_TASK}.png"]


def test_merge_and_retime_rebuild_one_report(reports):
    """``--merge`` rebuilds one report from two runs' JSON files, in order; ``--retime`` measures the step times
    again (CPU time: one thread)."""
    report = check_report(reports, "merged", [*((name, EVERY_TASK) for name in TASK_NAMES), (ONE_TASK, OTHER_KINDS)])
    runs = {task["name"]: task for task in _load(reports, "tasks")["tasks"]}
    for task in report["tasks"][:-1]:  # the training runs are the merged report's own; only the timing pass reran
        assert task["runs"] == runs[task["name"]]["runs"]
    assert [setup["mode"] for setup in report["setup"]] == ["quick", "quick"]
    assert all(
        setup["retimed"].startswith("`--merge ... --retime` (1 rounds, 1 thread(s))") for setup in report["setup"]
    )
    markdown = (reports / "merged.md").read_text()
    assert markdown.count("Measured on:") == 2 and markdown.count("Step times measured again") == 2
    for task in report["tasks"]:
        assert {summary["timing"]["clock"] for summary in task["methods"].values()} == {"cpu"}
    assert (reports / "merged_pareto.png").read_bytes()[:8] == PNG_MAGIC


def run_command(*argv: str) -> None:
    command = [sys.executable, "-m", "benchmarks.run", *argv]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]


def test_command_line_runs_seeds_in_parallel_processes(tmp_path):
    """``python -m benchmarks.run --jobs 2`` runs two seeds at once in forked processes; memory is profiled in the
    first seed's, and the summary is over both."""
    options = ["--tasks", "vit-mnist", "--methods", "lora", "--seeds", "0", "1", "--jobs", "2", "--stem", "jobs"]
    run_command("--quick", *options, "--out", str(tmp_path))
    report = _load(tmp_path, "jobs")
    assert "1 used by each of 2 processes" in report["setup"]["machine"]
    (task,) = report["tasks"]
    assert task["skipped"] == {} and task["seeds"] == [0, 1]
    runs = task["runs"]["lora"]
    assert [r["seed"] for r in runs] == [0, 1]
    assert "memory" in runs[0] and "memory" not in runs[1]  # the first seed profiled
    metric = task["metric"]
    assert task["methods"]["lora"]["metrics"][metric]["values"] == [r["metrics"][metric] for r in runs]
    assert task["methods"]["lora"]["seeds"] == [0, 1]


def test_quick_output_goes_to_an_ignored_folder():
    """Without ``--out``, quick mode writes to benchmarks/results/quick, which git ignores: running it leaves no file
    to commit (and never overwrites the committed full results)."""
    assert run.parse_args(["--quick"]).out == run.QUICK_RESULTS == os.path.join(run.RESULTS, "quick")
    assert run.parse_args([]).out == run.RESULTS
    assert run.parse_args(["--quick", "--out", "elsewhere"]).out == "elsewhere"
    git = shutil.which("git")
    inside = git and subprocess.run([git, "rev-parse", "--is-inside-work-tree"], cwd=REPO, capture_output=True)
    if not inside or inside.returncode != 0:
        pytest.skip("not a git checkout")
    for name in ("bench_quick.json", "bench_quick.md", "bench_quick_memory.png"):
        path = os.path.relpath(os.path.join(run.QUICK_RESULTS, name), REPO)
        assert subprocess.run([git, "check-ignore", "-q", path], cwd=REPO).returncode == 0, path
    # ... while the full results stay tracked
    bench = os.path.relpath(os.path.join(run.RESULTS, "bench.json"), REPO)
    assert subprocess.run([git, "check-ignore", "-q", bench], cwd=REPO).returncode == 1


@pytest.mark.bench
def test_full_quick_run_writes_tables_json_and_plots(tmp_path):
    """The whole quick mode, as the command line runs it: every method on every task."""
    run_command("--quick", "--out", str(tmp_path))
    methods = list(run.all_methods())
    report = check_report(tmp_path, "bench_quick", [(name, methods) for name in TASK_NAMES])
    assert report["figures"] == [
        "bench_quick_memory.png",
        "bench_quick_pareto.png",
        *(f"bench_quick_slimfit_{name}.png" for name in TASK_NAMES),
    ]
    for task in report["tasks"]:
        summaries = task["methods"]
        for ratio in ("0.1", "0.2", "0.3"):
            tokentune = summaries[f"tokentune-{ratio}+lora"]
            assert tokentune["saved_activation_bytes"] < summaries["lora"]["saved_activation_bytes"]


# ---- benchmarks.bench_budget: parts on a tiny chat Llama, then --merge -------------------------------------


@pytest.fixture
def budget_run(tmp_path, monkeypatch):
    """Three parts (the budget's method, the reference, TokenTune) of the QA task, on a tiny random chat Llama."""
    from helpers.tiny_chat import save_tiny_chat_llama

    from benchmarks import bench_budget
    from peft_slim.cli import models

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


# ---- benchmarks.step_parts: the parts of TokenTune's step peak, on a tiny random Llama ------------------------


def test_step_parts_measures_the_kept_keys_and_values_and_writes_its_report(tmp_path):
    """The keys/values read from TokenTune's graph are the unselected tokens' (their analytic size), within what
    autograd saves; each quick length measured in its own run, then both methods at both lengths merged into one
    report, JSON and Markdown."""
    from benchmarks import step_parts

    with restored_global_state():
        for length in step_parts.QUICK_LENGTHS:
            step_parts.main(["--quick", "--lengths", str(length), "--out", str(tmp_path / str(length))])
        parts = [str(tmp_path / str(length) / "step_parts.json") for length in step_parts.QUICK_LENGTHS]
        report = step_parts.main(["--merge", *parts, "--out", str(tmp_path)])
    assert report["lengths"] == step_parts.QUICK_LENGTHS
    rows = {(r["method"], r["tokens"]): r for r in report["rows"]}
    assert set(rows) == {(m, n) for m in step_parts.METHODS for n in step_parts.QUICK_LENGTHS}
    for length in step_parts.QUICK_LENGTHS:
        tokentune = rows[(step_parts.TOKENTUNE, length)]
        assert 0 < tokentune["unselected_tokens"] < length
        assert tokentune["kv_bytes"] == tokentune["kv_unselected_analytic_bytes"] > 0
        assert 0 < tokentune["kv_bytes"] + tokentune["inputs_bytes"] <= tokentune["saved_bytes"]
        assert tokentune["saved_bytes"] <= tokentune["step_peak_bytes"]
        assert tokentune["head_loss_peak_bytes"] > 0 and tokentune["block_pass_peak_bytes"] > 0
    written = json.loads((tmp_path / "step_parts.json").read_text())
    assert written["command"].startswith("python -m benchmarks.step_parts --quick --lengths 32")
    assert written["command"].endswith("--out " + str(tmp_path))
    markdown = (tmp_path / "step_parts.md").read_text()
    assert markdown.count(f"| {step_parts.TOKENTUNE} | ") == len(step_parts.QUICK_LENGTHS)
    assert "Measured on:" in markdown
