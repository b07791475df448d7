"""Falcon: parallel or sequential blocks with multi-query or grouped-query attention, rotary or
ALiBi positions."""

from ._block import (
    FalconAttention as FalconAttention,
    FalconBlock as FalconBlock,
    FalconMLP as FalconMLP,
)
