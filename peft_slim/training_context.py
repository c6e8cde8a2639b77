"""One training forward's context: activation compression, then token selection, then SlimFit's freezing, turned on
by the model's pre-hook (however the model is called) and off in the reverse order however the forward ends.

Torch runs ``always_call`` forward hooks after an ``Exception`` only, so a KeyboardInterrupt or SystemExit would leave
them on: the model's forward (a wrapper on the instance, as accelerate's device hooks set one) and the tuner's run
inside :meth:`TrainingContext.guard`, which leaves them on any ``BaseException``; an entry an interrupt left behind
elsewhere is left before the next one starts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

from .compat import active_saved_tensors_pack
from .compression import ActivationCompressionConfig, CompressionStats, compress_activations
from .memory import SavedActivationBytes


class TrainingContext:
    """What each training forward of ``model`` turns on: ``compression``, then ``selector`` (a ``TokenSelector``), then
    ``freezing`` (called before every forward with grad enabled, train mode or not); each may be None."""

    def __init__(
        self,
        model: nn.Module,
        compression: ActivationCompressionConfig | None = None,
        selector: Any = None,
        freezing: Callable[[nn.Module], None] | None = None,
    ):
        self.model = model
        self.compression = compression
        self.selector = selector
        self.freezing = freezing
        self.last_stats: CompressionStats | None = None
        self._leave_steps: list[Callable[[], None]] | None = None  # the open forward's, in the order to run them
        self._handles: list = []
        self.reattach()

    def reattach(self) -> None:
        """Register the model's hooks (again, after ``detach()``)."""
        if not self._handles:
            self._handles = [
                self.model.register_forward_pre_hook(self._enter, prepend=True, with_kwargs=True),
                self.model.register_forward_hook(self._exit, with_kwargs=True, always_call=True),
            ]
            self.model.forward = _GuardedForward(self.model, self)

    def detach(self) -> None:
        self.leave()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        wrapper = self.model.__dict__.get("forward")
        if isinstance(wrapper, _GuardedForward) and wrapper.context is self:  # (else wrapped again since: stays)
            if wrapper.inner is None:
                del self.model.forward
            else:
                self.model.forward = wrapper.inner

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Run a call of the model: whatever raised inside (``BaseException`` included), the context is left."""
        try:
            yield
        except BaseException:
            self.leave()
            raise

    def leave(self) -> None:
        """Turn off what the open training forward turned on, in the reverse order; nothing when none is open."""
        steps, self._leave_steps = self._leave_steps, None
        if steps is None:
            return
        error = None
        for step in steps:
            try:
                step()
            except BaseException as raised:  # every step runs; the first error is raised after
                error = error or raised
        if error is not None:
            raise error

    def _enter(self, model: nn.Module, args: tuple, kwargs: dict):
        self.leave()  # left behind by an interrupt outside a guard
        steps: list[Callable[[], None]] = []
        self._leave_steps = steps
        try:
            training = model.training and torch.is_grad_enabled()
            if training and self.compression is not None:
                refuse_outer_saved_tensor_hooks()
                compression = compress_activations(self.compression).__enter__()
                steps.insert(0, lambda: compression.__exit__(None, None, None))
                self.last_stats = compression.stats
            if self.selector is not None:
                steps.insert(0, self.selector._abort)
                args, kwargs = self.selector._before_forward(model, args, kwargs)
            if self.freezing is not None and torch.is_grad_enabled():
                self.freezing(model)
        except BaseException:
            self.leave()
            raise
        return args, kwargs

    def _exit(self, model: nn.Module, args: tuple, kwargs: dict, output: Any):
        try:
            if self.selector is not None and self._leave_steps is not None:
                return self.selector._after_forward(model, args, kwargs, output)
            return None
        finally:
            self.leave()


class _GuardedForward:
    """The model's ``forward`` (the instance's own, ``inner``, or the class's) run inside its context's ``guard()``; an
    object, so a deep copy refers to the copy's model and context."""

    def __init__(self, model: nn.Module, context: TrainingContext):
        self.model = model
        self.context = context
        self.inner = model.__dict__.get("forward")

    @property
    def forward(self) -> Callable:
        return self.inner if self.inner is not None else partial(type(self.model).forward, self.model)

    @property
    def __signature__(self) -> inspect.Signature:  # what Trainer and generate() read to pick the inputs
        return inspect.signature(self.forward)

    def __call__(self, *args, **kwargs):
        with self.context.guard():
            return self.forward(*args, **kwargs)


def refuse_outer_saved_tensor_hooks() -> None:
    """Raise when another saved-tensor hook (TRL's ``activation_offloading``, ``save_on_cpu``, ...) is active around a
    compressed training forward: only the innermost acts, so the outer one would silently keep nothing. peft_slim's
    own ``SavedActivationBytes`` (documented to see nothing inside) is allowed."""
    pack = active_saved_tensors_pack()
    owner = getattr(pack, "__self__", None)
    if pack is None or isinstance(owner, SavedActivationBytes):
        return
    name = type(owner).__name__ if owner is not None else getattr(pack, "__qualname__", repr(pack))
    raise ValueError(
        f"activation_compression cannot run inside another saved-tensor hook ({name}; e.g. TRL's "
        "SFTConfig(activation_offloading=True) or torch.autograd.graph.save_on_cpu): only the innermost of nested "
        "hooks acts. Use one of them: activation_compression=None in the method's config, or the offloading off."
    )
