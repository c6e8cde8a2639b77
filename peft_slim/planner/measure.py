"""``measure_memory``: the same training step as ``estimate_memory``, run for real on random weights, measured
by the allocator (``peft_slim.memory``). What the planner's estimates are checked against."""

from __future__ import annotations

from peft import PeftConfig

from ..memory import held_memory_bytes, timeline_peak_bytes
from ..quiet import warning_silenced
from .estimate import MemoryEstimate
from .setup import after_step, gradient_bytes, make_optimizer, optimizer_state_bytes, training_step, weight_bytes


def measure_memory(
    model,
    peft_config: PeftConfig | None,
    batch_size: int,
    seq_len: int | None,
    optimizer: str = "adamw",
    *,
    dtype: str = "float32",
    gradient_checkpointing: bool = False,
    task: str | None = None,
    seed: int = 0,
) -> MemoryEstimate:
    """Build the model for real (a module given is copied; a config gets random weights), train three steps and
    measure as ``estimate_memory`` estimates: step 2 gives the activations (bytes the forward leaves allocated),
    gradients and optimizer state, step 3 the peak (``timeline_peak_bytes`` plus what was held before it)."""
    step = (model, peft_config, batch_size, seq_len, optimizer, dtype, task, gradient_checkpointing)
    workload, trained, inputs = training_step(*step, "cpu", seed)
    opt = make_optimizer(trained, workload.optimizer)

    def forward():
        return trained(**inputs).loss

    def rest(loss):
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        after_step(trained)

    with warning_silenced(Warning, "SlimFit: an optimizer stepped twice"):
        rest(forward())  # step 1: creates the optimizer state
        activations, loss = held_memory_bytes(forward)
        loss.backward()
        del loss
        gradients = gradient_bytes(trained)
        opt.step()
        opt.zero_grad(set_to_none=True)
        after_step(trained)
        state = optimizer_state_bytes(opt)
        held = weight_bytes(trained)
        peak = timeline_peak_bytes(lambda: rest(forward()))
    return MemoryEstimate(held, gradients, state, activations, held + state + peak)
