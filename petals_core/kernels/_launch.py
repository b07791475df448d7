"""A Triton launch as data: the kernel, its grid, its arguments, its constexprs and options.

Every wrapper first *plans* its launches from the tensors' shapes, dtypes and a :class:`Target`
(what the plan needs to know of the device), then runs them.  Planning touches no device memory's
contents, so it runs on ``meta`` tensors as well: :mod:`petals_core.kernels._variants` plans the
launches that the served models' shapes lead to and compiles each for CUDA targets on a machine
without a GPU, exactly as a wrapper would launch it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar

import attrs
import torch

__all__ = ["Launch", "Target", "launcher"]

_P = ParamSpec("_P")
_T = TypeVar("_T")


@attrs.frozen(kw_only=True)
class Target:
    """What a launch plan depends on of the device.

    ``cuda``: compiled kernels on a GPU (16-bit dot operands, tensor cores), rather than Triton's
    interpreter on CPU tensors (which multiplies bf16 bit patterns as integers: dots there take
    fp32 operands).  ``multiprocessors``: how many programs run at once, which sets how finely
    attention splits its keys.
    """

    cuda: bool
    multiprocessors: int

    @staticmethod
    def of(device: torch.device) -> Target:
        return _target_of(device)


@functools.cache
def _target_of(device: torch.device) -> Target:
    if device.type != "cuda":
        return Target(cuda=False, multiprocessors=1)
    properties = torch.cuda.get_device_properties(device)
    return Target(cuda=True, multiprocessors=properties.multi_processor_count)


@attrs.frozen(kw_only=True)
class Launch:
    """``kernel[grid](*args, **constexprs, num_warps=..., num_stages=...)``, not yet run.

    ``args`` are the kernel's runtime arguments in order (tensors, ints, floats); ``constexprs``
    its compile-time ones by name.
    """

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constexprs: Mapping[str, Any]
    num_warps: int
    num_stages: int | None = None

    def __call__(self) -> None:
        options: dict[str, int] = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            options["num_stages"] = self.num_stages
        self.kernel[self.grid](*self.args, **self.constexprs, **options)

    @property
    def name(self) -> str:
        return str(self.kernel.__name__)


def launcher(plan: Callable[_P, tuple[_T, list[Launch]]]) -> Callable[_P, _T]:
    """The wrapper of ``plan_NAME``, named ``NAME``: it takes the plan's arguments, runs the
    launches the plan returns in order and returns the plan's output, which they write."""

    def run(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        out, launches = plan(*args, **kwargs)
        for launch in launches:
            launch()
        return out

    run.__name__ = plan.__name__.removeprefix("plan_")
    run.__qualname__ = plan.__qualname__.removeprefix("plan_")
    run.__module__ = plan.__module__
    run.__doc__ = f"Runs what :func:`{plan.__name__}` plans; returns its output."
    return run
