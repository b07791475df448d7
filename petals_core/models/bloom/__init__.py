"""BLOOM: transformer blocks with ALiBi positions and a fused, head-interleaved QKV projection."""

from ._block import (
    BloomAttention as BloomAttention,
    BloomBlock as BloomBlock,
    BloomMLP as BloomMLP,
)
