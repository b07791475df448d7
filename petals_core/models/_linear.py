"""``nn.Linear`` whose product goes through :func:`petals_core.kernels.linear`.

Same parameters, same ``state_dict`` keys, still an ``nn.Linear`` (quantisation and LoRA wrap it as
they wrap any); only decode-sized fp32 CPU products change hands (to OpenBLAS, see the kernel).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels

__all__ = ["Linear"]


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # What ``self.weight`` and ``self.bias`` return, read without nn.Module's Python-level
        # __getattr__ (two calls per product, on every decode step).
        parameters = self._parameters
        weight, bias = parameters["weight"], parameters["bias"]
        assert weight is not None  # registered by nn.Linear; bias may be None
        return kernels.linear(x, weight, bias)
