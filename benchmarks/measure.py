"""Train one method on one task with one seed, measuring memory and time on the way.

What is measured, and how (nothing is estimated from shapes):

* ``saved_activation_bytes``: distinct storages autograd saves during one training forward, parameters excluded
  (``peft_slim.memory.SavedActivationBytes``); where the method compresses activations inside the model, the
  bytes its compression actually stored (``last_compression_stats.stored_bytes``). Saved-tensor hooks only see
  what autograd saves: a checkpointed layer's input, held by the checkpoint itself, is not counted;
* the peak of one training step (forward, backward, optimizer step; the last step, when the optimizer state is
  at its largest unless SlimFit releases it) above what was held before it (``peft_slim.memory.peak_memory_bytes``:
  the CPU allocator's events replayed, or ``torch.cuda.max_memory_allocated``), split as: ``parameters`` (all of
  the model's), ``optimizer_state`` (the most bytes the optimizer's state held after any step of the run: SlimFit
  that releases the state of frozen units holds more of it mid-run than at the end), ``gradients`` (the most
  bytes of ``.grad`` after any backward of the run: SlimFit trains units of other sizes at every step) and
  ``activations`` (the rest of the last step's peak: saved activations and operators' temporaries).
  ``total_bytes`` is the sum of the four: an upper bound of the run's peak, as the maxima may come from
  different steps;
* ``step_seconds``, ``step_cpu_seconds``: wall and process CPU time of each training step after the first (warm-up)
  and the profiled one (kept in the JSON; the CPU time is comparable at one thread; the wall time is not the reported
  step time: on a shared machine other jobs' load drifts over the minutes a task takes);
* the reported step time comes from ``time_steps``: a separate pass that, round by round, builds each method in
  turn and times a few steps on the same batches, the order reversed every other round, so that load drifts hit
  every method alike. On CPU with one intra-op thread it is the process's CPU time per step
  (``time.process_time``), which other processes' load barely changes; otherwise wall time.
"""

from __future__ import annotations

import functools
import gc
import math
import statistics
import time
from collections import defaultdict

import torch
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup

from peft_slim.memory import SavedActivationBytes, peak_memory_bytes
from peft_slim.tuner.transform import find_transform

from .methods import Method, Setup
from .tasks import Task, to_device


def tensor_bytes(tensors) -> int:
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if torch.is_tensor(t)}
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(value for state in optimizer.state.values() for value in state.values())


def saved_activation_bytes(model: torch.nn.Module, batch: dict) -> int:
    """Bytes saved for backward by one training forward (the graph is dropped, nothing is updated)."""
    with SavedActivationBytes(model.parameters()) as saved:
        loss = model(**batch).loss
    method = find_transform(model)  # full fine-tuning's transform, else the PEFT tuner
    stats = getattr(model.base_model if method is None else method, "last_compression_stats", None)
    del loss
    return saved.bytes if stats is None else stats.stored_bytes


class Trainer:
    """One method's training loop. With ``record_memory``, ``step`` also records the gradient bytes of the last
    backward, and the largest gradients and optimizer state so far (SlimFit trains other units, of other sizes,
    at every step); the timing pass leaves it off, so its steps carry no bookkeeping."""

    def __init__(self, setup: Setup, steps: int, record_memory: bool = False):
        self.setup = setup
        self.record_memory = record_memory
        warmup = math.ceil(0.1 * steps)
        self.schedule = get_linear_schedule_with_warmup(setup.optimizer, warmup, steps)
        self.gradient_bytes = 0
        self.max_gradient_bytes = 0
        self.max_optimizer_state_bytes = 0

    def step(self, batch: dict) -> float:
        setup = self.setup
        with setup.forward_context():
            loss = setup.model(**batch).loss
        loss.backward()
        if self.record_memory:
            self.gradient_bytes = tensor_bytes(p.grad for p in setup.model.parameters() if p.grad is not None)
            self.max_gradient_bytes = max(self.max_gradient_bytes, self.gradient_bytes)
        setup.optimizer.step()
        if self.record_memory:
            state_bytes = optimizer_state_bytes(setup.optimizer)
            self.max_optimizer_state_bytes = max(self.max_optimizer_state_bytes, state_bytes)
        self.schedule.step()
        setup.after_step()
        setup.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def record_step(trainer: Trainer, batch: dict, losses: list[float]) -> None:
    losses.append(trainer.step(batch))


def run(task: Task, method: Method, seed: int, measure_memory: bool, device: torch.device, position: int = 1) -> dict:
    """Train ``method`` on ``task`` for ``task.steps`` steps, evaluate it, return every measurement."""
    torch.manual_seed(seed)
    setup = method.build(task, seed)
    model = setup.model.to(device)
    model.train()
    batches = task.make_batches(seed)
    result: dict = {"seed": seed, "losses": [], "step_seconds": [], "step_cpu_seconds": [], "tokens": []}
    if measure_memory:
        result["saved_activation_bytes"] = saved_activation_bytes(model, to_device(batches[0], device))
    trainer = Trainer(setup, task.steps, record_memory=measure_memory)
    for index, batch in enumerate(tqdm(batches, desc=f"{method.name} seed {seed}", position=position, leave=False)):
        batch = to_device(batch, device)
        if measure_memory and index == len(batches) - 1:  # the last step; the optimizer state: its run maximum
            peak = peak_memory_bytes(functools.partial(record_step, trainer, batch, result["losses"]))
            result["memory"] = {
                "parameters": tensor_bytes(model.parameters()),
                "optimizer_state": trainer.max_optimizer_state_bytes,
                "gradients": trainer.max_gradient_bytes,
                "activations": max(peak - trainer.gradient_bytes, 0),
                "step_peak": peak,
            }
            continue
        start, start_cpu = time.perf_counter(), time.process_time()
        result["losses"].append(trainer.step(batch))
        if device.type == "cuda":
            torch.cuda.synchronize()
        if index > 0:  # the first step is the warm-up
            result["step_seconds"].append(time.perf_counter() - start)
            result["step_cpu_seconds"].append(time.process_time() - start_cpu)
            result["tokens"].append(task.count_tokens(batch))
    if "memory" in result:
        memory = result["memory"]
        memory["total_bytes"] = sum(memory[k] for k in ("parameters", "optimizer_state", "gradients", "activations"))
    result["median_step_seconds"] = statistics.median(result["step_seconds"])
    result["median_step_cpu_seconds"] = statistics.median(result["step_cpu_seconds"])
    result["tokens_per_second"] = statistics.mean(result["tokens"]) / result["median_step_seconds"]
    result["metrics"] = task.evaluate(model)
    if setup.history is not None:
        result["slimfit_history"] = setup.history()
    del setup, model, trainer
    gc.collect()
    return result


def cpu_clock(device: torch.device) -> bool:
    """Whether step times are the process's CPU time: a CPU run on one intra-op thread."""
    return device.type == "cpu" and torch.get_num_threads() == 1


def time_steps(
    task: Task, methods: dict[str, Method], seed: int, device: torch.device, rounds: int = 3, steps: int = 2
) -> dict[str, dict]:
    """Step time of each method, interleaved: each round builds every method in turn (every other round in reverse
    order) and runs one warm-up step and ``steps`` timed ones on the same batches of ``seed``."""
    batches = [to_device(batch, device) for batch in task.make_batches(seed)[: 1 + steps]]
    wall, cpu = defaultdict(list), defaultdict(list)
    names = list(methods)
    for round_ in tqdm(range(rounds), desc=f"{task.name} timing", leave=False):
        for name in names if round_ % 2 == 0 else names[::-1]:
            torch.manual_seed(seed)
            setup = methods[name].build(task, seed)
            setup.model.to(device).train()
            trainer = Trainer(setup, task.steps)
            for index, batch in enumerate(batches):
                start_wall, start_cpu = time.perf_counter(), time.process_time()
                trainer.step(batch)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if index > 0:
                    wall[name].append(time.perf_counter() - start_wall)
                    cpu[name].append(time.process_time() - start_cpu)
            del setup, trainer
            gc.collect()
    tokens = statistics.mean(task.count_tokens(batch) for batch in batches[1:])
    clock = "cpu" if cpu_clock(device) else "wall"
    timing = {}
    for name in names:
        seconds = statistics.median(cpu[name] if clock == "cpu" else wall[name])
        timing[name] = {
            "clock": clock,
            "median_step_seconds": seconds,
            "tokens_per_second": tokens / seconds,
            "wall_seconds": wall[name],
            "cpu_seconds": cpu[name],
        }
    return timing
