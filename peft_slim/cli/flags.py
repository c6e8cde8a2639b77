"""Command-line values checked by the config path's field checks: one range, one message, for API and shell."""

from __future__ import annotations

import argparse
import dataclasses
import math

from ..configuration import Check, Integer, Real
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


def integer(flag: str, low: int, high: int):
    return checked(Integer(low, high), flag)


def positive_float(flag: str, high: float = math.inf):
    """A finite float > 0 (and <= ``high``): 'inf' and 'nan' are refused."""
    return checked(Real(0.0, high, low_open=True, high_open=math.isinf(high)), flag, float)


def fraction(flag: str, low_open: bool):
    return checked(Real(0.0, 1.0, low_open=low_open, high_open=not low_open), flag, float)


def field_check(config: type, name: str, flag: str, convert=int):
    """An argparse ``type`` from ``config``'s field ``name``: the field's own check (its range and message), given
    as ``flag``."""
    check = config.__dataclass_fields__[name].metadata["check"]
    return checked(dataclasses.replace(check, optional=False), flag, convert)
