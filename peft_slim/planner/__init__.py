"""Memory planning: how much one training step needs, and which settings fit a budget."""

from .estimate import MemoryEstimate, estimate_memory
from .measure import measure_memory
from .plan import Candidate, plan

__all__ = ["Candidate", "MemoryEstimate", "estimate_memory", "measure_memory", "plan"]
