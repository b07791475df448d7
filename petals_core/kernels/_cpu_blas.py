"""``linear`` for one or two rows on CPU through numpy's OpenBLAS, the rest through torch.

A product of one row of activations by a weight matrix (the client's LM head on a decode step)
runs at the speed at which the weight streams from memory.  torch's CPU build does it with MKL,
whose kernels on some CPUs stream weights from DRAM more slowly than OpenBLAS on the same core.
numpy ships OpenBLAS, and numpy arrays can view torch tensors without a copy, so a product of one
or two rows runs there; everything else (more rows, other dtypes or devices, anything autograd
must differentiate) stays with torch.  ``set_cpu_blas(False)`` keeps every product on torch.

Results differ from torch's in the order a dot product is summed, i.e. in the last bits (fp32:
relative differences around 1e-6), as they do between any two BLAS libraries.  Small weights
(under 256 x 256) stay with torch: there the product takes less time than handing it over.

OpenBLAS keeps its own thread count; before each product it is set to torch's
(``torch.set_num_threads``), so a process given one torch thread computes on one thread here too.
Nothing starts at import: the library is looked up (threadpoolctl) on the first product.  The CPU
decode backend, whose products are numpy's, keeps the thread counts together the same way
(:func:`sync_openblas_threads`).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["cpu_blas_enabled", "linear", "set_cpu_blas", "sync_openblas_threads"]

#: Products of at most this many rows take OpenBLAS: with more, a product is no longer bound by
#: how fast the weight streams from memory.
MAX_BLAS_ROWS = 2
#: ...with a weight of at least this many elements: below (a 256 x 128 matrix and smaller) the
#: product is so short that the numpy round trip (a few microseconds) costs more than it saves.
MIN_BLAS_WEIGHT = 256 * 256


class _Blas:
    """numpy's OpenBLAS, found on first use, and the thread count last given to it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.enabled = True
        self.found: bool | None = None  # None: not looked up yet
        self.controller: Any = None
        self.threads = 0

    def ready(self) -> bool:
        return self.enabled and self.sync()

    def sync(self) -> bool:
        if self.found is None:
            self._find()
        if not self.found:
            return False
        threads = torch.get_num_threads()
        if threads != self.threads:
            with self.lock:
                if threads != self.threads:
                    self.controller.limit(limits=threads)
                    self.threads = threads
        return True

    def _find(self) -> None:
        with self.lock:
            if self.found is not None:
                return
            try:
                from threadpoolctl import ThreadpoolController
            except ImportError:  # pragma: no cover - a dependency; without it, torch only
                self.found = False
                return
            openblas = ThreadpoolController().select(internal_api="openblas")
            self.controller = openblas
            self.found = bool(openblas.lib_controllers)


_BLAS = _Blas()
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def set_cpu_blas(enabled: bool) -> None:
    """Let decode-sized fp32 CPU products use OpenBLAS (the default) or keep them on torch."""
    _BLAS.enabled = bool(enabled)


def sync_openblas_threads() -> bool:
    """Give numpy's OpenBLAS torch's thread count (if it changed); False if numpy has no
    OpenBLAS.  The library is looked up on the first call."""
    return _BLAS.sync()


def cpu_blas_enabled() -> bool:
    """Whether decode-sized fp32 CPU products go to OpenBLAS (enabled and the library found)."""
    return _BLAS.ready()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x`` (..., in), ``weight`` (out, in), ``bias`` (out,)."""
    # One function on purpose: every decode step calls it for every product, and on a server
    # that idled each Python call runs cold.
    blas = _BLAS
    if (
        blas.enabled
        # Subclasses (quantised weights, fake or traced tensors) keep torch's path.
        and type(x) in _PLAIN
        and type(weight) in _PLAIN
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.numel() >= MIN_BLAS_WEIGHT
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[1]
        and 0 < x.numel() <= MAX_BLAS_ROWS * weight.shape[1]
        and (
            bias is None
            or (
                type(bias) in _PLAIN
                and bias.dtype == torch.float32
                and bias.device.type == "cpu"
                and bias.shape == (weight.shape[0],)
            )
        )
        # Whatever autograd must differentiate needs torch's op.
        and (
            not torch.is_grad_enabled()
            or not (
                x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
            )
        )
        # The library is found and has torch's thread count (``ready`` sees to both).
        and (blas.threads == torch.get_num_threads() or blas.ready())
    ):
        return _blas_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _blas_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.detach().numpy().reshape(-1, x.shape[-1])  # (N, in), N <= MAX_BLAS_ROWS
    out = torch.from_numpy(np.matmul(rows, weight.detach().numpy().T))  # (N, out)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])
