"""The README's quickstart runs as written."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _quickstart() -> str:
    text = README.read_text()
    section = text.split("## Quickstart", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_quickstart_runs_as_written(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(_quickstart())
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "selected tokens per row: [13, 13, 13, 13]" in result.stdout
    assert (tmp_path / "tokentune-adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "plain-lora-adapter" / "adapter_config.json").is_file()
