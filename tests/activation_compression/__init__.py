"""Activation compression: config, hooks, quantization, in-place writes, with TokenTune, the Triton kernels."""
