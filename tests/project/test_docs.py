"""The README and docs/*.md as users read them: every Python block runs as written (offline), every
`peft-slim` command line in a shell block parses, and the generated pages equal their generators' output.

A block whose info string says ``python no-run: <why>`` is skipped with that reason (a GPU-only example, say).
"""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```", re.S | re.M)


def _blocks(language: str) -> list:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) == language:
                line = text.count("\n", 0, match.start()) + 1
                name = f"{page.relative_to(ROOT)}:{line}"
                found.append(pytest.param(match.group(2).strip(), match.group(3), id=name))
    return found


def test_every_page_has_a_runnable_block_or_none_to_run():
    assert _blocks("python"), "no Python blocks found: the fence pattern broke"


def _readme_quickstart() -> str:
    section = (ROOT / "README.md").read_text().split("## Quickstart", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_quickstart_runs_as_a_script(tmp_path):
    """As a user pastes it into a file: a fresh interpreter, nothing imported before."""
    script = tmp_path / "quickstart.py"
    script.write_text(_readme_quickstart())
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "selected tokens per row: [32, 32, 32, 32]" in result.stdout  # every position labelled: at most half of 64
    assert (tmp_path / "tokentune-adapter" / "adapter_model.safetensors").is_file()
    config = json.loads((tmp_path / "tokentune-adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"  # what the README says it writes
    assert (tmp_path / "tokentune-adapter" / "peft_slim_config.json").is_file()


# What some blocks must leave behind, beyond running without an error (keyed by the block's first line of code).
CHECKS = {
    "import importlib.util": lambda ns, cwd: (
        ns["trainer"].state.global_step == 4
        and type(ns["trainer"].model.base_model).__name__ == "TokenTuneModel"
        and (cwd / "sft-tokentune" / "adapter_model.safetensors").is_file()
    ),
}


@pytest.mark.parametrize("info, code", _blocks("python"))
def test_python_block_runs(info, code, tmp_path, monkeypatch):
    if info.startswith("no-run"):
        reason = info.removeprefix("no-run").lstrip(":").strip()
        assert reason, "a no-run block must say why it does not run (```python no-run: <why>)"
        pytest.skip(reason)
    assert not info, f"unknown info string {info!r}: use ```python or ```python no-run: <why>"
    if code == _readme_quickstart():
        pytest.skip("run as a script by test_readme_quickstart_runs_as_a_script")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    exec(compile(code, "<docs block>", "exec"), namespace)
    check = CHECKS.get(code.splitlines()[0])
    assert check is None or check(namespace, tmp_path)


def _command_lines(code: str) -> list[list[str]]:
    lines = []
    for line in code.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip()
        if line.startswith("peft-slim "):
            lines.append(shlex.split(line)[1:])
    return lines


@pytest.mark.parametrize("info, code", _blocks("bash"))
def test_peft_slim_command_lines_parse(info, code):
    """Every flag a page shows exists and takes the value shown (parsed only: the commands need data or the hub)."""
    from peft_slim.cli import build_parser

    parser = build_parser()
    for argv in _command_lines(code):
        if "--help" in argv:
            continue
        # An unknown flag or a bad value exits (SystemExit) or raises; train's parse applies the per-method rules.
        parser.parse_args(argv)


def test_configuration_reference_is_generated():
    sys.path.insert(0, str(ROOT / "tools"))
    import build_config_reference

    assert (ROOT / "docs" / "configuration.md").read_text() == build_config_reference.render(), (
        "docs/configuration.md is out of date: run python tools/build_config_reference.py"
    )


def test_benchmark_pages_are_generated_from_the_results():
    sys.path.insert(0, str(ROOT / "tools"))
    import build_benchmarks_page

    assert (ROOT / "docs" / "benchmarks.md").read_text() == build_benchmarks_page.render_page(), (
        "docs/benchmarks.md is out of date: run python tools/build_benchmarks_page.py"
    )
    readme = (ROOT / "README.md").read_text()
    assert readme == build_benchmarks_page.readme_with_table(readme), (
        "README.md's results table is out of date: run python tools/build_benchmarks_page.py"
    )


def test_sft_results_file_is_what_its_data_gives():
    """sft.md (and so the README's table) is the benchmark's own rendering of sft.json."""
    sys.path.insert(0, str(ROOT))
    import json

    from benchmarks.reports import sft_markdown as markdown

    report = json.loads((ROOT / "benchmarks" / "results" / "sft.json").read_text())
    assert (ROOT / "benchmarks" / "results" / "sft.md").read_text().rstrip("\n") == markdown(report)


def test_budget_results_file_is_what_its_data_gives():
    """budget.md is the equal-budget benchmark's own rendering of budget.json."""
    sys.path.insert(0, str(ROOT))
    import json

    from benchmarks.reports import budget_markdown as markdown

    folder = ROOT / "benchmarks" / "results" / "budget"
    report = json.loads((folder / "budget.json").read_text())
    assert (folder / "budget.md").read_text().rstrip("\n") == markdown(report)


def test_links_between_pages_resolve():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if target.startswith("http"):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to a missing {target}"


# The pages a newcomer reads first: at most this many lines, and a runnable example on the first screen.
FIRST_PAGES = {"README.md": 150, "docs/tokentune.md": 163, "docs/slimfit.md": 200}


@pytest.mark.parametrize("name", FIRST_PAGES)
def test_first_pages_lead_with_a_run_and_stay_short(name):
    text = (ROOT / name).read_text()
    assert len(text.splitlines()) <= FIRST_PAGES[name], "move detail into docs/ (benchmark tables: benchmarks.md)"
    assert text.count("\n", 0, text.index("```python")) < 50, "the first Python example must come before line 50"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_no_development_journal(page):
    """Users read what the code does and what was measured, not which issue or commit it came from."""
    text = page.read_text()
    assert not re.findall(r"\b(?:issue|PR) #?\d+", text, re.I)
    assert not re.findall(r"\bcommit [0-9a-f]{7,40}\b", text)
    assert not re.findall(r"\b(?:previous|this|that) session\b", text, re.I)
