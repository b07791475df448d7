"""Compute kernels used by the blocks, each with a plain-torch reference.

Dispatch picks a Triton kernel for CUDA tensors (when no backward is needed), torch's fused
attention or the reference otherwise.  Triton is imported only when a CUDA tensor needs it.
``linear`` sends products of one or two fp32 rows on CPU to numpy's OpenBLAS (see ``_cpu_blas``).

Its modules: ``_dispatch`` (the choice per call), ``_reference`` (the torch references),
``_triton_attention``, ``_triton_rotary``, ``_triton_norm`` (the kernels), ``_rows`` and
``_triton_rows`` (row-table kernels for decode graphs), ``_launch`` (every wrapper plans its
launches before running them), ``_variants`` (the launches of the served models' shapes, which a
test compiles for sm_80 and sm_90 without a GPU), ``_limits``, ``_cpu_blas``.
"""

from ._cpu_blas import (
    cpu_blas_enabled as cpu_blas_enabled,
    linear as linear,
    set_cpu_blas as set_cpu_blas,
    sync_openblas_threads as sync_openblas_threads,
)
from ._dispatch import (
    DispatchChoice as DispatchChoice,
    DispatchTable as DispatchTable,
    attention as attention,
    dispatch_table as dispatch_table,
    rms_norm as rms_norm,
    rotary as rotary,
    rotary_append as rotary_append,
    triton_usable as triton_usable,
)
from ._limits import CUDA_ATTENTION_DTYPES as CUDA_ATTENTION_DTYPES
from ._reference import (
    alibi_slopes as alibi_slopes,
    attention_reference as attention_reference,
    rms_norm_reference as rms_norm_reference,
    rotary_append_reference as rotary_append_reference,
    rotary_reference as rotary_reference,
    rows_append_reference as rows_append_reference,
    rows_attention_reference as rows_attention_reference,
)
from ._rows import (
    RowTables as RowTables,
    rows_append as rows_append,
    rows_decode_attention as rows_decode_attention,
)
