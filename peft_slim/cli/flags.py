"""Command-line flags from dataclass fields: each flag's name, default, help and accepted values defined once, on
the field, and checked by the field's own check (one range, one message, for API and shell)."""

from __future__ import annotations

import argparse
import dataclasses


def checked(check, flag: str, convert=int):
    """An argparse ``type``: ``convert(text)`` then ``check(flag, value)``; a failure is argparse's usage error."""

    def parse(text: str):
        try:
            value = convert(text)
        except (ValueError, OverflowError):
            value = text
        try:
            return check(flag, value)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = flag  # argparse names the type in some messages
    return parse


def add_fields(parser: argparse.ArgumentParser, config: type) -> None:
    """One flag per field of the dataclass ``config`` (``lora_r``: ``--lora-r``): help and default from the field
    (none: required), or its metadata's ``"flag"`` dict; a ``bool`` a switch; else the metadata's ``"parse"`` (an
    argparse type), ``"choices"`` or ``"check"`` (of the number the text gives), else the text."""
    for spec in dataclasses.fields(config):
        flag = "--" + spec.name.replace("_", "-")
        override = spec.metadata.get("flag", {})
        options = {"help": override.get("help", spec.metadata["help"])}
        if "default" in override or spec.default is not dataclasses.MISSING:
            options["default"] = override.get("default", spec.default)
        else:
            options["required"] = True
        if "parse" in spec.metadata:
            options["type"] = spec.metadata["parse"]
        elif spec.type in ("bool", bool):
            options["action"] = "store_true" if options["default"] is False else argparse.BooleanOptionalAction
        elif "choices" in spec.metadata:
            options["choices"] = tuple(str(choice) for choice in spec.metadata["choices"])
        elif "check" in spec.metadata:
            convert = float if "float" in str(spec.type) else int
            options["type"] = checked(spec.metadata["check"], flag, convert)
        parser.add_argument(flag, **options)
