"""Fixtures of the tuner tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread, as the recorded references were made: with more, torch sums a batch's gradients
    (LayerNorm's, a bias's) in another order, and the last bits differ on the same code."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
