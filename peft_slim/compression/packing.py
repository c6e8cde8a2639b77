"""Packing codes narrower than a byte (4, 2 or 1 bits) into uint8 bytes, and back."""

from __future__ import annotations

import sys

import torch

# Packing works on `8 // bits` codes at once, viewed as one little-endian integer of that many bytes: shifting
# it by multiples of 8 - bits gathers (or spreads) the codes in a handful of whole-tensor ops.
_WIDE = {4: torch.int16, 2: torch.int32, 1: torch.int64}
_SPREAD_MASK = {4: 0x0F0F, 2: 0x03030303, 1: 0x0101010101010101}


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes below ``2**bits`` into bytes, the first code in the lowest bits (zero-padded)."""
    if bits == 8:
        return codes
    per_byte = 8 // bits
    pad = -codes.numel() % per_byte
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    _check_byte_order()
    wide = codes.view(_WIDE[bits])  # byte i of each integer holds code i
    packed = wide.clone()
    for i in range(1, per_byte):
        packed |= wide >> (i * (8 - bits))
    return packed.to(torch.uint8)  # the low byte


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` uint8 codes of ``pack_bits``' output."""
    if bits == 8:
        return packed[:count]
    _check_byte_order()
    byte = packed.to(_WIDE[bits])
    wide = byte.clone()
    for i in range(1, 8 // bits):
        wide |= byte << (i * (8 - bits))
    return (wide & _SPREAD_MASK[bits]).view(torch.uint8)[:count]  # byte i of each integer: code i


def _check_byte_order() -> None:
    if sys.byteorder != "little":  # every platform PyTorch ships for is little-endian
        raise NotImplementedError("peft_slim packs sub-byte codes for little-endian machines only; use bits=8.")
