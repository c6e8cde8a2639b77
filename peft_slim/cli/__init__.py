"""The ``peft-slim`` command: one entry point, one module per subcommand.

A subcommand module exposes ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``; adding one
is a line in ``SUBCOMMANDS``. Heavy imports wait until a subcommand runs, so ``peft-slim --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module under peft_slim.cli
SUBCOMMANDS: dict[str, str] = {"train": "train", "plan": "plan"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peft-slim",
        description="Memory-lean fine-tuning (TokenTune, SlimFit, activation compression) inside PEFT.",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"peft-slim {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(f"{__name__}.{module_name}")
        sub = commands.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
