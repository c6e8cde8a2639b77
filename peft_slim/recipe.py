"""``Recipe``: one training setting, defined once for ``peft-slim train``, the planner, its measured table and the
benchmarks; the method's defaults are filled in, so two recipes that train the same way are equal."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Any

from peft import LoraConfig, PeftConfig, get_peft_model
from torch import nn

from .compression import ActivationCompressionConfig
from .configuration import check_bool, check_choice, check_float, check_int, check_names
from .slimfit import SlimFitConfig, slimfit_
from .slimfit.config import CATCH_UP
from .token_selection import TokenSelectionConfig
from .token_selection.config import DEFAULT_PROMPT_RATIO, DEFAULT_TOKEN_RATIO, SELECTION_RULES
from .tokentune import TokenTuneConfig, tokentune_
from .tuner import MethodConfig
from .tuner.transform import MethodTransform

METHODS = ("tokentune", "slimfit", "lora", "full")
COMPRESSION_BITS = ("none", 8, 4, 2)
DEFAULT_LORA_R = 8
MAX_LORA_R = 2**16
ALL_LINEAR = "all-linear"
LABEL_FIRST = "answer"  # the rule that selects the labelled (answer) positions first
SLIMFIT_DEFAULTS = SlimFitConfig()  # a recipe's SlimFit defaults are the config's own
SELECTING = ("tokentune", "slimfit")  # the methods that can train on a token subset


@dataclass(frozen=True)
class Recipe:
    """How one run trains (``peft-slim train``'s method flags); a field the method does not use is refused."""

    method: str = field(
        default="tokentune",
        metadata={
            "help": "What trains: 'tokentune' (LoRA, or the base weights with lora_r=0, through a subset of tokens), "
            "'slimfit' (LoRA or the base weights, a changing fraction frozen at each step), 'lora', or 'full' (every "
            "base weight).",
            "flag": {"help": "What trains."},
        },
    )
    lora_r: int | None = field(
        default=None,
        metadata={
            "help": f"LoRA rank (0 to {MAX_LORA_R}); 0 with tokentune or slimfit trains the base weights. None: "
            f"{DEFAULT_LORA_R}, or 0 with 'full' (the only rank it takes).",
            "flag": {
                "help": f"LoRA rank (default {DEFAULT_LORA_R}); 0 with tokentune or slimfit trains the base weights. "
                "Not with --method full."
            },
        },
    )
    lora_alpha: float | None = field(
        default=None,
        metadata={
            "help": "LoRA alpha, a finite float > 0. None: 2 * lora_r.",
            "flag": {"help": "LoRA alpha (default 2 * --lora-r)."},
        },
    )
    lora_target_modules: str | tuple[str, ...] | None = field(
        default=ALL_LINEAR,
        metadata={
            "help": "The modules LoRA adapts: 'all-linear', module names (a tuple), one regex (a string) or None "
            "(PEFT's default for the model type).",
            "flag": {
                "help": "Comma-separated module names LoRA adapts, or `all-linear` (the default).",
                "default": None,
            },
        },
    )
    token_ratio: float | None = field(
        default=None,
        metadata={
            "help": f"tokentune, slimfit: fraction in (0, 1] of each sequence's tokens that get gradients, at most "
            f"(the memory budget). None: {DEFAULT_TOKEN_RATIO} with tokentune, every token with slimfit.",
            "flag": {
                "help": "tokentune, slimfit: the most of each sequence's tokens that get gradients, as a fraction "
                f"(tokentune default {DEFAULT_TOKEN_RATIO}; slimfit: none, all tokens, unless given)."
            },
        },
    )
    prompt_ratio: float | None = field(
        default=None,
        metadata={
            "help": f"With selection {LABEL_FIRST!r}: fraction in [0, 1] of each sequence's unlabelled tokens (the "
            "prompt) that get gradients beside every labelled one, within the token ratio. None: "
            f"{DEFAULT_PROMPT_RATIO}.",
            "flag": {
                "help": f"tokentune, slimfit with selection {LABEL_FIRST!r}: share of the prompt's tokens that get "
                f"gradients beside every answer token, within --token-ratio (default {DEFAULT_PROMPT_RATIO}; 1: fill "
                "--token-ratio)."
            },
        },
    )
    selection: str | None = field(
        default=None,
        metadata={
            "help": f"With a token ratio: which tokens, one of {SELECTION_RULES}. None: {LABEL_FIRST!r} (the "
            "labelled answer tokens first, then the rest at random).",
            "flag": {
                "help": f"tokentune, slimfit with --token-ratio: which tokens (default {LABEL_FIRST!r}: the labelled "
                "answer tokens first, then the rest at random)."
            },
        },
    )
    freeze_ratio: float | None = field(
        default=None,
        metadata={
            "help": f"slimfit: fraction in [0, 1) of units frozen at each step. None: "
            f"{SLIMFIT_DEFAULTS.freeze_ratio} (SlimFitConfig's default).",
            "flag": {
                "help": f"slimfit: fraction of units frozen at each step (default {SLIMFIT_DEFAULTS.freeze_ratio})."
            },
        },
    )
    catch_up: str | None = field(
        default=None,
        metadata={
            "help": f"slimfit: how far a unit moves when it trains after missed steps, one of {CATCH_UP}. None: "
            f"{SLIMFIT_DEFAULTS.catch_up!r} (SlimFitConfig's default).",
            "flag": {
                "help": f"slimfit: how far a unit moves when it trains after missed steps (default "
                f"{SLIMFIT_DEFAULTS.catch_up!r}; 'none': the paper's update)."
            },
        },
    )
    compression_bits: int | str | None = field(
        default=None,
        metadata={
            "help": "Bits the saved activations are stored in: 8, 4 or 2; 'none': exact (slimfit: its own "
            "compression off). None: the method's default (slimfit's own recipe, exact for the others).",
            "flag": {
                "help": "Store saved activations in this many bits (none: exact). Default: slimfit's own recipe "
                "(4-bit GELU/SiLU inputs, 8-bit elsewhere), none for the other methods."
            },
        },
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "Recompute each layer in backward (transformers' non-reentrant checkpointing)."},
    )

    def __post_init__(self):
        checked = {
            "method": check_choice("Recipe.method", self.method, METHODS),
            "lora_r": check_int("Recipe.lora_r", self.lora_r, 0, MAX_LORA_R, optional=True),
            "lora_alpha": check_float("Recipe.lora_alpha", self.lora_alpha, 0.0, low_open=True, optional=True),
            "lora_target_modules": check_names("Recipe.lora_target_modules", self.lora_target_modules),
            # the ranges of the configs' own fields, with None allowed: the method's default
            "token_ratio": check_float("Recipe.token_ratio", self.token_ratio, 0.0, 1.0, low_open=True, optional=True),
            "selection": check_choice("Recipe.selection", self.selection, SELECTION_RULES, optional=True),
            "prompt_ratio": check_float("Recipe.prompt_ratio", self.prompt_ratio, 0.0, 1.0, optional=True),
            "freeze_ratio": check_float(
                "Recipe.freeze_ratio", self.freeze_ratio, 0.0, 1.0, high_open=True, optional=True
            ),
            "catch_up": check_choice("Recipe.catch_up", self.catch_up, CATCH_UP, optional=True),
            "compression_bits": check_choice(
                "Recipe.compression_bits", self.compression_bits, COMPRESSION_BITS, optional=True
            ),
            "gradient_checkpointing": check_bool("Recipe.gradient_checkpointing", self.gradient_checkpointing),
        }
        if self.lora_alpha is not None and isinstance(self.lora_alpha, numbers.Integral):
            checked["lora_alpha"] = int(self.lora_alpha)  # an int stays an int, as PEFT writes LoRA's lora_alpha
        for name, value in checked.items():
            object.__setattr__(self, name, tuple(value) if isinstance(value, list) else value)
        self._check()
        defaults = {"lora_r": 0 if self.method == "full" else DEFAULT_LORA_R}  # the method's, for the fields left None
        if self.method == "tokentune":
            defaults["token_ratio"] = DEFAULT_TOKEN_RATIO
        if self.selects:
            defaults["selection"] = LABEL_FIRST
            if self.selection in (None, LABEL_FIRST):
                defaults["prompt_ratio"] = DEFAULT_PROMPT_RATIO
        if self.method == "slimfit":
            defaults |= {"freeze_ratio": SLIMFIT_DEFAULTS.freeze_ratio, "catch_up": SLIMFIT_DEFAULTS.catch_up}
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)

    def _check(self) -> None:
        method = self.method
        if self.token_ratio is not None and method not in SELECTING:
            raise ValueError(f"Recipe.token_ratio applies to method 'tokentune' or 'slimfit', not {method!r}.")
        if self.selection is not None and not self.selects:
            raise ValueError(
                "Recipe.selection needs token selection: method 'tokentune', or 'slimfit' with a token_ratio."
            )
        if self.prompt_ratio is not None and (not self.selects or self.selection not in (None, LABEL_FIRST)):
            raise ValueError(
                f"Recipe.prompt_ratio applies to selection {LABEL_FIRST!r} (method 'tokentune', or 'slimfit' with a "
                f"token_ratio), not method {method!r} with selection {self.selection!r}."
            )
        for name in ("freeze_ratio", "catch_up"):
            if getattr(self, name) is not None and method != "slimfit":
                raise ValueError(f"Recipe.{name} applies to method 'slimfit' only, not {method!r}.")
        if method == "full" and self.lora_r:
            raise ValueError(
                f"Recipe.lora_r must be 0 or None with method 'full' (it trains every base weight), got {self.lora_r}."
            )
        if method == "lora" and self.lora_r == 0:
            raise ValueError("Recipe.lora_r=0 with method 'lora' trains nothing; use method 'full'.")
        if not self.uses_lora:
            for name, default in (("lora_alpha", None), ("lora_target_modules", ALL_LINEAR)):
                if getattr(self, name) != default:
                    raise ValueError(f"Recipe.{name} needs LoRA (lora_r > 0), not method {method!r} with lora_r 0.")

    @property
    def selects(self) -> bool:
        return self.method == "tokentune" or (self.method == "slimfit" and self.token_ratio is not None)

    @property
    def uses_lora(self) -> bool:
        return self.method != "full" and self.lora_r != 0

    # ------------------------------------------------------------------------------------------------ configs
    def lora_config(self, task_type: str | None = "CAUSAL_LM"):
        """The recipe's ``LoraConfig`` (rank ``DEFAULT_LORA_R`` where it trains none: the LoRA compared with)."""
        r = self.lora_r or DEFAULT_LORA_R
        targets = self.lora_target_modules
        targets = list(targets) if isinstance(targets, tuple) else targets
        alpha = self.lora_alpha if self.lora_alpha is not None else 2 * r
        return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, task_type=task_type)

    def activation_compression(self):
        """The ``ActivationCompressionConfig`` of ``compression_bits``, or None (exact, or the method's default)."""
        if self.compression_bits in (None, "none"):
            return None
        return ActivationCompressionConfig(bits=self.compression_bits)

    def apply(self, model: nn.Module, seed: int | None = None) -> tuple[nn.Module, MethodTransform | None]:
        """:func:`trainable` of ``to_peft_config``'s config ('lora' and 'full' train compressed only inside
        ``compress_activations(recipe.activation_compression())``)."""
        return trainable(model, self.to_peft_config(seed=seed))

    def to_peft_config(self, seed: int | None = None, task_type: str | None = "CAUSAL_LM"):
        """The config that trains this recipe (without ``lora`` where ``lora_r`` is 0; None for 'full'); ``seed``: of
        the token selection and SlimFit's order (None: the defaults)."""
        if self.method == "full":
            return None
        if self.method == "lora":
            return self.lora_config(task_type)
        seeded = {} if seed is None else {"seed": seed}
        common = {"task_type": task_type, "lora": self.lora_config(task_type) if self.uses_lora else None, **seeded}
        if self.method == "tokentune" or self.compression_bits is not None:  # None: SlimFit's own default
            common["activation_compression"] = self.activation_compression()
        selecting = {"token_ratio": self.token_ratio, "selection": self.selection, "prompt_ratio": self.prompt_ratio}
        if self.method == "tokentune":
            return TokenTuneConfig(**common, **selecting)
        selection = TokenSelectionConfig(**selecting, **seeded) if self.token_ratio is not None else None
        freezing = {"freeze_ratio": self.freeze_ratio, "catch_up": self.catch_up}
        return SlimFitConfig(**common, **freezing, token_selection=selection)

    # ------------------------------------------------------------------------------------------- command line
    @classmethod
    def from_train_args(cls, args) -> Recipe:
        """The recipe of parsed ``peft-slim train`` arguments (``argparse.Namespace``)."""
        values = {spec.name: getattr(args, spec.name) for spec in dataclasses.fields(cls)}  # one flag per field
        targets, bits = values["lora_target_modules"] or ALL_LINEAR, values["compression_bits"]
        if targets != ALL_LINEAR:
            targets = tuple(name.strip() for name in targets.split(",") if name.strip())
        values["compression_bits"] = bits if bits in (None, "none") else int(bits)
        values["gradient_checkpointing"] = bool(values["gradient_checkpointing"])
        return cls(**values | {"lora_target_modules": targets})

    def to_flags(self) -> list[str]:
        """The ``peft-slim train`` flags that give this recipe back; a field at its default is left out."""
        flags = ["--method", self.method]
        if self.method != "full":
            flags += ["--lora-r", str(self.lora_r)]
        if self.lora_alpha is not None:
            flags += ["--lora-alpha", _number(self.lora_alpha)]
        targets = self.lora_target_modules
        if targets != ALL_LINEAR:
            named = isinstance(targets, tuple) and targets != (ALL_LINEAR,)
            if not named or any("," in name or name != name.strip() for name in targets):
                raise ValueError(
                    f"Recipe.lora_target_modules={targets!r} has no flag: --lora-target-modules takes all-linear or "
                    "comma-separated names."
                )
            flags += ["--lora-target-modules", ",".join(targets)]
        defaults = {"selection": LABEL_FIRST, "prompt_ratio": DEFAULT_PROMPT_RATIO}
        defaults["catch_up"] = SLIMFIT_DEFAULTS.catch_up
        for name in ("token_ratio", "selection", "prompt_ratio", "freeze_ratio", "catch_up", "compression_bits"):
            value = getattr(self, name)
            if value is not None and value != defaults.get(name):
                flags += ["--" + name.replace("_", "-"), value if isinstance(value, str) else _number(value)]
        if self.gradient_checkpointing:
            flags.append("--gradient-checkpointing")
        return flags

    @property
    def key(self) -> dict[str, Any]:
        """What decides how the recipe trains, not the LoRA's size nor the prompt ratio (the evidence names those it
        was measured with): the key of ``planner/measured.json``."""
        names = ("method", "token_ratio", "selection", "compression_bits", "freeze_ratio", "catch_up")
        key = {name: getattr(self, name) for name in names}  # freeze_ratio, catch_up: None but with slimfit
        bits, own = self.compression_bits, "slimfit default" if self.method == "slimfit" else None
        key["compression_bits"] = {None: own, "none": None}.get(bits, bits)
        return key | {"gradient_checkpointing": self.gradient_checkpointing, "trains_lora": self.uses_lora}


def trainable(model: nn.Module, config: PeftConfig | None) -> tuple[nn.Module, MethodTransform | None]:
    """``model`` ready to train with ``config`` and the transform handle if any: ``get_peft_model``'s PeftModel; for a
    method's config without ``lora``, ``model`` with the method's transform; for None, ``model`` all trainable."""
    if config is None:
        return model.requires_grad_(True), None
    if isinstance(config, MethodConfig) and config.lora is None:
        transform = slimfit_ if isinstance(config, SlimFitConfig) else tokentune_
        return model, transform(model, config)
    return get_peft_model(model, config), None


def _number(value: float) -> str:
    """``value`` as a flag: its shortest form (``0.3``, ``1``) where that reads back as the same float."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)
