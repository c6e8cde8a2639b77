"""Benchmarks of peft_slim's methods against the usual alternatives (``python -m benchmarks.harness``)."""
