"""Which tokens receive gradients: the selection fields every method that trains on a token subset shares."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..configuration import check_bool, check_choice, check_float, check_int

SELECTION_RULES = ("random", "answer")
DEFAULT_TOKEN_RATIO = 0.5
DEFAULT_PROMPT_RATIO = 0.3
EARLIER_PROMPT_RATIO = 1.0  # the rule of configs saved before `prompt_ratio` existed: fill the whole budget
MAX_NUM_TOKENS = 2**31 - 1  # `num_tokens`: more than any sequence holds; keeps the count an int32/int64 everywhere
MAX_SEED = 2**62  # the generator is seeded with seed + rank, which must stay a valid 64-bit seed


@dataclass
class TokenSelectionConfig:
    """How many positions of each sequence receive gradients, and which.

    Give at most one of `token_ratio` or `num_tokens` (neither means `token_ratio=0.5`): the most positions of a
    sequence that receive gradients, which sets the memory. Under `selection="answer"` a sequence trains every
    labelled position and `prompt_ratio` of its other tokens, within that budget. The positions the head reads (see
    `peft_slim.token_selection.heads`), the first real token and a decoder LM's last real token are always selected;
    padding only where the head reads it. Used as TokenTune's selection fields and as
    `SlimFitConfig.token_selection`.
    """

    token_ratio: float | None = field(
        default=None,
        metadata={
            "help": f"Fraction in (0, 1] of each sequence's real tokens that receive gradients, at most (the memory "
            f"budget; `selection='answer'` may train fewer, see `prompt_ratio`). None: {DEFAULT_TOKEN_RATIO} unless "
            "`num_tokens` is given."
        },
    )
    num_tokens: int | None = field(
        default=None,
        metadata={
            "help": f"Absolute number (1 to {MAX_NUM_TOKENS}) of tokens per sequence that receive gradients, at most "
            "(instead of `token_ratio`)."
        },
    )
    prompt_ratio: float | None = field(
        default=None,
        metadata={
            "help": "`selection='answer'` with labels: fraction in [0, 1] of each sequence's unlabelled real tokens "
            "(the prompt) that receive gradients beside every labelled one, within the `token_ratio` / `num_tokens` "
            "budget (labelled ones first where it is short). 1.0 fills the budget with prompt tokens (the rule "
            f"before this field existed). None: {DEFAULT_PROMPT_RATIO} with 'answer'; must be None with 'random'."
        },
    )
    selection: str = field(
        default="answer",
        metadata={
            "help": "'answer' (default): every position whose prediction carries a loss label (a causal LM's position "
            "t when labels[t+1] != -100: the completion, or the assistant turns, of SFT data) and `prompt_ratio` of "
            "the other real tokens (the prompt), uniformly; where that exceeds the budget, the labelled positions "
            "first (uniformly among them), then the prompt's. Without labels, the same as 'random'. 'random': "
            "uniform per sequence, redrawn every forward (the paper). The positions the head reads, the first real "
            "token and a decoder LM's last real token are always selected and count toward the budget; padding only "
            "where the head reads it.",
        },
    )
    seed: int | None = field(
        default=None,
        metadata={
            "help": f"Seed (0 to {MAX_SEED}) of the selection generator, for reproducible selections; each process "
            "of a distributed run adds its rank. None: a fresh seed."
        },
    )
    chunked_loss: bool = field(
        default=True,
        metadata={
            "help": "Causal LMs: compute the LM head and loss over the selected positions a chunk of rows at a time, "
            "recomputed in backward, so that their full-vocabulary logits are never kept (same loss and gradient). "
            "The training forward then returns `logits=None` when it computes the loss. False: materialise the "
            "selected positions' logits and return them."
        },
    )

    def __post_init__(self):
        check_selection(self)

    def selection_config(self) -> TokenSelectionConfig:
        """The selection fields alone (a subclass such as TokenTuneConfig carries more)."""
        return TokenSelectionConfig(**{spec.name: getattr(self, spec.name) for spec in fields(TokenSelectionConfig)})

    def to_dict(self) -> dict:
        return {spec.name: getattr(self, spec.name) for spec in fields(self)}


def check_selection(config) -> None:
    """Check (and coerce) the selection fields of ``config``: a TokenSelectionConfig, or a config that has its
    fields (TokenTuneConfig calls it from its own ``__post_init__``)."""
    name = type(config).__name__
    config.token_ratio = check_float(f"{name}.token_ratio", config.token_ratio, 0.0, 1.0, low_open=True, optional=True)
    config.num_tokens = check_int(f"{name}.num_tokens", config.num_tokens, 1, MAX_NUM_TOKENS, optional=True)
    config.selection = check_choice(f"{name}.selection", config.selection, SELECTION_RULES)
    config.prompt_ratio = check_float(f"{name}.prompt_ratio", config.prompt_ratio, 0.0, 1.0, optional=True)
    if config.selection == "random" and config.prompt_ratio is not None:
        raise ValueError(
            f"{name}.prompt_ratio applies to selection='answer' only (got {config.prompt_ratio!r} with "
            "selection='random'); leave it None."
        )
    config.seed = check_int(f"{name}.seed", config.seed, 0, MAX_SEED, optional=True)
    config.chunked_loss = check_bool(f"{name}.chunked_loss", config.chunked_loss)
    if config.token_ratio is not None and config.num_tokens is not None:
        raise ValueError(
            f"{name}: give exactly one of `token_ratio` or `num_tokens`, not both "
            f"(got token_ratio={config.token_ratio!r}, num_tokens={config.num_tokens!r})."
        )
    if config.token_ratio is None and config.num_tokens is None:
        config.token_ratio = DEFAULT_TOKEN_RATIO
    if config.selection == "answer" and config.prompt_ratio is None:
        config.prompt_ratio = DEFAULT_PROMPT_RATIO


def saved_selection(values: dict) -> dict:
    """The selection fields of a saved config: one saved before `prompt_ratio` existed keeps the rule it trained
    with (the budget filled with prompt tokens), so a resumed run selects as before."""
    if values.get("selection", "answer") == "answer" and "prompt_ratio" not in values:
        return values | {"prompt_ratio": EARLIER_PROMPT_RATIO}
    return values
