"""BLOOM: transformer blocks with ALiBi positions and a fused, head-interleaved QKV projection."""

from ._block import BloomBlock as BloomBlock
