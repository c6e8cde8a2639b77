"""Configuration of activation compression: what autograd keeps for backward, and in how many bits."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Any

BITS = (8, 4, 2)
KINDS = ("attention", "norm", "activation", "linear", "other")
ALL = "all"

_KINDS_HELP = (
    "A saved tensor's kind is that of the innermost module running when autograd saves it: 'linear' (nn.Linear "
    "and subclasses, LoRA's layers, transformers' Conv1D, nn.Conv*: their inputs), 'norm' (torch's norm layers "
    "and any class named '*Norm', e.g. LlamaRMSNorm: their inputs), 'activation' (torch.nn and "
    "transformers.activations modules such as GELU/SiLU: their inputs), 'attention' (a class named "
    "'*Attention*' outside its linear layers: Q/K/V, softmax probabilities, SDPA outputs), 'other' (everything "
    "else: residual sums, gated MLP products, embeddings, the loss). 'all' means every kind."
)


@dataclass
class ActivationCompressionConfig:
    """How [`compress_activations`] stores the tensors autograd saves for the backward pass.

    Saved activations, not weights, dominate training memory once weights are frozen or adapted with LoRA.
    Each saved floating-point activation of a selected kind is quantized per group (and optionally pruned),
    then restored to its dtype, shape and strides when backward needs it. Always kept as they are: parameters
    (and views and autocast copies of them), integer/boolean tensors, tensors smaller than `min_numel`,
    per-row statistics (a last dimension of 1, e.g. a norm's inverse RMS) and tensors holding inf/NaN (e.g.
    additive attention masks). `bits=None` without pruning is exact.
    """

    bits: int | None = field(
        default=8,
        metadata={"help": "Bits per stored value: 8, 4 or 2 (narrower codes packed into bytes). None: not quantized."},
    )
    group_size: int = field(
        default=128,
        metadata={
            "help": "Consecutive values (in memory order) sharing one fp32 scale and minimum; a multiple of 8 in "
            "[8, 65536]. Each tensor's groups are fitted to its rows (the innermost dimension): the nearest size "
            "at or below this one that divides a row, or whole rows when rows are shorter. Smaller groups are "
            "more accurate and cost 8 bytes per group."
        },
    )
    kinds: list[str] = field(
        default_factory=lambda: [ALL],
        metadata={"help": f"Which saved tensors to compress, any of {KINDS} or 'all'. {_KINDS_HELP}"},
    )
    kind_bits: dict[str, int | None] | None = field(
        default=None,
        metadata={
            "help": f"Per-kind override of `bits` (keys among {KINDS}, values 8, 4, 2 or None = kept exact), e.g. "
            "{'activation': 4} for 4-bit GELU/SiLU inputs. A kind listed here is compressed at its width even if "
            "`kinds` leaves it out (None: left unquantized even if `kinds` selects it); unlisted kinds follow "
            "`bits` and `kinds`. None: every kind `kinds` selects uses `bits`."
        },
    )
    prune_ratio: float | None = field(
        default=None,
        metadata={
            "help": "Keep only this fraction in (0, 1] of the values, the largest in magnitude, of tensors of the "
            "`prune_kinds` (the rest backpropagate as zeros; lossy). None: no pruning."
        },
    )
    prune_kinds: list[str] = field(
        default_factory=lambda: ["norm"],
        metadata={"help": f"Kinds that `prune_ratio` applies to, any of {KINDS} or 'all' (see `kinds`)."},
    )
    prune_frozen_only: bool = field(
        default=False,
        metadata={
            "help": "Prune only tensors saved inside a module none of whose own parameters requires grad (a frozen "
            "norm layer, or one without parameters); a trainable layer's tensors are never pruned, so its weight "
            "gradient stays unpruned. Tensors saved outside any module are then not pruned either."
        },
    )
    min_numel: int = field(
        default=4096,
        metadata={"help": "Saved tensors with fewer elements than this are kept as they are (>= 0)."},
    )
    offload: bool = field(
        default=False,
        metadata={"help": "Keep the compressed tensors in CPU memory while the model runs on an accelerator."},
    )

    def __post_init__(self):
        if self.bits is not None and (isinstance(self.bits, bool) or self.bits not in BITS):
            raise ValueError(f"ActivationCompressionConfig.bits must be one of {BITS} or None, got {self.bits!r}.")
        if not _is_int(self.group_size) or self.group_size % 8 or not 8 <= self.group_size <= 65536:
            raise ValueError(
                "ActivationCompressionConfig.group_size must be a multiple of 8 in [8, 65536], "
                f"got {self.group_size!r}."
            )
        if self.prune_ratio is not None:
            ratio = self.prune_ratio
            if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0.0 < float(ratio) <= 1.0:
                raise ValueError(
                    f"ActivationCompressionConfig.prune_ratio must be a float in (0, 1] or None, got {ratio!r}."
                )
            self.prune_ratio = float(ratio)
        if not _is_int(self.min_numel) or self.min_numel < 0:
            raise ValueError(f"ActivationCompressionConfig.min_numel must be an int >= 0, got {self.min_numel!r}.")
        for name in ("offload", "prune_frozen_only"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"ActivationCompressionConfig.{name} must be True or False, got {getattr(self, name)!r}."
                )
        self.kinds = _kinds("kinds", self.kinds)
        if self.kind_bits is not None:
            if not isinstance(self.kind_bits, dict) or any(
                kind not in KINDS or (bits is not None and (isinstance(bits, bool) or bits not in BITS))
                for kind, bits in self.kind_bits.items()
            ):
                raise ValueError(
                    f"ActivationCompressionConfig.kind_bits must map kinds in {KINDS} to one of {BITS} or None, "
                    f"got {self.kind_bits!r}."
                )
            self.kind_bits = dict(sorted(self.kind_bits.items()))
        self.prune_kinds = _kinds("prune_kinds", self.prune_kinds)

    @property
    def compressed_kinds(self) -> frozenset[str]:
        """Kinds handled at all (quantized, or offloaded with `bits=None`); `kind_bits` adds and removes kinds."""
        overrides = self.kind_bits or {}
        kinds = set(KINDS if ALL in self.kinds else self.kinds) | {k for k, bits in overrides.items() if bits}
        return frozenset(kinds - {k for k, bits in overrides.items() if bits is None})

    def bits_for(self, kind: str) -> int | None:
        """The width a saved tensor of ``kind`` is stored at (None: not quantized)."""
        if self.kind_bits is not None and kind in self.kind_bits:
            return self.kind_bits[kind]
        return self.bits if ALL in self.kinds or kind in self.kinds else None

    @property
    def pruned_kinds(self) -> frozenset[str]:
        if self.prune_ratio is None or self.prune_ratio == 1.0:
            return frozenset()
        return frozenset(KINDS if ALL in self.prune_kinds else self.prune_kinds)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ActivationCompressionConfig:
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"ActivationCompressionConfig has no field(s) {sorted(unknown)}.")
        return cls(**values)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _kinds(name: str, value: Any) -> list[str]:
    """``value`` as a list of known kinds; a single string is accepted."""
    values = [value] if isinstance(value, str) else value
    allowed = (*KINDS, ALL)
    if not isinstance(values, (list, tuple, set, frozenset)) or not values or any(v not in allowed for v in values):
        raise ValueError(f"ActivationCompressionConfig.{name} must be a non-empty list of {allowed}, got {value!r}.")
    return sorted(set(values))
