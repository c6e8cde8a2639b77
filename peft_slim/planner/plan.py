"""``plan``: the training settings that fit a memory budget, cheapest in time and accuracy first, each estimated.

The ladder, cheapest first: plain LoRA; TokenTune + LoRA with fewer and fewer tokens (down to
``min_token_ratio``); the same with activations compressed to 8, then 4 bits; SlimFit (its defaults); then each of
those with gradient checkpointing (about a third more time per step), kept only where it lowers the estimate. The
settings that fit are then ranked by the equal-budget benchmark's measurements (``measured``), the rest in order.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field, fields, replace

import torch
from tqdm.auto import tqdm

from ..configuration import check_bool, check_choice, check_float, check_int, check_names
from ..recipe import DEFAULT_LORA_R, MAX_LORA_R, SLIMFIT_DEFAULTS, Recipe
from ..slimfit import SlimFitConfig
from .estimate import MemoryEstimate, estimate_memory
from .measured import Measurement, measurement_for
from .setup import TASK_TYPES, load_config, resolve_workload

TOKEN_RATIOS = (0.5, 0.3, 0.2, 0.1, 0.05)
MAX_BUDGET = 2**50  # 1 PiB: far above any one device's memory
RANKS = ("measured", "ladder")
NOT_MEASURED = "not measured; ladder order"


@dataclass(frozen=True)
class Candidate:
    """One setting: the train-command fields it stands for, the PEFT config it builds, its estimate, and what the
    equal-budget benchmark measured for exactly this setting (``measurement``, None where it did not run it) as a
    line to show (``evidence``)."""

    method: str  # "lora", "tokentune" or "slimfit"
    lora_r: int
    token_ratio: float | None = None
    compression_bits: int | None = None
    freeze_ratio: float | None = None
    gradient_checkpointing: bool = False
    estimate: MemoryEstimate | None = field(default=None, compare=False)
    measurement: Measurement | None = field(default=None, compare=False)
    evidence: str = field(default="", compare=False)

    @property
    def name(self) -> str:
        parts = [self.method if self.method != "tokentune" else f"tokentune-{self.token_ratio:g}"]
        if self.method == "slimfit":
            parts[0] = f"slimfit-{self.freeze_ratio:g}"
        parts.append(f"lora-r{self.lora_r}")
        if self.compression_bits is not None:
            parts.append(f"{self.compression_bits}bit")
        if self.gradient_checkpointing:
            parts.append("ckpt")
        return "+".join(parts)

    @property
    def brief(self) -> str:
        """``evidence`` in a few words, for a table cell."""
        return NOT_MEASURED if self.measurement is None else self.measurement.brief()

    @property
    def recipe(self) -> Recipe:
        """The setting as a ``Recipe`` (LoRA alpha 2 r on every linear layer, the method's other defaults)."""
        return Recipe(**{spec.name: getattr(self, spec.name) for spec in fields(self) if spec.compare})

    def peft_config(self, task_type: str | None, target_modules):
        """The setting's PEFT config, its LoRA on ``target_modules``."""
        return replace(self.recipe, lora_target_modules=target_modules).to_peft_config(task_type=task_type)


def ladder(lora_r: int, min_token_ratio: float) -> list[Candidate]:
    """Every setting tried, cheapest first (before checkpointing variants)."""
    ratios = [r for r in TOKEN_RATIOS if r >= min_token_ratio]
    steps = [Candidate("lora", lora_r)]
    for bits in (None, 8, 4):
        steps += [Candidate("tokentune", lora_r, token_ratio=r, compression_bits=bits) for r in ratios]
    # SlimFit's defaults: its freeze ratio and compression
    steps.append(Candidate("slimfit", lora_r, freeze_ratio=SLIMFIT_DEFAULTS.freeze_ratio))
    return steps


def plan(
    model,
    budget: int | None,
    batch_size: int,
    seq_len: int | None,
    optimizer: str = "adamw",
    *,
    dtype: str = "float32",
    lora_r: int = DEFAULT_LORA_R,
    target_modules="all-linear",
    min_token_ratio: float = 0.1,
    task: str | None = None,
    checkpointing: bool = True,
    progress: bool = False,
    rank: str = "measured",
    processes: int = 1,
) -> list[Candidate]:
    """The settings whose estimated peak fits ``budget`` bytes (None: every setting), best first.

    ``model`` and the rest as for ``estimate_memory``; ``lora_r`` and ``target_modules`` make every setting's LoRA.
    ``checkpointing``: try checkpointed variants too. ``rank``: "measured" or "ladder" order (see the module
    docstring; each candidate's ``evidence`` says which). ``progress``: a progress bar. ``processes``: estimate
    the settings in this many processes forked from this one (Linux, a model given as a config; else one). Fork
    only where no operator has run threads yet (OpenMP's pool does not survive a fork): ``peft-slim plan`` uses 2.
    An empty list: nothing fits.
    """
    budget = check_int("budget (bytes)", budget, 1, MAX_BUDGET, optional=True)
    lora_r = check_int("lora_r", lora_r, 1, MAX_LORA_R)
    min_token_ratio = check_float("min_token_ratio", min_token_ratio, 0.0, 1.0, low_open=True)
    rank = check_choice("rank", rank, RANKS)
    target_modules = check_names("target_modules", target_modules)
    checkpointing = check_bool("checkpointing", checkpointing)
    processes = check_int("processes", processes, 1, 64)
    source = model if isinstance(model, torch.nn.Module) else load_config(model)  # read once, not per setting
    task = resolve_workload(source, None, batch_size, seq_len, optimizer, dtype, task).task
    task_type = TASK_TYPES.get(task)
    steps = ladder(lora_r, min_token_ratio)
    if checkpointing:
        steps += [replace(c, gradient_checkpointing=True) for c in steps]
    workload = {"batch_size": batch_size, "seq_len": seq_len, "optimizer": optimizer, "dtype": dtype, "task": task}
    jobs = [(source, c.peft_config(task_type, target_modules), c.gradient_checkpointing, workload) for c in steps]
    estimates = _estimate_all(jobs, processes if not isinstance(source, torch.nn.Module) else 1, progress)
    results, plain = [], {}
    for candidate, estimate in zip(steps, estimates):  # the same workload; only the setting's config and ckpt change
        if not candidate.gradient_checkpointing:
            plain[candidate] = estimate.peak  # candidates compare (and hash) by their setting
        elif estimate.peak >= plain[replace(candidate, gradient_checkpointing=False)]:
            continue  # checkpointing costs time and saves nothing here
        if budget is None or estimate.peak <= budget:
            measured = measurement_for(candidate)
            evidence = NOT_MEASURED if measured is None else measured.evidence()
            results.append(replace(candidate, estimate=estimate, measurement=measured, evidence=evidence))
    if rank == "measured":  # a stable sort: the unmeasured keep the ladder's order
        results.sort(key=lambda c: (1,) if c.measurement is None else (0, c.measurement.sort_key()))
    return results


def _estimate(job: tuple) -> MemoryEstimate:
    source, config, gradient_checkpointing, workload = job
    return estimate_memory(source, config, **workload, gradient_checkpointing=gradient_checkpointing)


def _one_thread() -> None:
    torch.set_num_threads(1)  # two processes on two cores: one thread each


def _estimate_all(jobs: list[tuple], processes: int, progress: bool) -> list[MemoryEstimate]:
    """Every job's estimate, in order: in this process, or in ``processes`` forked ones (each setting's estimate is
    the same function of its job in either: the processes only share the work)."""
    processes = min(processes, len(jobs), os.cpu_count() or 1)
    forked = processes > 1 and sys.platform == "linux" and "fork" in multiprocessing.get_all_start_methods()
    order = list(range(len(jobs)))
    if forked:  # the slowest first (SlimFit traces every block), so that neither process is left with it at the end
        order.sort(key=lambda i: not isinstance(jobs[i][1], SlimFitConfig))
    # The objects alive now (the imported modules' hundreds of thousands) are left out of the garbage collector's
    # passes until the estimates are made, and, forked, are not copied into each process by those passes: a trace
    # makes and frees many objects, and each full pass would walk them all. No tensor of a trace is among them. (Not
    # where the caller has frozen objects itself: unfreezing would undo that.)
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    estimates: list[MemoryEstimate | None] = [None] * len(jobs)
    try:
        pool = multiprocessing.get_context("fork").Pool(processes, initializer=_one_thread) if forked else None
        with (
            tqdm(total=len(jobs), desc="estimating", unit="setting", disable=not progress) as bar,
            pool or nullcontext(),
        ):
            found = (pool.imap if forked else map)(_estimate, [jobs[i] for i in order])
            for index, estimate in zip(order, found):
                estimates[index] = estimate
                bar.update()
    finally:
        if freeze:
            gc.unfreeze()
    return estimates
