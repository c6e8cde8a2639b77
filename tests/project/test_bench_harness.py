"""benchmarks.harness end to end on a tiny model: two methods interleaved step by step, a run killed after its first
unit resumes from the results file, the report and plot come from that file."""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers.tiny_models import VOCAB, build

from benchmarks import harness
from peft_slim.recipe import Recipe


def tiny_task(name: str) -> harness.Task:
    def load():
        rng = random.Random(0)
        examples = []
        for _ in range(12):
            ids = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(10, 20))]
            answer = rng.randrange(3, 6)  # a prompt, then a short answer
            examples.append({"input_ids": ids, "labels": [-100] * (len(ids) - answer) + ids[-answer:]})
        return build("llama"), examples[:8], examples[8:], 0, f"{name}: random tokens, short answers"

    return harness.Task(name, load, batch_size=2)


METHODS = [harness.METHODS["lora+ckpt+labelled-head"], harness.METHODS["tokentune"]]


def test_two_methods_interleaved_a_killed_run_resumes_and_the_report_reads_the_file(tmp_path, monkeypatch):
    path = str(tmp_path / "harness.json")
    order = []
    step = harness.train_step
    monkeypatch.setattr(harness, "train_step", lambda model, *a: order.append(id(model)) or step(model, *a))
    tasks = [tiny_task("a"), tiny_task("b")]

    def kill(key):
        raise KeyboardInterrupt(key)

    with pytest.raises(KeyboardInterrupt):
        harness.run(tasks, METHODS, [0], 3, path, after_unit=kill)
    with open(path) as handle:
        first = json.load(handle)
    assert list(first["units"]) == ["a/seed0"]
    # Interleaved: the two methods alternate, step after step (then one more step each for the peak).
    models = list(dict.fromkeys(order))
    assert len(models) == 2 and order[:6] == models * 3
    finished = []
    results = harness.run(tasks, METHODS, [0], 3, path, after_unit=finished.append)
    assert finished == ["b/seed0"]  # the unit in the file is not run again
    assert results["units"]["a/seed0"] == first["units"]["a/seed0"]
    for unit in results["units"].values():
        for run in unit["runs"].values():
            assert len(run["losses"]) == 3 and len(run["step_cpu_seconds"]) == 2 and run["step_peak_bytes"] > 0
            assert all(map(torch.isfinite, torch.tensor(run["losses"])))
            assert run["answer_perplexity"] > 1
    text = harness.report(results)
    assert text.count("| lora+ckpt+labelled-head |") == 2 and "(1.00x)" in text
    assert "/ lora+ckpt+labelled-head)" in text  # the only baseline is the fastest
    harness.plot(results, str(tmp_path / "harness.png"))
    assert (tmp_path / "harness.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="other methods, steps or mode"):
        harness.run(tasks, METHODS[:1], [0], 3, path)


def test_a_head_other_than_the_models_is_a_lora_baselines():
    with pytest.raises(ValueError, match="Method.head='labelled'"):
        harness.Method("x", Recipe("tokentune"), head="labelled")
    with pytest.raises(ValueError, match="Method.head='fused'"):
        harness.Method("x", Recipe("lora"), head="fused")


def test_equal_time_trains_the_faster_method_on_to_the_baselines_time(monkeypatch):
    """A clock where the baseline's step takes 2 s and TokenTune's 1 s: after 3 steps each (2 timed), TokenTune
    trains 2 steps more (4 s of the baseline's 4 s), interleaved; its perplexity is taken again after them."""
    clock = [0.0]
    baseline = []
    step = harness.train_step

    def timed_step(model, *a):
        if not baseline:
            baseline.append(id(model))  # the first method stepped is the baseline
        clock[0] += 2.0 if id(model) == baseline[0] else 1.0
        return step(model, *a)

    monkeypatch.setattr(harness, "train_step", timed_step)
    monkeypatch.setattr(harness.time, "process_time", lambda: clock[0])
    unit = harness.run_unit(tiny_task("a"), METHODS, 0, 3, tiny_task("a").load(), equal_time=True)
    base, tokentune = (unit["runs"][m.name] for m in METHODS)
    assert base["equal_time_steps"] == 3 and base["equal_time_perplexity"] == base["answer_perplexity"]
    assert tokentune["equal_time_steps"] == 5 and len(tokentune["losses"]) == 5
    assert tokentune["step_cpu_seconds"] == [1.0] * 4 and base["step_cpu_seconds"] == [2.0] * 2
    assert tokentune["equal_time_perplexity"] != tokentune["answer_perplexity"] > 1
    assert "| held-out ppl at equal time |" in harness.report({"units": {"a/seed0": unit}}).replace("  ", " ")
    with pytest.raises(ValueError, match="needs a baseline"):
        harness.run_unit(tiny_task("a"), METHODS[1:], 0, 2, tiny_task("a").load(), equal_time=True)


def test_equal_time_budget_and_time_ratios_are_the_fastest_baselines(monkeypatch):
    """Two baselines, the leaner one slower (3 s a step against 2 s), TokenTune 1 s: TokenTune trains on to the
    faster baseline's 4 s (2 timed steps), and the report gives step peaks against the leaner baseline, step times
    against both."""
    clock = [0.0]
    step = harness.train_step
    methods = [harness.METHODS[n] for n in ("lora+ckpt+labelled-head", "lora+ckpt", "tokentune")]
    seconds = {}

    def timed_step(model, *a):
        seconds.setdefault(id(model), 3.0 - len(seconds))  # in the order first stepped: 3 s, 2 s, 1 s
        clock[0] += seconds[id(model)]
        return step(model, *a)

    monkeypatch.setattr(harness, "train_step", timed_step)
    monkeypatch.setattr(harness.time, "process_time", lambda: clock[0])
    unit = harness.run_unit(tiny_task("a"), methods, 0, 3, tiny_task("a").load(), equal_time=True)
    assert unit["runs"]["tokentune"]["equal_time_steps"] == 5
    for name, peak in zip(unit["runs"], (1 << 20, 4 << 20, 1 << 19)):
        unit["runs"][name]["step_peak_bytes"] = peak
    text = harness.report({"units": {"a/seed0": unit}})
    assert (
        "| method | step peak (/ lora+ckpt+labelled-head) | step time | / lora+ckpt+labelled-head | / lora+ckpt |"
        in text
    )
    assert "| tokentune | 0.5 MiB (0.50x) | 1.00 s | 0.33x | 0.50x |" in text


def test_head_times_count_each_heads_projections():
    """The heads alone on the tiny task: each gives the model's loss and gradient; TRL's head on a CPU projects
    every position three times (forward, the backward's recompute, the gradient), the model's own twice (all of
    its rows, the last position's included), the labelled head twice and TRL's compact head three times, at the
    labelled positions only."""
    result = harness.head_times(tiny_task("a"), repeats=1)
    heads, share = result["heads"], result["labelled_positions"] / result["positions"]
    rows = result["batch"][0] * result["batch"][1] / result["positions"]
    expected = {"model": 2 * rows, "trl": 3.0, "trl-compact": 3 * share, "labelled": 2 * share}
    for kind, projections in expected.items():
        assert heads[kind]["full_projections"] == pytest.approx(projections), kind
        assert heads[kind]["loss"] == pytest.approx(heads["model"]["loss"], rel=1e-5)
        assert heads[kind]["max_grad_difference"] < 1e-6 and len(heads[kind]["cpu_seconds"]) == 1
    assert "TRL's fused head (on a CPU: every position)" in harness.heads_markdown({"tasks": {"a": result}})
