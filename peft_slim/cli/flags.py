"""Command-line flags from dataclass fields: each flag's name, default, help and accepted values defined once, on
the field, and checked by the field's own check (one range, one message, for API and shell)."""

from __future__ import annotations

import argparse
import dataclasses

from ..configuration import Boolean, Check, Integer, OneOf, Real
from ..slimfit.config import MAX_SEED as SLIMFIT_MAX_SEED
from ..token_selection.config import MAX_SEED as SELECTION_MAX_SEED

MAX_STEPS = 10**9  # a billion optimizer steps: beyond any run
MAX_EPOCHS = 10**6
# --seed seeds numpy (transformers.set_seed: below 2**32), the token selection and SlimFit's order: the narrowest of
# the three ranges (the configs' own are wider).
MAX_SEED = min(2**32 - 1, SELECTION_MAX_SEED, SLIMFIT_MAX_SEED)


def checked(check: Check, flag: str, convert=int):
    """An argparse ``type``: ``convert(text)`` then ``check``; either failing is argparse's usage error (exit 2)
    naming ``flag``, what was given and the accepted range."""

    def parse(text: str):
        try:
            value = convert(text)
        except (ValueError, OverflowError):
            value = text
        try:
            return check(value, flag)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = flag  # argparse names the type in some messages
    return parse


def add_fields(parser: argparse.ArgumentParser, config: type, title: str | None = None) -> None:
    """One flag per field of the dataclass ``config`` (``lora_r``: ``--lora-r``), in the argument group ``title``
    (None: the parser's own options).

    Help and default: the metadata's ``"help"`` and the field's default (none: a required flag), or the metadata's
    ``"flag"`` dict where the command line differs. Values: by the metadata's ``"check"`` (``Integer``/``Real``: a
    checked number, exit 2 out of range; ``OneOf``: ``choices``; ``Boolean``: a switch, ``--x`` / ``--no-x`` unless
    the default is False), or its ``"parse"`` (an argparse ``type``), else the text as given.
    """
    group = parser if title is None else parser.add_argument_group(title)
    for spec in dataclasses.fields(config):
        flag = "--" + spec.name.replace("_", "-")
        override = spec.metadata.get("flag", {})
        check = spec.metadata.get("check")
        options = {"help": override.get("help", spec.metadata["help"])}
        if "default" in override or spec.default is not dataclasses.MISSING:
            options["default"] = override.get("default", spec.default)
        else:
            options["required"] = True
        if "parse" in spec.metadata:
            options["type"] = spec.metadata["parse"]
        elif isinstance(check, Boolean):
            options["action"] = "store_true" if options["default"] is False else argparse.BooleanOptionalAction
        elif isinstance(check, OneOf):
            options["choices"] = tuple(str(choice) for choice in check.choices)
        elif isinstance(check, (Integer, Real)):
            exact = dataclasses.replace(check, optional=False)  # a flag given has a value: None is its absence
            options["type"] = checked(exact, flag, int if isinstance(check, Integer) else float)
        group.add_argument(flag, **options)
