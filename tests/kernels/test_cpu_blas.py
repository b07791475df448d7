"""``kernels.linear``: one or two fp32 CPU rows through numpy's OpenBLAS, the rest torch's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from threadpoolctl import ThreadpoolController

from petals_core import kernels
from petals_core.kernels import _cpu_blas


def _numpy_has_openblas() -> bool:
    found = ThreadpoolController().select(internal_api="openblas").lib_controllers
    return any("numpy" in lib.filepath or "scipy_openblas" in lib.filepath for lib in found)


pytestmark = pytest.mark.skipif(
    not _numpy_has_openblas(), reason="this numpy is not built with OpenBLAS"
)


#: A weight just past the size from which products go to OpenBLAS.
IN, OUT = 256, 320
assert IN * OUT >= _cpu_blas.MIN_BLAS_WEIGHT


@pytest.fixture(autouse=True)
def _blas_on() -> Iterator[None]:
    kernels.set_cpu_blas(True)
    yield
    kernels.set_cpu_blas(True)


def _numpy_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    rows = x.detach().reshape(-1, x.shape[-1]).numpy()
    out = rows @ weight.detach().numpy().T
    if bias is not None:
        out = out + bias.detach().numpy()
    return torch.from_numpy(out).view(*x.shape[:-1], weight.shape[0])


@pytest.mark.parametrize("shape", [(IN,), (1, IN), (1, 1, IN), (2, 1, IN), (1, 2, IN)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_or_two_rows_take_openblas_and_match_torch(
    shape: tuple[int, ...], with_bias: bool
) -> None:
    generator = torch.Generator().manual_seed(len(shape) * 10 + shape[0])
    x = torch.randn(shape, generator=generator)
    weight = torch.randn(OUT, IN, generator=generator)
    bias = torch.randn(OUT, generator=generator) if with_bias else None
    with torch.inference_mode():
        got = kernels.linear(x, weight, bias)
    assert kernels.cpu_blas_enabled()
    assert got.shape == (*shape[:-1], OUT) and got.dtype == torch.float32
    # OpenBLAS's own result, bit for bit: the product did go there...
    assert torch.equal(got, _numpy_product(x, weight, bias))
    # ...and it is torch's up to the order of summation.
    torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def test_strided_inputs_and_weight_rows_of_a_bigger_matrix() -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(IN, 1, generator=generator).t()  # (1, IN), not contiguous
    table = torch.randn(3 * OUT, IN, generator=generator)
    weight = table[OUT : 2 * OUT]  # the LM head's chunks are such views
    columns = torch.randn(OUT, 2 * IN, generator=generator)[:, ::2]  # (OUT, IN), strided
    with torch.no_grad():
        for w in (weight, columns):
            got = kernels.linear(x, w)
            torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=1e-5)
            assert torch.equal(got, _numpy_product(x, w, None))


def test_more_rows_small_weights_other_dtypes_and_switched_off_stay_with_torch() -> None:
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(OUT, IN, generator=generator)
    x3 = torch.randn(3, IN, generator=generator)
    with torch.no_grad():
        assert torch.equal(kernels.linear(x3, weight), F.linear(x3, weight))
        for dtype in (torch.bfloat16, torch.float64):
            x, w = torch.randn(1, IN, generator=generator).to(dtype), weight.to(dtype)
            assert torch.equal(kernels.linear(x, w), F.linear(x, w))
        small = weight[: _cpu_blas.MIN_BLAS_WEIGHT // IN - 1]  # just under the threshold
        x1 = torch.randn(1, IN, generator=generator)
        assert torch.equal(kernels.linear(x1, small), F.linear(x1, small))
        kernels.set_cpu_blas(False)
        assert not kernels.cpu_blas_enabled()
        assert torch.equal(kernels.linear(x1, weight), F.linear(x1, weight))


def test_autograd_keeps_torchs_op_and_its_gradients() -> None:
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(OUT, IN, generator=generator, requires_grad=True)
    x = torch.randn(1, IN, generator=generator, requires_grad=True)
    out = kernels.linear(x, weight)
    assert out.grad_fn is not None
    out.sum().backward()
    assert x.grad is not None and weight.grad is not None
    torch.testing.assert_close(x.grad, weight.detach().sum(0, keepdim=True))
    torch.testing.assert_close(weight.grad, x.detach().expand(OUT, IN))
    # A frozen weight (a server's) under no_grad: OpenBLAS, no graph.
    weight.requires_grad_(False)
    with torch.no_grad():
        frozen = kernels.linear(x, weight)
    assert frozen.grad_fn is None
    assert torch.equal(frozen, _numpy_product(x, weight, None))


def test_openblas_gets_torchs_thread_count() -> None:
    before = torch.get_num_threads()
    openblas = ThreadpoolController().select(internal_api="openblas")
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            with torch.no_grad():
                kernels.linear(torch.ones(1, IN), torch.ones(OUT, IN))
            assert {info["num_threads"] for info in openblas.info()} == {threads}
        # The same for numpy's own products (the CPU decode backend's), switch or not.
        kernels.set_cpu_blas(False)
        for threads in (2, 1):
            torch.set_num_threads(threads)
            assert kernels.sync_openblas_threads()
            assert {info["num_threads"] for info in openblas.info()} == {threads}
    finally:
        torch.set_num_threads(before)
