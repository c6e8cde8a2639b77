"""Configuration of activation compression: what autograd keeps for backward, and in how many bits."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ..configuration import check_bool, check_choice, check_float, check_int, check_subset, fail, nested

BITS = (8, 4, 2)
KINDS = ("attention", "norm", "activation", "linear", "other")
ALL = "all"

_KINDS_HELP = (
    "A saved tensor's kind is that of the innermost module running when autograd saves it: 'linear' (nn.Linear "
    "and subclasses, LoRA's layers, transformers' Conv1D, nn.Conv*: their inputs), 'norm' (torch's norm layers "
    "and any class named '*Norm', e.g. LlamaRMSNorm: their inputs), 'activation' (torch.nn and "
    "transformers.activations modules such as GELU/SiLU: their inputs), 'attention' (a class named "
    "'*Attention*' outside its linear layers: Q/K/V, softmax probabilities, SDPA outputs; under token selection also "
    "the unselected tokens' keys/values each block keeps), 'other' (everything else: residual sums, gated MLP "
    "products, embeddings, the loss, the selected tokens' block inputs). 'all' means every kind."
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
        metadata={
            "help": f"Which saved tensors to compress, any of {KINDS} or 'all'. {_KINDS_HELP}",
        },
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
        metadata={
            "help": f"Kinds that `prune_ratio` applies to, any of {KINDS} or 'all' (see `kinds`).",
        },
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
        default=4096, metadata={"help": "Saved tensors with fewer elements than this are kept as they are (>= 0)."}
    )
    offload: bool = field(
        default=False,
        metadata={"help": "Keep the compressed tensors in CPU memory while the model runs on an accelerator."},
    )

    def __post_init__(self):
        name = type(self).__name__
        self.bits = check_choice(f"{name}.bits", self.bits, BITS, optional=True)
        self.group_size = check_int(f"{name}.group_size", self.group_size, 8, 65536, multiple_of=8)
        self.kinds = check_subset(f"{name}.kinds", self.kinds, (*KINDS, ALL))
        if self.kind_bits is not None:
            where = f"{name}.kind_bits"
            if not isinstance(self.kind_bits, dict) or any(key not in KINDS for key in self.kind_bits):
                fail(where, self.kind_bits, f"a dict with keys among {KINDS}", optional=True)
            self.kind_bits = {
                key: check_choice(f"{where}[{key!r}]", self.kind_bits[key], BITS, optional=True)
                for key in sorted(self.kind_bits)
            }
        self.prune_ratio = check_float(f"{name}.prune_ratio", self.prune_ratio, 0.0, 1.0, low_open=True, optional=True)
        self.prune_kinds = check_subset(f"{name}.prune_kinds", self.prune_kinds, (*KINDS, ALL))
        self.prune_frozen_only = check_bool(f"{name}.prune_frozen_only", self.prune_frozen_only)
        self.min_numel = check_int(f"{name}.min_numel", self.min_numel, 0)
        self.offload = check_bool(f"{name}.offload", self.offload)

    def to_dict(self) -> dict[str, Any]:
        return {spec.name: getattr(self, spec.name) for spec in fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ActivationCompressionConfig:
        """The config of ``values`` (its fields; an unknown key is refused naming the nearest field)."""
        return nested(cls.__name__, values, cls)

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
