"""Writing a benchmark's results: a Markdown table, and the report as ``<stem>.json`` and ``<stem>.md``.

Shared by every benchmark under ``benchmarks/``.
"""

from __future__ import annotations

import json
import os
import re

from peft_slim.configuration import atomic_write_text

# A list of numbers, booleans or short names (no brackets, braces or quotes with spaces inside) on one line.
_SCALAR_LIST = re.compile(r"\[\s+((?:[-\w.+\"]+,\s+)*[-\w.+\"]+)\s+\]")


def dumps(report: dict) -> str:
    """JSON indented by 2, lists of scalars on one line (the runs' losses and SlimFit histories stay readable)."""
    return _SCALAR_LIST.sub(lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", json.dumps(report, indent=2))


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def mib(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:.0f} MiB"


def size(n_bytes: float) -> str:
    """KiB below 1 MiB, MiB below 10 GiB, GiB above."""
    if n_bytes < 2**20:
        return f"{n_bytes / 2**10:.0f} KiB"
    return mib(n_bytes) if n_bytes < 10 * 2**30 else f"{n_bytes / 2**30:.1f} GiB"


def write_report(out: str, stem: str, report: dict, markdown: str) -> None:
    """``<out>/<stem>.json`` (the report) and ``<out>/<stem>.md`` (the Markdown), and print the Markdown."""
    atomic_write_text(os.path.join(out, f"{stem}.json"), dumps(report))
    atomic_write_text(os.path.join(out, f"{stem}.md"), markdown + "\n")
    print(markdown)
