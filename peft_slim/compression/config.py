"""Configuration of activation compression: what autograd keeps for backward, and in how many bits."""

from __future__ import annotations

from dataclasses import field

from ..configuration import Boolean, Choices, Integer, Mapping, OneOf, Real, ValidatedConfig, config_dataclass, setting

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


@config_dataclass
class ActivationCompressionConfig(ValidatedConfig):
    """How [`compress_activations`] stores the tensors autograd saves for the backward pass.

    Saved activations, not weights, dominate training memory once weights are frozen or adapted with LoRA.
    Each saved floating-point activation of a selected kind is quantized per group (and optionally pruned),
    then restored to its dtype, shape and strides when backward needs it. Always kept as they are: parameters
    (and views and autocast copies of them), integer/boolean tensors, tensors smaller than `min_numel`,
    per-row statistics (a last dimension of 1, e.g. a norm's inverse RMS) and tensors holding inf/NaN (e.g.
    additive attention masks). `bits=None` without pruning is exact.
    """

    bits: int | None = setting(
        8,
        "Bits per stored value: 8, 4 or 2 (narrower codes packed into bytes). None: not quantized.",
        OneOf(BITS, optional=True),
    )
    group_size: int = setting(
        128,
        "Consecutive values (in memory order) sharing one fp32 scale and minimum; a multiple of 8 in "
        "[8, 65536]. Each tensor's groups are fitted to its rows (the innermost dimension): the nearest size "
        "at or below this one that divides a row, or whole rows when rows are shorter. Smaller groups are "
        "more accurate and cost 8 bytes per group.",
        Integer(8, 65536, multiple_of=8),
    )
    kinds: list[str] = field(
        default_factory=lambda: [ALL],
        metadata={
            "help": f"Which saved tensors to compress, any of {KINDS} or 'all'. {_KINDS_HELP}",
            "check": Choices((*KINDS, ALL)),
        },
    )
    kind_bits: dict[str, int | None] | None = setting(
        None,
        f"Per-kind override of `bits` (keys among {KINDS}, values 8, 4, 2 or None = kept exact), e.g. "
        "{'activation': 4} for 4-bit GELU/SiLU inputs. A kind listed here is compressed at its width even if "
        "`kinds` leaves it out (None: left unquantized even if `kinds` selects it); unlisted kinds follow "
        "`bits` and `kinds`. None: every kind `kinds` selects uses `bits`.",
        Mapping(KINDS, OneOf(BITS, optional=True)),
    )
    prune_ratio: float | None = setting(
        None,
        "Keep only this fraction in (0, 1] of the values, the largest in magnitude, of tensors of the "
        "`prune_kinds` (the rest backpropagate as zeros; lossy). None: no pruning.",
        Real(0.0, 1.0, low_open=True, optional=True),
    )
    prune_kinds: list[str] = field(
        default_factory=lambda: ["norm"],
        metadata={
            "help": f"Kinds that `prune_ratio` applies to, any of {KINDS} or 'all' (see `kinds`).",
            "check": Choices((*KINDS, ALL)),
        },
    )
    prune_frozen_only: bool = setting(
        False,
        "Prune only tensors saved inside a module none of whose own parameters requires grad (a frozen "
        "norm layer, or one without parameters); a trainable layer's tensors are never pruned, so its weight "
        "gradient stays unpruned. Tensors saved outside any module are then not pruned either.",
        Boolean(),
    )
    min_numel: int = setting(
        4096,
        "Saved tensors with fewer elements than this are kept as they are (>= 0).",
        Integer(0),
    )
    offload: bool = setting(
        False,
        "Keep the compressed tensors in CPU memory while the model runs on an accelerator.",
        Boolean(),
    )

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
