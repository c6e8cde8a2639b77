"""The planner's ranking by the equal-budget benchmark: the packaged numbers are current, a setting gets only its
own measurement, the order follows the numbers, and each setting's evidence names where it comes from."""

from __future__ import annotations

import json
import pathlib
import shlex
import statistics
import sys
import warnings

import pytest
from helpers.planner_cases import checked_train_args, estimates_remembered, llama_config

from peft_slim.cli import main as cli_main
from peft_slim.cli.plan import train_command
from peft_slim.planner import plan
from peft_slim.planner.measured import measurement_for
from peft_slim.planner.plan import NOT_MEASURED, Candidate, ladder
from peft_slim.recipe import Recipe

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGED = json.loads((ROOT / "peft_slim" / "planner" / "measured.json").read_text())
OPTIONS = dict(lora_r=4, min_token_ratio=0.2)


def tiny_config():
    """The model planned here: one block (the ranking and evidence do not depend on depth; each estimate traces it)."""
    return llama_config(num_hidden_layers=1)


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(scope="module", autouse=True)
def remembered():
    """Every plan here (the command's included) estimates the same tiny model and workload: once, not per plan."""
    with estimates_remembered():
        yield


@pytest.fixture(scope="module")
def everything():
    """Every setting of a tiny model, in ladder order and ranked (the estimates are the slow part: once)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = tiny_config()
        return plan(config, None, 2, 32, **OPTIONS, rank="ladder"), plan(config, None, 2, 32, **OPTIONS)


def build_page():
    sys.path.insert(0, str(ROOT / "tools"))
    import build_benchmarks_page

    return build_benchmarks_page


def benchmark_name(candidate: Candidate) -> str | None:
    """The benchmark's name for a setting it runs (bench_budget.METHODS' naming), or None: it never runs it."""
    if candidate.compression_bits is not None or candidate.method == "slimfit":
        return None
    base = "lora" if candidate.method == "lora" else f"tokentune-{candidate.token_ratio:g}"
    return base + ("+ckpt" if candidate.gradient_checkpointing else "")


def expected_order(ranked_from: list[Candidate]) -> list[str]:
    """The ranking by its definition, from the packaged numbers: measured settings that reach LoRA's final
    perplexity in every seed, by mean time to it; then measured ones that do not, by best perplexity in the budget;
    then the unmeasured, in ladder order."""
    reach, short, unmeasured = [], [], []
    for index, candidate in enumerate(ranked_from):
        name = benchmark_name(candidate)
        if name not in PACKAGED["methods"]:
            unmeasured.append((index, candidate.name))
            continue
        tasks = PACKAGED["methods"][name]["tasks"].values()
        if all(t["seeds_reaching_reference"] == len(t["seeds"]) for t in tasks):
            reach.append((statistics.mean(t["time_to_reference_ratio"] for t in tasks), index, candidate.name))
        else:
            short.append((statistics.mean(t["best_within_budget_ratio"] for t in tasks), index, candidate.name))
    return [c[-1] for c in sorted(reach)] + [c[-1] for c in sorted(short)] + [name for _, name in unmeasured]


def test_the_packaged_measurements_are_what_budget_json_gives():
    assert (ROOT / "peft_slim" / "planner" / "measured.json").read_text() == build_page().render_measured(), (
        "peft_slim/planner/measured.json is out of date: run python tools/build_benchmarks_page.py"
    )


def test_rows_a_benchmark_probe_chose_tokens_for_are_not_planner_measurements():
    """A probe's flags build another row's setting (the probe passes token_mask): ranking by it would credit that
    setting with the probe's numbers."""
    report = json.loads((ROOT / "benchmarks" / "results" / "budget" / "budget.json").read_text())
    report["probes"] = {"tokentune-0.5+ckpt": ["attention", 0.5]}  # any measured row, marked as a probe
    methods = build_page().measured(report)["methods"]
    assert "tokentune-0.5+ckpt" not in methods and "lora+ckpt" in methods


def test_a_candidate_stands_for_what_its_train_line_trains():
    """The planner's reading of a setting is the train command's own reading of the line it prints for it."""
    candidates = ladder(8, 0.05)
    candidates += [Candidate(**{**c.__dict__, "gradient_checkpointing": True}) for c in candidates]
    for candidate in candidates:
        line = shlex.split(train_command(None, candidate, 2, 32, "float32"))[2:]
        assert candidate.recipe == Recipe.from_train_args(checked_train_args(line)), candidate.name


def test_a_measurement_is_attached_only_to_the_setting_it_was_measured_for():
    report = {
        "protocol": "org/Model-1B (offline), completion-only",
        "machine": "x86_64 CPU (unknown), 1 intra-op thread, torch 2",
        "config": {},
        "tasks": {"t": {"description": "a task"}},
        "methods": {
            "tokentune-0.3": ["--token-ratio", "0.3", "--lora-r", "8"],
            "tokentune-0.3-random": ["--token-ratio", "0.3", "--selection", "random", "--lora-r", "8"],
            "tokentune-0.5-8bit": ["--token-ratio", "0.5", "--compression-bits", "8"],
            "slimfit-0.9+lora": ["--method", "slimfit", "--freeze-ratio", "0.9", "--compression-bits", "none"],
            "slimfit-0.8-exact": ["--method", "slimfit", "--freeze-ratio", "0.8", "--compression-bits", "none"],
            "tokentune-0.3-base": ["--token-ratio", "0.3", "--lora-r", "0"],
            "lora+ckpt": ["--method", "lora", "--gradient-checkpointing"],
        },
    }
    numbers = {"seeds": [0], "seeds_reaching_reference": 1, "time_to_reference_ratio": [0.5]}
    numbers |= {k: [1.0] for k in ("best_within_budget_ratio", "peak_ratio_to_budget_method")}
    numbers |= {k: [1.0] for k in ("step_time_ratio_to_budget_method", "perplexity_at_steps_ratio")}
    report["summary"] = {"t": {name: numbers for name in report["methods"]}}
    data = build_page().measured(report)
    expected = {
        Candidate("tokentune", 16, token_ratio=0.3): "tokentune-0.3",  # another rank: the evidence names r=8
        Candidate("tokentune", 8, token_ratio=0.3, gradient_checkpointing=True): None,
        Candidate("tokentune", 8, token_ratio=0.5): None,
        Candidate("tokentune", 8, token_ratio=0.5, compression_bits=8): "tokentune-0.5-8bit",
        Candidate("tokentune", 8, token_ratio=0.5, compression_bits=4): None,
        Candidate("slimfit", 8, freeze_ratio=0.8): None,  # its default compression, not none
        Candidate("slimfit", 8, freeze_ratio=0.9): None,
        Candidate("lora", 8): None,
        Candidate("lora", 8, gradient_checkpointing=True): "lora+ckpt",
    }
    for candidate, name in expected.items():
        found = measurement_for(candidate, data)
        assert (found and found.name) == name, candidate.name
    evidence = measurement_for(Candidate("tokentune", 16, token_ratio=0.3), data).evidence()
    assert "0.50x the time" in evidence and "LoRA r=8" in evidence and "Model-1B" in evidence


def test_plan_ranks_by_the_measurements_and_never_invents_one(everything):
    ladder_order, ranked = everything
    assert sorted(c.name for c in ranked) == sorted(c.name for c in ladder_order)
    assert [c.name for c in ranked] == expected_order(ladder_order)
    measured = [c for c in ranked if c.measurement is not None]
    assert measured, "the packaged file measures none of the tiny plan's settings"
    for candidate in ranked:
        assert (candidate.measurement and candidate.measurement.name) == (
            benchmark_name(candidate) if benchmark_name(candidate) in PACKAGED["methods"] else None
        )
        if candidate.measurement is None:
            assert candidate.evidence == NOT_MEASURED and not any(ch.isdigit() for ch in candidate.evidence)
    budget = sorted(c.estimate.peak for c in ranked)[len(ranked) // 2]
    fitting = plan(tiny_config(), budget, 2, 32, **OPTIONS)
    assert [c.name for c in fitting] == [c.name for c in ranked if c.estimate.peak <= budget]


def test_the_evidence_gives_the_measured_numbers_and_their_source(everything):
    _, ranked = everything
    source = PACKAGED["source"]
    for candidate in (c for c in ranked if c.measurement is not None):
        tasks = PACKAGED["methods"][benchmark_name(candidate)]["tasks"]
        text = candidate.evidence
        assert text.startswith("measured: ")
        assert source["model"] in text and "benchmarks/results/budget/budget.md" in text and "LoRA r=8" in text
        for task, numbers in tasks.items():
            assert f"{task} ({len(numbers['seeds'])} seed" in text
        prompt_ratio = PACKAGED["methods"][benchmark_name(candidate)].get("prompt_ratio")
        if candidate.method == "tokentune":  # measured before the prompt ratio: the budget filled from the prompt
            assert prompt_ratio == 1.0 and "prompt ratio 1;" in text
        else:
            assert prompt_ratio is None and "prompt ratio" not in text
        if all(t["seeds_reaching_reference"] == len(t["seeds"]) for t in tasks.values()):
            time = statistics.mean(t["time_to_reference_ratio"] for t in tasks.values())
            assert f"in {time:.2f}x the time of LoRA + checkpointing" in text
        else:
            best = statistics.mean(t["best_within_budget_ratio"] for t in tasks.values())
            assert f"best perplexity in that time {best:.3f}x LoRA's final" in text
        stronger = PACKAGED["methods"][benchmark_name(candidate)].get("against_trl_head")
        assert ("budget_trl/budget.md" in text) == (stronger is not None)
        if stronger is not None:  # the run against the baseline a TRL user has: its own numbers, after the first
            peak = statistics.mean(t["peak_ratio_to_budget_method"] for t in stronger["tasks"].values())
            clause = text.split("; ", 4)[-1]
            assert "LoRA + checkpointing with TRL's fused LM head" in clause and f"{peak:.2f}x its step peak" in clause


def test_a_method_the_trl_head_run_measured_carries_those_ratios_too():
    stronger = {}  # method -> the tasks the runs against TRL's fused head measured it on
    for folder in ("budget_trl", "budget_trl_longqa"):
        run = json.loads((ROOT / "benchmarks" / "results" / folder / "budget.json").read_text())
        for task, summary in run["summary"].items():
            for name in set(summary) - {run["budget_method"]}:
                stronger.setdefault(name, set()).add(task)
    assert stronger, "the TRL-head runs measured no method"
    for name, method in PACKAGED["methods"].items():
        assert ("against_trl_head" in method) == (name in stronger), name
        if name in stronger:
            assert set(method["against_trl_head"]["tasks"]) == stronger[name], name


def test_cli_prints_each_settings_evidence_and_trains_the_first(tmp_path, capsys, everything):
    tiny_config().save_pretrained(tmp_path)
    _, ranked = everything
    argv = ["plan", "--model", str(tmp_path), "--batch-size", "2", "--seq-len", "32", "--lora-r", "4", "--verbose"]
    assert cli_main([*argv, "--min-token-ratio", "0.2", "--budget", str(max(c.estimate.peak for c in ranked))]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split(" | ")[-1] == "evidence"
    rows = [line.split(" | ") for line in lines[1:-2]]  # then what to pass as --model (a config only) and the line
    assert [(row[0], row[-1]) for row in rows] == [(c.name, c.evidence) for c in ranked]
    first = checked_train_args(shlex.split(lines[-1])[2:])
    assert Recipe.from_train_args(first) == ranked[0].recipe and first.model == "MODEL"


def test_rank_is_validated():
    with pytest.raises(ValueError, match="rank must be one of"):
        plan(llama_config(), None, 2, 32, rank="fastest")
    with pytest.raises(SystemExit):
        cli_main(["plan", "--model", "x", "--batch-size", "1", "--rank", "fastest"])
