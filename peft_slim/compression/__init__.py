"""Activation compression: store the tensors autograd saves for backward in 8, 4 or 2 bits, for any model."""

from .config import ActivationCompressionConfig
from .hooks import ActivationCompression, CompressionStats, compress_activations

__all__ = ["ActivationCompression", "ActivationCompressionConfig", "CompressionStats", "compress_activations"]
