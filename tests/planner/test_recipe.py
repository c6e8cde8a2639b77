"""``Recipe``: one training setting. Its flags give it back, and the configs and measured-table keys it builds are
those the command line and the planner define (written out here from their definitions, not from the recipe)."""

from __future__ import annotations

import argparse
import json
import math
import pathlib

import pytest
from helpers.planner_cases import checked_train_args
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig

from peft_slim import SlimFitConfig, TokenSelectionConfig, TokenTuneConfig
from peft_slim.compression import ActivationCompressionConfig
from peft_slim.planner.plan import Candidate, ladder
from peft_slim.recipe import MAX_LORA_R, Recipe
from peft_slim.slimfit.config import CATCH_UP
from peft_slim.token_selection.config import SELECTION_RULES

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAMES = st.from_regex(r"[a-z_][a-z0-9_.]{0,8}", fullmatch=True)
COMPRESSION = st.sampled_from([None, "none", 8, 4, 2])


@st.composite
def recipes(draw) -> Recipe:
    method = draw(st.sampled_from(["tokentune", "slimfit", "lora", "full"]))
    fields = {"method": method, "compression_bits": draw(COMPRESSION)}
    fields["gradient_checkpointing"] = draw(st.booleans())
    if method == "full":
        fields["lora_r"] = draw(st.sampled_from([None, 0]))
    else:
        fields["lora_r"] = draw(st.one_of(st.none(), st.integers(0 if method != "lora" else 1, MAX_LORA_R)))
    if method != "full" and fields["lora_r"] != 0:
        fields["lora_alpha"] = draw(st.none() | st.floats(0.0, exclude_min=True, allow_infinity=False))
        fields["lora_target_modules"] = draw(
            st.just("all-linear") | st.lists(NAMES, min_size=1, max_size=3).map(tuple)
        )
    if method in ("tokentune", "slimfit"):
        fields["token_ratio"] = draw(st.none() | st.floats(0.0, 1.0, exclude_min=True))
        if method == "tokentune" or fields["token_ratio"] is not None:
            fields["selection"] = draw(st.none() | st.sampled_from(SELECTION_RULES))
            if fields["selection"] in (None, "answer"):
                fields["prompt_ratio"] = draw(st.none() | st.floats(0.0, 1.0))
    if method == "slimfit":
        fields["freeze_ratio"] = draw(st.none() | st.floats(0.0, 1.0, exclude_max=True))
        fields["catch_up"] = draw(st.none() | st.sampled_from(CATCH_UP))
    return Recipe(**fields)


# ------------------------------------------------------------------------------- the definitions, written out
def train_config(args: argparse.Namespace):
    """The config ``peft-slim train`` builds from checked flags, as docs/command-line.md defines it: LoRA of rank
    --lora-r, alpha --lora-alpha (2 r), no dropout, on --lora-target-modules (all-linear, or the comma-separated
    names); TokenTune's or SlimFit's own fields from their flags, seeded with --seed; compression from
    --compression-bits (none: exact; SlimFit's own recipe when not given)."""
    lora = None
    if args.method != "full" and args.lora_r:
        targets = args.lora_target_modules or "all-linear"
        if targets != "all-linear":
            targets = [name.strip() for name in targets.split(",") if name.strip()]
        alpha = 2 * args.lora_r if args.lora_alpha is None else args.lora_alpha
        lora = LoraConfig(
            r=args.lora_r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM"
        )
    bits = args.compression_bits
    compression = None if bits in (None, "none") else ActivationCompressionConfig(bits=int(bits))
    if args.method == "lora":
        return lora
    if args.method == "full":
        return None
    if args.method == "tokentune":
        return TokenTuneConfig(
            task_type="CAUSAL_LM",
            token_ratio=args.token_ratio,
            selection=args.selection,
            prompt_ratio=args.prompt_ratio,
            seed=args.seed,
            lora=lora,
            activation_compression=compression,
        )
    selection = None
    if args.token_ratio is not None:
        selection = TokenSelectionConfig(
            token_ratio=args.token_ratio, selection=args.selection, prompt_ratio=args.prompt_ratio, seed=args.seed
        )
    own = {} if bits is None else {"activation_compression": compression}
    return SlimFitConfig(
        task_type="CAUSAL_LM",
        freeze_ratio=args.freeze_ratio,
        catch_up=args.catch_up,
        seed=args.seed,
        lora=lora,
        token_selection=selection,
        **own,
    )


def measured_key(args: argparse.Namespace) -> dict:
    """The key of a setting in planner/measured.json: what decides how it trains, not the LoRA's size nor the prompt
    ratio (docs/planner.md: the evidence names those it was measured with)."""
    slimfit = args.method == "slimfit"
    bits = args.compression_bits
    if bits is None:
        compression = "slimfit default" if slimfit else None
    elif bits == "none":
        compression = None
    else:
        compression = int(bits)
    return {
        "method": args.method,
        "token_ratio": args.token_ratio,
        "selection": args.selection,
        "compression_bits": compression,
        "freeze_ratio": args.freeze_ratio if slimfit else None,
        "catch_up": args.catch_up if slimfit else None,
        "gradient_checkpointing": bool(args.gradient_checkpointing),
        "trains_lora": bool(args.lora_r) if args.method != "full" else False,
    }


def planner_config(candidate: Candidate, task_type, target_modules):
    """A planner setting's config, as docs/planner.md defines it: LoRA of rank r, alpha 2 r; TokenTune with the
    ratio and compression; SlimFit with the freeze ratio and its default compression."""
    lora = LoraConfig(
        r=candidate.lora_r, lora_alpha=2 * candidate.lora_r, target_modules=target_modules, task_type=task_type
    )
    bits = candidate.compression_bits
    if candidate.method == "lora":
        return lora
    if candidate.method == "tokentune":
        compression = None if bits is None else {"bits": bits}
        return TokenTuneConfig(
            task_type=task_type, token_ratio=candidate.token_ratio, lora=lora, activation_compression=compression
        )
    return SlimFitConfig(task_type=task_type, freeze_ratio=candidate.freeze_ratio, lora=lora)


# --------------------------------------------------------------------------------------------------- tests
@settings(max_examples=150, deadline=None)
@given(recipe=recipes(), seed=st.integers(0, 2**32 - 1))
def test_the_flags_give_the_recipe_back_and_build_the_commands_config(recipe, seed):
    args = checked_train_args([*recipe.to_flags(), "--seed", str(seed)])
    assert Recipe.from_train_args(args) == recipe
    assert recipe.to_peft_config(seed=seed) == train_config(args)
    assert recipe.key == measured_key(args)


@pytest.mark.parametrize("flags", [[], ["--method", "slimfit"], ["--method", "lora"], ["--method", "full"]])
def test_the_methods_defaults_are_filled_in_once(flags):
    args = checked_train_args(flags)
    recipe = Recipe.from_train_args(args)
    assert recipe == Recipe(method=args.method)
    assert (recipe.token_ratio, recipe.selection, recipe.prompt_ratio) == (
        args.token_ratio,
        args.selection,
        args.prompt_ratio,
    )
    assert (recipe.freeze_ratio, recipe.catch_up) == (args.freeze_ratio, args.catch_up)


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"], None])
@pytest.mark.parametrize("task_type", ["CAUSAL_LM", "SEQ_CLS", None])
def test_a_planner_setting_builds_its_config_and_key(targets, task_type):
    candidates = ladder(8, 0.05)
    candidates += [Candidate(**{**c.__dict__, "gradient_checkpointing": True}) for c in candidates]
    for candidate in candidates:
        assert candidate.peft_config(task_type, targets) == planner_config(candidate, task_type, targets)
        line = [*candidate.recipe.to_flags(), "--lora-target-modules", "all-linear"]
        assert candidate.recipe.key == measured_key(checked_train_args(line)), candidate.name


def test_the_measured_tables_keys_read_back():
    data = json.loads((ROOT / "peft_slim" / "planner" / "measured.json").read_text())
    for name, method in data["methods"].items():
        assert Recipe.from_train_args(checked_train_args(method["flags"])).key == method["setting"], name


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"method": "lora", "token_ratio": 0.3}, "Recipe.token_ratio applies to method 'tokentune' or 'slimfit'"),
        ({"method": "slimfit", "selection": "random"}, "Recipe.selection needs token selection"),
        ({"method": "tokentune", "freeze_ratio": 0.5}, "Recipe.freeze_ratio applies to method 'slimfit' only"),
        ({"method": "full", "lora_r": 8}, "Recipe.lora_r must be 0 or None with method 'full'"),
        ({"method": "lora", "lora_r": 0}, "Recipe.lora_r=0 with method 'lora' trains nothing"),
        ({"lora_r": 0, "lora_alpha": 4.0}, "Recipe.lora_alpha needs LoRA"),
        ({"token_ratio": 0.0}, r"Recipe.token_ratio must be a float in \(0, 1\]"),
        ({"prompt_ratio": 1.5}, r"Recipe.prompt_ratio must be a float in \[0, 1\]"),
        ({"selection": "random", "prompt_ratio": 0.3}, "Recipe.prompt_ratio applies to selection 'answer'"),
        ({"method": "slimfit", "prompt_ratio": 0.3}, "Recipe.prompt_ratio applies to selection 'answer'"),
        ({"compression_bits": 3}, "Recipe.compression_bits must be one of"),
        ({"lora_alpha": math.inf}, "Recipe.lora_alpha must be a finite float > 0"),
    ],
)
def test_a_field_that_does_not_apply_or_is_out_of_range_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        Recipe(**fields)


def test_targets_without_a_flag_are_refused_by_to_flags():
    for targets in ("q_proj|v_proj", None, ("all-linear",), ("a,b",)):
        with pytest.raises(ValueError, match="has no flag"):
            Recipe(lora_target_modules=targets).to_flags()
