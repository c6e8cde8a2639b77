"""TokenTune's step against LoRA + checkpointing with the head at labelled positions, in forward-equivalents (F: one
no-grad forward of the LoRA model's body over the same tokens), phase by phase: the no-grad pass, the head and loss
(forward, backward), the selected tokens' recomputation and backward. SmolLM2-135M-Instruct, one row of random tokens
per length, every position labelled ("all") or the last twentieth ("answer"); the methods and the reference forward
interleaved, process CPU time on one thread, medians of ``--repeats`` steps (the first untimed).

    python -m benchmarks.profile_step --lengths 256 1024 2048 --labels all answer --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from benchmarks import harness
from peft_slim.token_selection import blocks, chunked_loss, recompute

BASELINE, TOKENTUNE = "lora+ckpt+labelled-head", "tokentune"
PHASES: dict[str, float] = {}  # phase -> CPU seconds in the current step


def _timed(function, phase: str):
    @functools.wraps(function)
    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return function(*args, **kwargs)
        finally:
            PHASES[phase] = PHASES.get(phase, 0.0) + time.process_time() - start

    return timed


def instrument() -> None:
    """Time TokenTune's phases (the no-grad pass includes cutting the block's arguments to the selection)."""
    blocks.BlockRunner._before = _timed(blocks.BlockRunner._before, "no-grad pass")
    loss = chunked_loss._ChunkedHeadLoss
    loss.forward = staticmethod(_timed(loss.forward, "head forward"))
    loss.backward = staticmethod(_timed(loss.backward, "head backward"))
    selected = recompute.SelectedPass
    selected.backward = staticmethod(_timed(selected.backward, "selected recompute + backward"))
    original = blocks.selected_pass
    blocks.selected_pass = lambda run, *args, **kwargs: original(_timed(run, "selected recompute"), *args, **kwargs)


def batch_of(length: int, labels: str, vocab: int) -> dict:
    ids = torch.randint(100, vocab - 100, (1, length), generator=torch.Generator().manual_seed(length))
    scored = ids.clone()
    if labels == "answer":
        scored[:, : length - max(2, length // 20)] = harness.IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": scored}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 1024])
    parser.add_argument("--labels", nargs="+", choices=["all", "answer"], default=["all", "answer"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    instrument()
    from peft_slim.cli import models

    base, _ = models.load_model(*models.resolve_model(None, None)[:2])
    built = {name: harness.build(harness.METHODS[name], base, 0) for name in (BASELINE, TOKENTUNE)}
    body = built[BASELINE][0].get_base_model().model
    for length in args.lengths:
        for labels in args.labels:
            batch = batch_of(length, labels, base.config.vocab_size)
            times: dict[str, list[float]] = {}
            for repeat in range(args.repeats + 1):
                for name, (model, optimizer, _) in built.items():
                    PHASES.clear()
                    start = time.process_time()
                    harness.train_step(model, optimizer, batch)
                    PHASES[name] = time.process_time() - start
                    if repeat:
                        times.setdefault(name, [])  # the method's line before its phases
                        for phase, seconds in PHASES.items():
                            times.setdefault(phase if phase == name else f"  {phase}", []).append(seconds)
                start = time.process_time()
                with torch.no_grad():
                    body(input_ids=batch["input_ids"], use_cache=False)
                if repeat:
                    times.setdefault("F", []).append(time.process_time() - start)
            median = {key: statistics.median(values) for key, values in times.items()}
            unit = median.pop("F")
            print(
                f"\n{length} tokens, labels {labels}: F = {unit:.3f} s; {TOKENTUNE} / {BASELINE} step "
                f"{median[TOKENTUNE] / median[BASELINE]:.3f}"
            )
            for key, seconds in median.items():
                print(f"  {key:34s} {seconds:8.3f} s {seconds / unit:6.2f} F")


if __name__ == "__main__":
    main()
