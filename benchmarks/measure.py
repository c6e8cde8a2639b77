"""Train one method on one task with one seed, measuring memory and time on the way.

What is measured, and how (nothing is estimated from shapes):

* ``saved_activation_bytes``: distinct storages autograd saves during one training forward, parameters excluded
  (``peft_slim.memory.SavedActivationBytes``); where the method compresses activations inside the model, the
  bytes its compression actually stored (``last_compression_stats.stored_bytes``). Saved-tensor hooks only see
  what autograd saves: a checkpointed layer's input, held by the checkpoint itself, is not counted;
* the peak of one training step (forward, backward, optimizer step; the second step, once optimizer state
  exists) above what was held before it (``peft_slim.memory.peak_memory_bytes``: the CPU allocator's events
  replayed, or ``torch.cuda.max_memory_allocated``), split as: ``parameters`` (all of the model's),
  ``optimizer_state`` (every tensor in the optimizer's state after the step), ``gradients`` (every ``.grad`` after
  the backward) and ``activations`` (the rest of the step's peak: saved activations and operators' temporaries).
  ``total_bytes`` is the sum of the four;
* ``step_seconds``: wall time of each step after the first (warm-up) and the profiled one; the median is reported.
"""

from __future__ import annotations

import functools
import gc
import math
import statistics
import time

import torch
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup

from peft_slim.memory import SavedActivationBytes, peak_memory_bytes

from .methods import Method, Setup
from .tasks import Task, to_device

PROFILED_STEP = 1


def tensor_bytes(tensors) -> int:
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if torch.is_tensor(t)}
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(value for state in optimizer.state.values() for value in state.values())


def saved_activation_bytes(model: torch.nn.Module, batch: dict) -> int:
    """Bytes saved for backward by one training forward (the graph is dropped, nothing is updated)."""
    with SavedActivationBytes(model.parameters()) as saved:
        loss = model(**batch).loss
    stats = getattr(model.base_model, "last_compression_stats", None)
    del loss
    return saved.bytes if stats is None else stats.stored_bytes


class Trainer:
    """One method's training loop; ``step`` records the gradient bytes of the last backward."""

    def __init__(self, setup: Setup, steps: int):
        self.setup = setup
        warmup = math.ceil(0.1 * steps)
        self.schedule = get_linear_schedule_with_warmup(setup.optimizer, warmup, steps)
        self.gradient_bytes = 0

    def step(self, batch: dict) -> float:
        setup = self.setup
        with setup.forward_context():
            loss = setup.model(**batch).loss
        loss.backward()
        self.gradient_bytes = tensor_bytes(p.grad for p in setup.model.parameters() if p.grad is not None)
        setup.optimizer.step()
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
    result: dict = {"seed": seed, "losses": [], "step_seconds": [], "tokens": []}
    if measure_memory:
        result["saved_activation_bytes"] = saved_activation_bytes(model, to_device(batches[0], device))
    trainer = Trainer(setup, task.steps)
    for index, batch in enumerate(tqdm(batches, desc=f"{method.name} seed {seed}", position=position, leave=False)):
        batch = to_device(batch, device)
        if measure_memory and index == PROFILED_STEP:
            peak = peak_memory_bytes(functools.partial(record_step, trainer, batch, result["losses"]))
            result["memory"] = {
                "parameters": tensor_bytes(model.parameters()),
                "optimizer_state": optimizer_state_bytes(setup.optimizer),
                "gradients": trainer.gradient_bytes,
                "activations": max(peak - trainer.gradient_bytes, 0),
                "step_peak": peak,
            }
            continue
        start = time.perf_counter()
        result["losses"].append(trainer.step(batch))
        if device.type == "cuda":
            torch.cuda.synchronize()
        if index > 0:  # the first step is the warm-up
            result["step_seconds"].append(time.perf_counter() - start)
            result["tokens"].append(task.count_tokens(batch))
    if "memory" in result:
        memory = result["memory"]
        memory["total_bytes"] = sum(memory[k] for k in ("parameters", "optimizer_state", "gradients", "activations"))
    result["median_step_seconds"] = statistics.median(result["step_seconds"])
    result["tokens_per_second"] = statistics.mean(result["tokens"]) / result["median_step_seconds"]
    result["metrics"] = task.evaluate(model)
    if setup.history is not None:
        result["slimfit_history"] = setup.history()
    del setup, model, trainer
    gc.collect()
    return result
