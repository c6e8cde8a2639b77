"""The ``peft-slim`` command: one entry point, one module per subcommand.

A subcommand module exposes ``HELP`` (one line), and ``main(argv) -> int`` with a parser of its own (``train``:
TRL's) or ``add_arguments(parser)`` and ``run(args) -> int``; adding one is a line in ``SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module under peft_slim.cli
SUBCOMMANDS: dict[str, str] = {"train": "train", "plan": "plan"}


class CommandParser(argparse.ArgumentParser):
    """The top-level parser; a subcommand with a parser of its own parses there (``train``: its ``parse_flags``)."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        module = importlib.import_module(f"{__name__}.{SUBCOMMANDS[args[0]]}") if args[:1] == ["train"] else None
        if module is None:
            return super().parse_known_args(args, namespace)
        parsed = module.parse_flags(args[1:])
        parsed.command, parsed._run = args[0], None
        return parsed, []


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="peft-slim",
        description="Memory-lean fine-tuning (TokenTune, SlimFit, activation compression) inside PEFT.",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"peft-slim {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(f"{__name__}.{module_name}")
        if hasattr(module, "main"):  # parses its own arguments
            commands.add_parser(name, help=module.HELP, add_help=False)
            continue
        sub = commands.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        module = importlib.import_module(f"{__name__}.{SUBCOMMANDS[argv[0]]}")
        if hasattr(module, "main"):
            return int(module.main(argv[1:]) or 0)
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
