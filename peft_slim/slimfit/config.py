"""Configuration of SlimFit: freeze most weight tensors at every step, chosen by how much each still changes."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

from peft import LoraConfig, PeftConfig
from peft.utils.peft_types import PeftType

from ..compression import ActivationCompressionConfig
from ..nested_lora import lora_export_config, lora_to_dict
from ..registry import add_peft_type
from ..tokentune import TokenTuneConfig

METRICS = ("relative_change", "update_norm")
LORA_UNITS = ("pair", "matrix")

add_peft_type("SLIMFIT")


def default_compression() -> ActivationCompressionConfig:
    """SlimFit's recipe for the activations freezing cannot remove: 4-bit GELU/SiLU inputs, 8-bit for the rest
    (attention Q/K/V and probabilities, norm inputs, inputs of the layers still training).

    The paper also prunes frozen norm layers' outputs to their top 10%. A norm's output is saved by the layer
    after it, so the nearest thing here prunes what a frozen norm saves, its input; on a tiny Llama with LoRA
    that cut the gradient's cosine similarity to the exact one to 0.89 (0.99998 without it), so pruning is off
    by default: `prune_ratio=0.1, prune_frozen_only=True` turns it on.
    """
    return ActivationCompressionConfig(bits=8, kind_bits={"activation": 4})


@dataclass
class SlimFitConfig(PeftConfig):
    """Configuration for [`SlimFitModel`].

    At every optimizer step only a fraction `1 - freeze_ratio` of the scheduling units train; the others are
    frozen (no gradient, no cached input, no optimizer update). Units are ranked by how much they changed the
    last time they trained (the paper's inter-layer scheduling); the first steps sweep every unit once, in a
    seeded random order, and no unit stays frozen for more than `max_frozen_steps`. Without `lora` the base
    model's own weights are the units (full fine-tuning); with `lora` the LoRA adapters are. Call
    `model.slimfit_step()` after each `optimizer.step()`, or use `peft_slim.SlimFitCallback` with Trainer.
    """

    freeze_ratio: float = field(
        default=0.9,
        metadata={"help": "Fraction in [0, 1) of the scheduling units frozen at each step (at least one trains)."},
    )
    units: list[str] | None = field(
        default=None,
        metadata={
            "help": "Regexes (full match against parameter names) that group parameters into units: parameters "
            "matching the same regex with the same captured groups form one unit, e.g. r'.*layers\\.(\\d+)\\..*' "
            "makes one unit per layer. Parameters matched by no regex keep the default: each weight tensor (a "
            "matrix, an embedding, a norm gain) is its own unit, or each LoRA adapter with `lora`. Biases always "
            "train (without `lora`)."
        },
    )
    always_trainable: list[str] | str | None = field(
        default=None,
        metadata={
            "help": "Modules (names, suffix match; or one regex, full match) whose parameters train at every step "
            "and are never scheduled, e.g. a task head."
        },
    )
    modules_to_save: list[str] | None = field(
        default=None,
        metadata={"help": "Extra modules (e.g. a new classification head) trained at every step and saved in full."},
    )
    metric: str = field(
        default="relative_change",
        metadata={
            "help": "Score of a unit after it trained: 'relative_change', mean(|W_new - W_old| / (|W_old| + "
            "epsilon)) (the paper's, with epsilon); 'update_norm', ||W_new - W_old|| / (||W_old|| + epsilon)."
        },
    )
    epsilon: float = field(
        default=1e-3,
        metadata={
            "help": "Added to the weight magnitude in the score's denominator (> 0), so that near-zero weights (or a "
            "LoRA B matrix that starts at zero) cannot dominate the ranking."
        },
    )
    schedule_every: int = field(
        default=1, metadata={"help": "Optimizer steps between re-rankings (>= 1); the frozen set holds in between."}
    )
    max_frozen_steps: int = field(
        default=100,
        metadata={"help": "A unit frozen for this many consecutive steps (>= 1) trains at the next re-ranking."},
    )
    seed: int = field(
        default=0,
        metadata={
            "help": "Seed of the first sweep's random order. Every process of a distributed run must use the same "
            "one, so that all make the same freeze decisions."
        },
    )
    activation_compression: ActivationCompressionConfig | dict | None = field(
        default_factory=default_compression,
        metadata={
            "help": "A peft_slim.ActivationCompressionConfig (or its dict) for the activations saved in each training "
            "forward; the default is SlimFit's recipe (4-bit GELU/SiLU inputs, 8-bit elsewhere). None: exact."
        },
    )
    lora: LoraConfig | dict | None = field(
        default=None,
        metadata={"help": "A peft.LoraConfig: schedule this LoRA adapter's layers instead of the base weights."},
    )
    lora_units: str = field(
        default="pair",
        metadata={
            "help": "With `lora`: 'pair' makes each adapted layer's A and B one unit (B starts at zero, so a lone A "
            "would score zero after its first step and never train again); 'matrix' schedules A and B apart."
        },
    )
    tokentune: TokenTuneConfig | dict | None = field(
        default=None,
        metadata={
            "help": "A peft_slim.TokenTuneConfig: also backpropagate through a subset of tokens. Its `lora`, "
            "`trainable_modules`, `modules_to_save` and `activation_compression` must be unset (SlimFit's apply)."
        },
    )
    release_frozen_optimizer_state: bool = field(
        default=True,
        metadata={
            "help": "Free the optimizer state (e.g. AdamW moments) of units frozen for `release_after_steps` "
            "consecutive steps; it restarts from zero when they train again. Without it the optimizer holds "
            "state for every unit (AdamW: twice the scheduled weights), whatever the freeze ratio. It changes "
            "the updates of units that train again (on MiniLM: accuracy unchanged). Set False to keep all state."
        },
    )
    release_after_steps: int = field(
        default=1, metadata={"help": "Frozen steps (>= 1) after which `release_frozen_optimizer_state` applies."}
    )
    keep_base_weights: bool = field(
        default=False,
        metadata={
            "help": "Keep a CPU copy of the original weights of every scheduled unit and bias, so that unload() can "
            "return the base model (without `lora`). Costs one copy of those weights in CPU memory."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        self.peft_type = PeftType.SLIMFIT
        ratio = self.freeze_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0.0 <= float(ratio) < 1.0:
            raise ValueError(f"SlimFitConfig.freeze_ratio must be a float in [0, 1), got {ratio!r}.")
        self.freeze_ratio = float(ratio)
        if self.units is not None:
            units = [self.units] if isinstance(self.units, str) else self.units
            if not isinstance(units, (list, tuple)) or not units or not all(isinstance(u, str) for u in units):
                raise ValueError(
                    f"SlimFitConfig.units must be a non-empty list of regexes or None, got {self.units!r}."
                )
            self.units = list(units)
        if isinstance(self.always_trainable, (set, tuple)):
            self.always_trainable = sorted(self.always_trainable)
        if self.modules_to_save is not None:
            self.modules_to_save = list(self.modules_to_save)
        if self.metric not in METRICS:
            raise ValueError(f"SlimFitConfig.metric must be one of {METRICS}, got {self.metric!r}.")
        if isinstance(self.epsilon, bool) or not isinstance(self.epsilon, numbers.Real) or not self.epsilon > 0:
            raise ValueError(f"SlimFitConfig.epsilon must be a float > 0, got {self.epsilon!r}.")
        self.epsilon = float(self.epsilon)
        for name in ("schedule_every", "max_frozen_steps", "release_after_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"SlimFitConfig.{name} must be an int >= 1, got {value!r}.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise ValueError(f"SlimFitConfig.seed must be an int, got {self.seed!r}.")
        for name in ("release_frozen_optimizer_state", "keep_base_weights"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SlimFitConfig.{name} must be True or False, got {getattr(self, name)!r}.")
        if isinstance(self.activation_compression, dict):
            self.activation_compression = ActivationCompressionConfig.from_dict(self.activation_compression)
        if self.activation_compression is not None and not isinstance(
            self.activation_compression, ActivationCompressionConfig
        ):
            raise ValueError(
                "SlimFitConfig.activation_compression must be a peft_slim.ActivationCompressionConfig, a dict or "
                f"None, got {type(self.activation_compression).__name__}."
            )
        if isinstance(self.lora, dict):
            self.lora = LoraConfig.from_peft_type(**self.lora)
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise ValueError(f"SlimFitConfig.lora must be a peft.LoraConfig or None, got {type(self.lora).__name__}.")
        if self.lora_units not in LORA_UNITS:
            raise ValueError(f"SlimFitConfig.lora_units must be one of {LORA_UNITS}, got {self.lora_units!r}.")
        if isinstance(self.tokentune, dict):
            values = {
                key: value for key, value in self.tokentune.items() if key in TokenTuneConfig.__dataclass_fields__
            }
            self.tokentune = TokenTuneConfig(**values)
        if self.tokentune is not None:
            if not isinstance(self.tokentune, TokenTuneConfig):
                raise ValueError(
                    "SlimFitConfig.tokentune must be a peft_slim.TokenTuneConfig, a dict or None, got "
                    f"{type(self.tokentune).__name__}."
                )
            nested = [
                name
                for name in ("lora", "trainable_modules", "modules_to_save", "activation_compression")
                if getattr(self.tokentune, name) is not None
            ]
            if nested:
                raise ValueError(
                    f"SlimFitConfig.tokentune sets {nested}: set them on the SlimFitConfig instead (one LoRA, one "
                    "compression, one list of saved modules for the whole model)."
                )

    def to_dict(self) -> dict[str, Any]:
        config = super().to_dict()
        config["lora"] = None if self.lora is None else lora_to_dict(self.lora)
        compression = self.activation_compression
        config["activation_compression"] = None if compression is None else compression.to_dict()
        config["tokentune"] = None if self.tokentune is None else self.tokentune.to_dict()
        return config

    def lora_export_config(self) -> LoraConfig:
        """The plain LoraConfig equivalent of this adapter, as vanilla PEFT would save it."""
        return lora_export_config(self.lora, self)
