"""Bytes alive at every moment of a traced training step: the allocator's view, replayed on fake tensors.

Every operator's output that brings a new storage adds its bytes; the storage's bytes go when the last tensor
using it dies (autograd's saved tensors, gradients and optimizer state keep theirs alive as long as they really
are). Buffers an operator allocates and frees before returning are not seen, with one exception that is large:
a CPU elementwise operator whose tensors differ in dtype (PEFT adds a float32 LoRA output to a bfloat16 layer's)
first copies each input of another dtype to the common one (TensorIterator's ``promote_inputs_to_common_dtype``),
and an in-place one computes into a temporary of the common dtype; those copies live while it runs.

On meta tensors an operator's results are a function of its arguments' shapes, strides and dtypes: ``MetaResults``
remembers them, so that each distinct call runs its meta kernel (most of them in Python) once per process.
"""

from __future__ import annotations

import weakref

import torch

from ..compat import storage_key
from .fake import PRIM_DEVICE, TO_COPY, TorchDispatchMode, device_of_fake, tree_map_only


class LiveBytes(TorchDispatchMode):
    """``total``: bytes of the storages created inside the mode and still alive; ``peak``: the highest ``total``."""

    def __init__(self, on_meta: bool = False):
        super().__init__()
        self.on_meta = on_meta
        # storage key -> [bytes, tensors using it, meta copies holding it, the entry it holds (a meta copy's)]
        self._live: dict[int, list] = {}
        self._refs: dict[int, tuple] = {}  # id of a weak reference to a tracked tensor -> (the reference, storage key)
        self.total = 0
        self.peak = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: no wrapper keeping ``torch.compile`` out of ``__torch_dispatch__`` at every call (private torch
        API, read when the class is made); nothing compiles inside the planner's modes."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is PRIM_DEVICE:  # a tensor's device, asked more often than any operator: nothing allocated
            device = device_of_fake(args[0])
            return func(*args) if device is None else device
        kwargs = kwargs or {}
        given = tensors_in(args, kwargs)
        if self.on_meta:
            if func is TO_COPY and not args[0].is_meta and kwargs.get("dtype") in (None, args[0].dtype):
                return self._moved(args[0], func(*args, **kwargs))
            meta = sum(t.is_meta for t in given)
            if 0 < meta < len(given):  # real tensors mixed with meta ones: moved to the meta device
                args, kwargs = on_one_device(args, kwargs)
                given = tensors_in(args, kwargs)
            out = META_RESULTS.run(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        flags = operator_flags(func)
        inputs = None
        results = [out] if isinstance(out, torch.Tensor) else tensors_in(out) if isinstance(out, tuple | list) else ()
        for tensor in results:
            key = storage_key(tensor)
            if key not in self._live:
                # A view allocates nothing. Its storage is untracked when it views a tensor from before the trace (a
                # weight), or the fake copy of a real tensor (the token selection's index, drawn for real from the
                # real inputs and counted as such): fake tensor mode converts real arguments to fake ones.
                if flags[0]:  # a view
                    continue
                if inputs is None:  # storages the operator was given: an in-place result on one of them
                    inputs = {storage_key(t) for t in given}
                if key in inputs:
                    continue  # an in-place change of a tensor from before the trace: nothing allocated or freed
            self._track(tensor, key)
        if flags[1]:  # pointwise
            self.peak = max(self.peak, self.total + promotion_bytes(func, args, given))
        return out

    def _moved(self, real: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
        """A real tensor's copy on the meta device stands for it, as a fake tensor mode's moving a CPU tensor to its
        CPU is no copy: it keeps the real one's storage alive (if created inside the trace), allocating nothing."""
        held = self._live.get(storage_key(real))
        if held is not None:  # the copy and its views hold the real one's bytes
            held[2] += 1
            key = storage_key(moved)
            self._live[key] = [0, 0, 0, held]
            self._track(moved, key)
        return moved

    def _track(self, tensor: torch.Tensor, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [tensor.untyped_storage().nbytes(), 0, 0, None]
            self.total += entry[0]
            self.peak = max(self.peak, self.total)
        entry[1] += 1
        ref = weakref.ref(tensor, self._released)  # called when the tensor dies, as a finalizer is
        self._refs[id(ref)] = (ref, key)

    def _released(self, ref: weakref.ref) -> None:
        self._release(self._refs.pop(id(ref))[1])

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]  # the storage is gone (its bytes may still be held)
            self._drop(entry)

    def _drop(self, entry: list) -> None:
        if entry[1] == 0 and entry[2] == 0:
            self.total -= entry[0]
            if entry[3] is not None:  # a meta copy of a real tensor: its hold on the real one's bytes
                entry[3][2] -= 1
                self._drop(entry[3])


_FLAGS: dict[int, tuple] = {}  # id of an operator -> (a view?, pointwise?, what MetaResults may remember, operator)


def operator_flags(func) -> tuple:
    """``func``'s (a view?, pointwise?, ``_kind``), found once per operator (operators hash in Python: by their id
    here, each kept alive by its entry so that its id stays its own)."""
    flags = _FLAGS.get(id(func))
    if flags is None:
        flags = _FLAGS[id(func)] = (func.is_view, torch.Tag.pointwise in func.tags, _kind(func), func)
    return flags


def tensors_in(args: tuple | list, kwargs: dict | None = None) -> list[torch.Tensor]:
    """The tensors in an operator's arguments (or results), nested in tuples and lists, in order."""
    found: list[torch.Tensor] = []
    _collect(args, found)
    if kwargs:
        _collect(kwargs.values(), found)
    return found


def _collect(values, found: list) -> None:
    for item in values:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, tuple | list):
            _collect(item, found)


def on_one_device(args: tuple, kwargs: dict) -> tuple:
    """An operator's arguments with its real tensors on the meta device."""
    return tree_map_only(torch.Tensor, lambda t: t if t.device.type == "meta" else t.to("meta"), (args, kwargs))


def promotion_bytes(func, args: tuple, tensors: list[torch.Tensor]) -> int:
    """Bytes of the temporaries a CPU elementwise operator makes while it runs when its floating-point tensors differ
    in dtype: a copy in the common dtype of each one of another dtype, and for an in-place operator on a tensor of
    another dtype, its result in the common dtype (then copied into it). The common dtype is that of the tensors with
    dimensions (a 0-dim one does not promote). Masks and indices (bool, integer) are read as they are. ``tensors``:
    the tensors among its arguments."""
    tensors = [t for t in tensors if t.is_floating_point()]
    shaped = [t for t in tensors if t.dim() > 0] or tensors
    if len({t.dtype for t in shaped}) < 2:
        return 0
    common = shaped[0].dtype
    for tensor in shaped[1:]:
        common = torch.promote_types(common, tensor.dtype)
    copies = sum(t.numel() * common.itemsize for t in shaped if t.dtype != common)
    target = args[0] if func._schema.name.endswith("_") and args and isinstance(args[0], torch.Tensor) else None
    return copies + (target.numel() * common.itemsize if target is not None and target.dtype != common else 0)


class MetaResults:
    """Operators' results on meta tensors, remembered by what the operator reads of its arguments, so that an
    operator called again on tensors of the same shapes, strides and dtypes (and the same other arguments) makes its
    results with ``torch.empty_strided`` instead of running its meta kernel (most of them in Python) again. A meta
    kernel reads no values (there are none): its results are a function of what the key holds.

    Remembered are two kinds of operators, by their schema: those that return new tensors (no alias in the schema),
    where each result is a tensor of its own storage, of the bytes its shape and strides span, from offset 0 (what
    ``torch.empty_strided`` makes; checked on the first run); and those that change their first argument, or their
    one ``out=`` argument, in place and return it, leaving its shape and strides as they were (checked on the first
    run). None that views, writes into several arguments, changes a shape in place, draws random numbers or returns
    a shape that depends on values."""

    def __init__(self):
        self._results: dict[tuple, tuple | None] = {}  # key -> (single result?, (shape, stride, dtype) each) or None

    def run(self, func, args: tuple, kwargs: dict):
        """``func(*args, **kwargs)``, remembered where it may be."""
        kind = operator_flags(func)[2]
        key = None if kind is None else _key(func, args, kwargs)
        if key is None:
            return func(*args, **kwargs)
        found = self._results.get(key, False)
        if found is False:
            if kind is NEW:
                out = func(*args, **kwargs)
                self._results[key] = _made_alike(out, args, kwargs)
                return out
            target = args[0] if kind is IN_PLACE else kwargs.get("out")
            if target is None:
                return func(*args, **kwargs)
            before = target.shape, target.stride()
            out = func(*args, **kwargs)
            unchanged = out is target and (target.shape, target.stride()) == before
            self._results[key] = (True, ()) if unchanged else None
            return out
        if found is None:  # results that are not made alike
            return func(*args, **kwargs)
        if kind is IN_PLACE:
            return args[0]
        if kind is OUT:
            return kwargs["out"]
        single, specs = found
        made = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in specs]
        return made[0] if single else tuple(made)


META_RESULTS = MetaResults()


class Remembered(TorchDispatchMode):
    """Inside it, operators run through ``META_RESULTS`` (those on meta tensors that may be remembered), nothing
    counted: a model built on the meta device, its optimizer state created."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: no wrapper keeping ``torch.compile`` out of ``__torch_dispatch__`` at every call (private torch
        API, read when the class is made); nothing compiles inside the planner's modes."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return META_RESULTS.run(func, args, kwargs or {})


NEW, IN_PLACE, OUT = "new", "in place", "into out"
_SKIPPED_TAGS = (
    torch.Tag.nondeterministic_seeded,
    torch.Tag.dynamic_output_shape,
    torch.Tag.data_dependent_output,
    torch.Tag.inplace_view,
)


def _kind(func) -> str | None:
    """NEW: ``func`` returns new tensors; IN_PLACE: it writes into its first argument and returns it; OUT: it writes
    into its one ``out=`` argument (the only one aliased) and returns it; else None."""
    schema = func._schema
    if func.is_view or any(tag in func.tags for tag in _SKIPPED_TAGS):
        return None
    if not schema.returns or not all(str(r.type) == "Tensor" for r in schema.returns):
        return None
    arguments, returns = schema.arguments, schema.returns
    if not any(a.alias_info is not None for a in (*arguments, *returns)):
        return NEW
    aliased = [a for a in arguments if a.alias_info is not None]
    back = returns[0].alias_info
    if len(returns) > 1 or len(aliased) != 1 or back is None:
        return None
    written = aliased[0].alias_info
    same = back.before_set == written.before_set and back.after_set == written.after_set
    if not (written.is_write and back.is_write and same):
        return None
    if aliased[0] is arguments[0]:
        return IN_PLACE
    return OUT if aliased[0].name == "out" and aliased[0].kwarg_only else None


_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _key(func, args: tuple, kwargs: dict) -> tuple | None:
    """What ``func``'s meta kernel reads of its arguments: each tensor's shape, strides, offset and dtype (every one
    on the meta device), each other argument with its type (``1``, ``1.0`` and ``True`` promote differently), the
    keyword arguments' names; None where an argument is of another kind."""
    parts = [id(func), torch.get_default_dtype(), len(args)]  # (``operator_flags`` keeps each operator alive)
    if not _describe(args, parts):
        return None
    if kwargs:
        parts.append(tuple(kwargs))
        if not _describe(kwargs.values(), parts):
            return None
    return tuple(parts)


def _describe(values, parts: list) -> bool:
    """Append each of ``values`` to ``parts`` as the key holds it; False where one cannot be."""
    for value in values:
        kind = type(value)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            if not value.is_meta or value.layout is not torch.strided or value.is_conj() or value.is_neg():
                return False
            parts.append((value.dtype, value.shape, value.stride(), value.storage_offset()))
        elif kind is tuple or kind is list:
            parts.append((kind, len(value)))
            if not _describe(value, parts):
                return False
        elif kind in _SCALARS:
            parts.append((kind, value))
        else:
            return False
    return True


def _made_alike(out, args: tuple, kwargs: dict) -> tuple | None:
    """How to make ``out`` again with ``torch.empty_strided``, or None where that would not make it alike."""
    single = isinstance(out, torch.Tensor)
    results = [out] if single else out
    if not isinstance(results, (tuple, list)) or not all(type(t) is torch.Tensor for t in results):
        return None
    inputs = {storage_key(t) for t in tensors_in(args, kwargs)}
    storages = [storage_key(t) for t in results]
    if len(set(storages)) < len(storages) or inputs.intersection(storages):
        return None
    specs = []
    for tensor in results:
        shape, stride, dtype = tensor.shape, tensor.stride(), tensor.dtype
        if tensor.device.type != "meta" or tensor.layout is not torch.strided or tensor.storage_offset() != 0:
            return None
        if tensor.is_conj() or tensor.is_neg() or tensor.requires_grad:
            return None
        made = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        if made.untyped_storage().nbytes() != tensor.untyped_storage().nbytes():
            return None
        specs.append((shape, stride, dtype))
    return single, tuple(specs)
