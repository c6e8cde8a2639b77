"""Configuration of SlimFit: freeze most weight tensors at every step, chosen by how much each still changes."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..compression import ActivationCompressionConfig
from ..configuration import check_bool, check_choice, check_float, check_int, check_names, check_regexes, nested
from ..token_selection import TokenSelectionConfig
from ..tuner import MethodConfig

METRICS = ("relative_change", "update_norm", "gradient")
FREEZE_BY = ("bytes", "count")
LORA_UNITS = ("pair", "matrix")
CATCH_UP = ("sqrt", "linear", "none")
MAX_SEED = 2**63 - 1
# Fields of a TokenTuneConfig that SlimFit's `token_selection` has no use for: set, they are refused.
_TOKENTUNE_ONLY = ("lora", "trainable_modules", "modules_to_save", "activation_compression")


def rotation_steps(freeze_ratio: float) -> int:
    """`max_frozen_steps=None`: the longest wait that still lets every unit train once per round of
    ceil(1 / (1 - freeze_ratio)) steps, the fewest rounds in which a budget of 1 - freeze_ratio covers every unit."""
    # The tolerance keeps 1 / (1 - 0.8) = 5.000000000000001 at 5.
    return max(1, math.ceil(1.0 / (1.0 - freeze_ratio) - 1e-9) - 1)


def default_compression() -> ActivationCompressionConfig:
    """SlimFit's recipe for the activations freezing cannot remove: 4-bit GELU/SiLU inputs, 8-bit for the rest. The
    paper's pruning of frozen norms to their top 10% (here `prune_ratio=0.1, prune_frozen_only=True`) is off: it cut
    the gradient's cosine similarity to the exact one to 0.89 on a tiny Llama with LoRA (0.99998 without)."""
    return ActivationCompressionConfig(bits=8, kind_bits={"activation": 4})


def token_selection_from(where: str, value: Any) -> Any:
    """`token_selection` given as a TokenTuneConfig: its selection fields. A TokenTuneConfig that sets LoRA,
    compression or saved modules is refused: SlimFit's own fields say those for the whole model."""
    if not isinstance(value, TokenSelectionConfig) or type(value) is TokenSelectionConfig:
        return value
    nested = sorted(name for name in _TOKENTUNE_ONLY if getattr(value, name) is not None)
    if nested:
        raise ValueError(
            f"{where} sets {nested}: set them on the SlimFitConfig instead (one LoRA, one compression, one list of "
            "saved modules for the whole model); `token_selection` takes a peft_slim.TokenSelectionConfig."
        )
    return TokenSelectionConfig(
        **{spec.name: getattr(value, spec.name) for spec in dataclasses.fields(TokenSelectionConfig)}
    )


@dataclass
class SlimFitConfig(MethodConfig):
    """Configuration for [`SlimFitModel`].

    At every optimizer step only a fraction `1 - freeze_ratio` of the scheduling units train; the others are
    frozen (no gradient, no cached input, no optimizer update). Units are ranked by how much they changed the
    last time they trained (the paper's inter-layer scheduling); the first steps sweep every unit once, in a
    seeded random order, and no unit stays frozen for more than `max_frozen_steps` (by default one round of
    1 / (1 - freeze_ratio) steps). A unit that trains after missing steps moves further to make up for them
    (`catch_up`, by default k times for k steps). Through PEFT the units are the LoRA adapters of `lora`; with
    `peft_slim.slimfit_` (full fine-tuning, no `lora`) the model's own weights. Call `slimfit_step()` after each
    `optimizer.step()`, or use `peft_slim.SlimFitCallback` with Trainer.
    """

    method: ClassVar[str] = "SLIMFIT"
    nested_types: ClassVar[dict[str, type]] = {**MethodConfig.nested_types, "token_selection": TokenSelectionConfig}
    saved_names: ClassVar[dict[str, str]] = {"tokentune": "token_selection"}

    freeze_ratio: float = field(
        default=0.8,
        metadata={
            "help": "Fraction in [0, 1) of the scheduling units frozen at each step (at least one trains). How 0.8 "
            "and 0.9 compare with full fine-tuning in accuracy and memory: docs/slimfit.md."
        },
    )
    freeze_by: str = field(
        default="bytes",
        metadata={
            "help": "What `freeze_ratio` counts. 'bytes': the units that train at a step hold at most "
            "`1 - freeze_ratio` of the scheduled units' bytes (so of their gradients and optimizer state), or the "
            "smallest unit's bytes if that is more, whatever the tensor sizes; a unit larger than that budget (e.g. "
            "a large vocabulary's embedding) never trains (a warning names it). 'count': at most "
            "`1 - freeze_ratio` of the units (the paper's rule)."
        },
    )
    catch_up: str = field(
        default="linear",
        metadata={
            "help": "How far a unit that trains after missing steps moves: its update is scaled by k ('linear'), "
            "by sqrt(k) ('sqrt') or not at all ('none', the paper's update), where k = 1 + the consecutive steps it "
            "was frozen, at most 1 / (1 - freeze_ratio): W <- W_old + factor (W_new - W_old). 'linear' moves it as "
            "far as steps with consistent gradients would have, 'sqrt' as far as independent ones (a random walk). "
            "The scores rank the optimizer's own update. Measured: docs/slimfit.md."
        },
    )
    always_train_norms: bool = field(
        default=True,
        metadata={
            "help": "Full fine-tuning (slimfit_) only: the weights of normalisation layers (modules whose class name "
            "contains 'Norm', e.g. LayerNorm, RMSNorm) train at every step, like biases, instead of being scheduled "
            "(a few KiB per layer). False: scheduled like other weights (the paper's rule)."
        },
    )
    train_new_weights: bool = field(
        default=True,
        metadata={
            "help": "Full fine-tuning (slimfit_) only: the weights the checkpoint did not provide, which "
            "transformers' from_pretrained initialised (its missing keys, e.g. a new pooler or classification head, "
            "and weights of another shape with ignore_mismatched_sizes), train at every step and are never "
            "scheduled, like PEFT's `modules_to_save`; a warning names them. They are outside `freeze_ratio`'s "
            "budget. A model built from a config (nothing loaded) has none. False: scheduled like the pretrained "
            "weights."
        },
    )
    units: list[str] | None = field(
        default=None,
        metadata={
            "help": "Regexes (full match against parameter names) that group parameters into units: parameters "
            "matching the same regex with the same captured groups form one unit, e.g. r'.*layers\\.(\\d+)\\..*' "
            "makes one unit per layer. Parameters matched by no regex keep the default: each weight tensor (a "
            "matrix, an embedding, a norm gain) is its own unit, or each LoRA adapter with `lora`. Biases always "
            "train (full fine-tuning)."
        },
    )
    always_trainable: list[str] | str | None = field(
        default=None,
        metadata={
            "help": "Modules (names, suffix match; or one regex, full match) whose parameters train at every step "
            "and are never scheduled, e.g. a task head."
        },
    )
    metric: str = field(
        default="relative_change",
        metadata={
            "help": "Score of a unit after it trained: 'relative_change', mean(|W_new - W_old| / (|W_old| + "
            "epsilon)) (the paper's, with epsilon); 'update_norm', ||W_new - W_old|| / (||W_old|| + epsilon); "
            "'gradient', mean(|dL/dW|) over the unit's values, read at the optimizer step (before it): the loss "
            "decrease per value of a sign-like (Adam) step, so the ranking follows the gradient even for a unit whose "
            "optimizer state restarted (its first AdamW update is about lr * sign(g), the same relative change "
            "whatever the gradient). `epsilon` does not enter it."
        },
    )
    epsilon: float = field(
        default=1e-3,
        metadata={
            "help": "Added to the weight magnitude in the score's denominator (a finite float > 0), so that "
            "near-zero weights (or a LoRA B matrix that starts at zero) cannot dominate the ranking."
        },
    )
    schedule_every: int = field(
        default=1, metadata={"help": "Optimizer steps between re-rankings (>= 1); the frozen set holds in between."}
    )
    max_frozen_steps: int | None = field(
        default=None,
        metadata={
            "help": "A unit frozen for this many consecutive steps (>= 1) trains at the next re-ranking, whatever its "
            "score (if it fits the budget). None: one round, `rotation_steps(freeze_ratio)` = ceil(1 / (1 - "
            "freeze_ratio)) - 1 (4 at 0.8, 9 at 0.9), so every unit trains at least once every 1 / (1 - "
            "freeze_ratio) steps where the unit sizes allow it, and with catch_up='linear' moves as far as it would "
            "have in those steps (measured: docs/slimfit.md); a large value (configs saved before this default had "
            "100) lets low-scoring units stay frozen for the whole run."
        },
    )
    seed: int = field(
        default=0,
        metadata={
            "help": "Seed of the first sweep's random order (0 to 2**63 - 1). Every process of a distributed run "
            "must use the same one, so that all make the same freeze decisions."
        },
    )
    activation_compression: ActivationCompressionConfig | dict | None = field(
        default_factory=default_compression,
        metadata={
            "help": "A peft_slim.ActivationCompressionConfig (or its dict) for the activations saved in each training "
            "forward; the default is SlimFit's recipe (4-bit GELU/SiLU inputs, 8-bit elsewhere). None: exact.",
        },
    )
    lora_units: str = field(
        default="pair",
        metadata={
            "help": "With `lora`: 'pair' makes each adapted layer's A and B one unit (B starts at zero, so a lone A "
            "would score zero after its first step and never train again); 'matrix' schedules A and B apart."
        },
    )
    token_selection: TokenSelectionConfig | dict | None = field(
        default=None,
        metadata={
            "help": "A peft_slim.TokenSelectionConfig (or its dict): also backpropagate through a subset of tokens, "
            "as TokenTune does. A TokenTuneConfig with only selection fields set is accepted too."
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

    def __post_init__(self):
        super().__post_init__()
        name = "SlimFitConfig"
        self.freeze_ratio = check_float(f"{name}.freeze_ratio", self.freeze_ratio, 0.0, 1.0, high_open=True)
        self.freeze_by = check_choice(f"{name}.freeze_by", self.freeze_by, FREEZE_BY)
        self.catch_up = check_choice(f"{name}.catch_up", self.catch_up, CATCH_UP)
        self.always_train_norms = check_bool(f"{name}.always_train_norms", self.always_train_norms)
        self.train_new_weights = check_bool(f"{name}.train_new_weights", self.train_new_weights)
        self.units = check_regexes(f"{name}.units", self.units)
        self.always_trainable = check_names(f"{name}.always_trainable", self.always_trainable)
        self.metric = check_choice(f"{name}.metric", self.metric, METRICS)
        self.epsilon = check_float(f"{name}.epsilon", self.epsilon, 0.0, low_open=True)
        self.schedule_every = check_int(f"{name}.schedule_every", self.schedule_every, 1)
        self.max_frozen_steps = check_int(f"{name}.max_frozen_steps", self.max_frozen_steps, 1, optional=True)
        self.seed = check_int(f"{name}.seed", self.seed, 0, MAX_SEED)
        self.lora_units = check_choice(f"{name}.lora_units", self.lora_units, LORA_UNITS)
        selection = token_selection_from(f"{name}.token_selection", self.token_selection)
        self.token_selection = nested(f"{name}.token_selection", selection, TokenSelectionConfig)
        release = self.release_frozen_optimizer_state
        self.release_frozen_optimizer_state = check_bool(f"{name}.release_frozen_optimizer_state", release)
        self.release_after_steps = check_int(f"{name}.release_after_steps", self.release_after_steps, 1)
