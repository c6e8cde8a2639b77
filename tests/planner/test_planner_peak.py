"""The planner's step peak against one measured without the package: within 10% of the resident high-water mark of
the real step on every method and architecture it is checked on, and never under it by more than 5% (an estimate
under the peak is the dangerous direction: the plan's first choice could run out of memory). One case of each
method runs by default (LoRA, full fine-tuning, SlimFit, TokenTune with and without compression); the
others are marked slow. The cases selected are measured one after another in one fresh process (the
high-water mark restarts before each step), not one process each."""

from __future__ import annotations

import sys
import warnings

import pytest
from helpers.planner_cases import MEASURED_CASES, resident_step_peaks

from peft_slim.planner import estimate_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")
DEFAULT = {
    "llama lora",
    "llama full fine-tuning",
    "llama slimfit",
    "llama tokentune 0.2",
    "llama tokentune 0.3 8-bit bf16",
}
CASES = [pytest.param(case, marks=() if case in DEFAULT else pytest.mark.slow) for case in MEASURED_CASES]
TEST = "test_the_estimated_peak_is_within_10_percent_of_the_measured_one_and_never_5_percent_under"


@pytest.fixture(scope="module")
def measured(request):
    """The step peak of every case this session runs, measured in one fresh process."""
    names = [item.callspec.params["case"] for item in request.session.items if item.originalname == TEST]
    return resident_step_peaks(list(dict.fromkeys(names)))


@pytest.mark.parametrize("case", CASES)
def test_the_estimated_peak_is_within_10_percent_of_the_measured_one_and_never_5_percent_under(case, measured):
    config, peft_config, options = MEASURED_CASES[case]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimate = estimate_memory(config, peft_config, **options)
    held = estimate.parameters + estimate.optimizer_state  # what the step starts with (the same bytes in both)
    step_peak = measured[case] if case in measured else resident_step_peaks([case])[case]
    ratio = estimate.peak / (held + step_peak)
    assert 0.95 <= ratio <= 1.10, f"{case}: estimate / measured peak = {ratio:.3f} ({estimate})"
