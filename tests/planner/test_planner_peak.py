"""The planner's step peak against one measured without the package: within 10% of the resident high-water mark of
the real step on every method and architecture it is checked on, and never under it by more than 5% (an estimate
under the peak is the dangerous direction: the plan's first choice could run out of memory). TokenTune's cases run
by default (its step is the one the estimate has to follow most closely); the others are marked slow."""

from __future__ import annotations

import sys
import warnings

import pytest
from helpers.planner_cases import MEASURED_CASES, resident_step_peaks

from peft_slim.planner import estimate_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")
CASES = [pytest.param(case, marks=() if "tokentune" in case else pytest.mark.slow) for case in MEASURED_CASES]


@pytest.mark.parametrize("case", CASES)
def test_the_estimated_peak_is_within_10_percent_of_the_measured_one_and_never_5_percent_under(case):
    config, peft_config, options = MEASURED_CASES[case]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimate = estimate_memory(config, peft_config, **options)
    held = estimate.parameters + estimate.optimizer_state  # what the step starts with (the same bytes in both)
    ratio = estimate.peak / (held + resident_step_peaks([case])[case])
    assert 0.95 <= ratio <= 1.10, f"{case}: estimate / measured peak = {ratio:.3f} ({estimate})"
