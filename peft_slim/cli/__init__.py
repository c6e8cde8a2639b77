"""The ``peft-slim`` command: one module per subcommand (``train`` parses with TRL's parser, ``plan`` with a
sub-parser)."""

from __future__ import annotations

import argparse
import importlib
import sys


def _module(name: str):
    return importlib.import_module(f"{__name__}.{name}")


class CommandParser(argparse.ArgumentParser):
    """The top-level parser; ``train``'s flags are parsed by its own parser (``train.parse_flags``)."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        if args[:1] != ["train"]:
            return super().parse_known_args(args, namespace)
        parsed = _module("train").parse_flags(args[1:])
        parsed.command, parsed._run = "train", None
        return parsed, []


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="peft-slim",
        description="Memory-lean fine-tuning (TokenTune, SlimFit, activation compression) inside PEFT.",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"peft-slim {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("train", help=_module("train").HELP, add_help=False)
    plan = _module("plan")
    sub = commands.add_parser("plan", help=plan.HELP, description=plan.HELP)
    plan.add_arguments(sub)
    sub.set_defaults(_run=plan.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        return int(_module("train").main(argv[1:]) or 0)
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
