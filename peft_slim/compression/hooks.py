"""``compress_activations``: keep what autograd saves for backward in fewer bytes, through saved-tensor hooks.

Only the innermost saved-tensor hooks act (a checkpoint or ``save_on_cpu`` inside handles its own tensors); call
``backward`` after leaving the context, so a checkpoint's recomputation is not compressed for nothing. A context acts
only in the thread and ``contextvars`` context that entered it.

In-place writes: torch does not check tensors saved-tensor hooks hold, so ``unpack`` raises autograd's error. A tensor
kept as it is is checked exactly; a compressed copy through its root's version, when backward needs it or last seen
(missed only if written after its last save and dead before the context ends).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import saved_tensors_hooks

from ..compat import storage_base, storage_key
from ..compat import tensor_version as version_of
from .classify import ModuleStack, is_compressible, is_weight, saved_kind
from .config import KINDS, ActivationCompressionConfig
from .tensor import CompressedTensor, compress


@dataclass
class CompressionStats:
    """Bytes autograd would have kept for the activations (not weights) saved in the context, each storage once, and
    bytes kept instead (storages kept as they are, and each distinct compressed tensor's)."""

    original_bytes: int = 0
    stored_bytes: int = 0
    compressed: int = 0  # distinct tensors compressed
    kept: int = 0  # distinct storages kept as they are

    @property
    def ratio(self) -> float:
        return self.stored_bytes / self.original_bytes if self.original_bytes else 1.0


@dataclass(eq=False)
class _Storage:
    """One storage seen in the context. ``owner`` (the root tensor) dies with it: then its address may be reused."""

    owner: weakref.ref
    kept: bool = False
    packed: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)  # view key -> its packed


@dataclass(eq=False)
class _Witness:
    """The version of a compressed tensor's root (shared by all its views), readable after the root has died."""

    root: weakref.ref
    last: int = 0  # the root's version when last seen: when saved, or when the context exited

    def version(self):
        root = self.root()
        return self.last if root is None else version_of(root)


@dataclass(eq=False, slots=True)
class _Saved:
    """What the pack hook returns: the stored form, and the saved tensor's version then, checked by ``unpack``."""

    value: object  # a detached alias of the saved tensor (same version counter), or a CompressedTensor
    version: int
    witness: _Witness | None = None  # for a CompressedTensor: its root's version

    def unpack(self) -> torch.Tensor:
        value = self.value
        now = version_of(value) if self.witness is None else self.witness.version()
        if now != self.version:
            form = "as it was" if self.witness is None else "compressed"
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{value.dtype} {list(value.shape)}] is at version {now}; expected version {self.version} instead "
                f"(detected by peft_slim's activation compression, which holds this saved tensor {form}; plain "
                "autograd raises the same error). Hint: replace the in-place operation that writes it after it is "
                "used (e.g. nn.ReLU(inplace=True), x.mul_()) by its out-of-place form, or clone the tensor first."
            )
        return value.decompress() if self.witness is not None else value


class ActivationCompression(saved_tensors_hooks):
    """The context manager returned by [`compress_activations`]; ``stats`` accumulates over its uses."""

    def __init__(self, config: ActivationCompressionConfig):
        self.config = config
        self.stats = CompressionStats()
        self._modules = ModuleStack()
        self._storages: dict[int, _Storage] = {}
        self._witnesses: dict[int, _Witness] = {}  # id of a compressed view family's root -> its _Witness
        self._frozen: dict[torch.nn.Module, bool] = {}
        self._active = False
        super().__init__(self._pack, _Saved.unpack)

    def __enter__(self) -> ActivationCompression:
        if self._active:
            raise RuntimeError("This compress_activations context is already active; create another one to nest.")
        self._active = True
        config = self.config  # what each kind gets, looked up once per context rather than per saved tensor
        self._bits = {kind: config.bits_for(kind) for kind in KINDS}
        self._handled, self._pruned = config.compressed_kinds, config.pruned_kinds
        self._modules.start()
        super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._modules.stop()
        for witness in self._witnesses.values():  # compressed tensors still alive: their version from now on
            witness.last = witness.version()
        self._witnesses.clear()
        self._storages.clear()  # addresses are meaningless once the forward is over
        self._frozen.clear()
        self._active = False

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        packed = self._store(tensor)
        if isinstance(packed, CompressedTensor):
            root = storage_base(tensor)
            witness = self._witnesses.get(id(root))
            if witness is None or witness.root() is not root:
                witness = self._witnesses[id(root)] = _Witness(weakref.ref(root))
            witness.last = version_of(root)
            return _Saved(packed, witness.last, witness)
        return _Saved(packed, version_of(packed))  # an alias shares the tensor's version counter: checked exactly

    def _store(self, tensor: torch.Tensor):
        """What to keep for ``tensor``: a detached alias (as it is) or a CompressedTensor."""
        # torch keeps these hooks per thread, not per context: an asyncio task created outside this one runs here too
        if not self._modules.here():
            return tensor.detach()  # not saved in this context: as if there were no hook
        module = self._modules.innermost
        if is_weight(tensor, module) or (tensor.requires_grad and tensor.grad_fn is None):
            return tensor.detach()  # weights and leaf inputs: held by their owner anyway, not activations
        entry = self._entry(tensor)
        config = self.config
        kind = saved_kind(tensor, module)
        bits = self._bits[kind]
        pruned = kind in self._pruned and (not config.prune_frozen_only or self._is_frozen(module))
        offloaded = config.offload and tensor.device.type != "cpu"
        wanted = bits is not None or pruned or (offloaded and kind in self._handled)
        if not wanted or not is_compressible(tensor, config.min_numel):
            return self._keep(entry, tensor)
        key = (tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype, version_of(tensor), bits, pruned)
        packed = entry.packed.get(key)
        if packed is None:
            with torch.no_grad():
                ratio = config.prune_ratio if pruned else None
                packed = compress(tensor.detach(), bits, config.group_size, ratio, config.offload)
            if packed is None or (packed.nbytes >= tensor.numel() * tensor.element_size() and not offloaded):
                return self._keep(entry, tensor)  # not finite, or it would not shrink
            entry.packed[key] = packed
            self.stats.compressed += 1
            self.stats.stored_bytes += packed.nbytes
        return packed

    def _is_frozen(self, module: torch.nn.Module | None) -> bool:
        """Whether none of ``module``'s own parameters requires grad (False outside any module)."""
        if module is not None and module not in self._frozen:
            self._frozen[module] = not any(p.requires_grad for p in module.parameters(recurse=False))
        return module is not None and self._frozen[module]

    def _entry(self, tensor: torch.Tensor) -> _Storage:
        key = storage_key(tensor)
        entry = self._storages.get(key)
        if entry is None or entry.owner() is None:
            entry = _Storage(weakref.ref(storage_base(tensor)))
            self._storages[key] = entry
            self.stats.original_bytes += tensor.untyped_storage().nbytes()
        return entry

    def _keep(self, entry: _Storage, tensor: torch.Tensor) -> torch.Tensor:
        if not entry.kept:
            entry.kept = True
            self.stats.kept += 1
            self.stats.stored_bytes += tensor.untyped_storage().nbytes()
        return tensor.detach()  # a detached alias: the graph must not hold the tensor itself (a cycle)


def compress_activations(config: ActivationCompressionConfig | dict | None = None, **fields) -> ActivationCompression:
    """A context manager compressing the activations saved for backward inside it: ``with compress_activations(bits=4)
    as compression: loss = model(**batch).loss``, then ``loss.backward()``; ``compression.stats`` counts the bytes.
    ``fields`` override ``config``'s."""
    if config is None or isinstance(config, dict):
        config = ActivationCompressionConfig.from_dict(config or {})
    elif not isinstance(config, ActivationCompressionConfig):
        raise ValueError(
            f"compress_activations takes an ActivationCompressionConfig, a dict or None, got {type(config).__name__}."
        )
    if fields:
        config = ActivationCompressionConfig.from_dict({**config.to_dict(), **fields})
    return ActivationCompression(config)
