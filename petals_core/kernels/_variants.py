"""Every Triton launch the served models lead to, compiled for CUDA targets without a GPU.

The kernels' wrappers plan their launches from shapes, dtypes and a :class:`Target`
(:mod:`._launch`).  Here they plan them on ``meta`` tensors, for the attention shape of each model
below, in each dtype a server computes in, for each call the blocks and the decode graphs make:
RMSNorm, rotary alone and fused with the cache append, decode attention (1 to 16 new tokens, in
one pass and in splits, then the merge of the splits), prefill attention, and the row-table append
and attention.  Each distinct launch (kernel, argument types, constexprs, warps and stages) is then
built by ``triton.compile`` for ``sm_80`` and ``sm_90``: the triton wheel carries ``ptxas``, so
this needs no GPU and no driver.

What the interpreter (the CPU tests) cannot show, this does: a name defined under one branch and
used under a branch decided at run time, a tile that ``tl.dot`` refuses, a kernel that needs more
shared memory than the smaller cards of an architecture have (``sm_86`` and ``sm_89`` give a block
99 KiB).  ``python -m petals_core.kernels._variants`` prints the table and exits non-zero on a
failure; ``tests/kernels/test_variants.py`` runs it.

Arguments are typed as Triton types them at a launch: integers equal to 1 become the constant 1
(unless the kernel says not to specialize them), other integers ``i32`` (``i64`` past its range),
floats ``fp32``, tensors pointers to their dtype, aligned to 16 bytes as torch allocates them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import attrs
import torch

from ._launch import Launch, Target
from ._limits import CUDA_ATTENTION_DTYPES, MAX_DECODE_TOKENS, attention_kernel

__all__ = [
    "ARCHITECTURES",
    "SHARED_MEMORY_LIMIT",
    "AttentionShape",
    "Variant",
    "compile_launch",
    "compile_variant",
    "planned_launches",
    "variants",
]

#: The CUDA architectures compiled for: Ampere (A100) and Hopper (H100, H200).
ARCHITECTURES = (80, 90)
#: Shared memory one block may use on the smallest card of each architecture: sm_86 / sm_89
#: cards (RTX 30xx, 40xx, L4, L40) have 99 KiB, below the A100's 163 KiB.
SHARED_MEMORY_LIMIT = {80: 99 * 1024, 90: 227 * 1024}
#: The dtypes a server computes in.
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: A target as a GPU presents it (an H100's 132 multiprocessors: the split counts it leads to
#: cover every count from 1 to the cap).
CUDA = Target(cuda=True, multiprocessors=132)


@attrs.frozen(kw_only=True)
class AttentionShape:
    """What the kernels see of a model: its attention heads and hidden size, whether its
    positions are rotary (else BLOOM's ALiBi) and whether its norms are RMSNorms (LLaMA,
    Mixtral; BLOOM and Falcon take torch's LayerNorm)."""

    n_head: int
    n_kv_head: int
    head_dim: int
    hidden: int
    rotary: bool
    rms_norm: bool


#: The served families' models whose shapes the kernels meet: every head size, grouping and
#: hidden size (one pass or two for RMSNorm) among them.
SHAPES: dict[str, AttentionShape] = {
    "llama-2-7b": AttentionShape(
        n_head=32, n_kv_head=32, head_dim=128, hidden=4096, rotary=True, rms_norm=True
    ),
    "llama-3-70b": AttentionShape(
        n_head=64, n_kv_head=8, head_dim=128, hidden=8192, rotary=True, rms_norm=True
    ),
    "llama-3.1-405b": AttentionShape(
        n_head=128, n_kv_head=8, head_dim=128, hidden=16384, rotary=True, rms_norm=True
    ),
    "tinyllama-1.1b": AttentionShape(
        n_head=32, n_kv_head=4, head_dim=64, hidden=2048, rotary=True, rms_norm=True
    ),
    "smollm2-135m": AttentionShape(
        n_head=9, n_kv_head=3, head_dim=64, hidden=576, rotary=True, rms_norm=True
    ),
    "open-llama-3b": AttentionShape(
        n_head=32, n_kv_head=32, head_dim=100, hidden=3200, rotary=True, rms_norm=True
    ),
    "mixtral-8x7b": AttentionShape(
        n_head=32, n_kv_head=8, head_dim=128, hidden=4096, rotary=True, rms_norm=True
    ),
    "bloom-560m": AttentionShape(
        n_head=16, n_kv_head=16, head_dim=64, hidden=1024, rotary=False, rms_norm=False
    ),
    "bloom-176b": AttentionShape(
        n_head=112, n_kv_head=112, head_dim=128, hidden=14336, rotary=False, rms_norm=False
    ),
    "falcon-7b": AttentionShape(
        n_head=71, n_kv_head=1, head_dim=64, hidden=4544, rotary=True, rms_norm=False
    ),
    "falcon-40b": AttentionShape(
        n_head=128, n_kv_head=8, head_dim=64, hidden=8192, rotary=True, rms_norm=False
    ),
    "falcon-180b": AttentionShape(
        n_head=232, n_kv_head=8, head_dim=64, hidden=14848, rotary=True, rms_norm=False
    ),
}

#: Keys before a decode step: few (one pass) and many (split, up to the cap of 128 splits).
_DECODE_LENGTHS = (0, 64, 300, 1000, 2048, 4096, 10000, 40000)
#: New tokens of a prefill chunk (past what the decode kernel takes).
_PREFILL_TOKENS = (17, 300)
#: Rows of a decode-graph step (sessions' rows together).
_ROWS = (1, 8, 64)


@attrs.frozen(kw_only=True)
class Variant:
    """One compilation: a kernel with its arguments' types, its constexprs and options."""

    kernel: str
    signature: tuple[tuple[str, str], ...]
    constants: tuple[tuple[str, Any], ...]
    num_warps: int
    num_stages: int | None
    #: Where it came from (the first plan that led to it), for the report.
    example: str = attrs.field(eq=False)


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _row_tables(rows: int) -> Any:
    from ._rows import RowTables

    table = _meta(4, rows, dtype=torch.int64)
    return RowTables(
        positions=table[0], head_strides=table[1], key_ptrs=table[2], value_ptrs=table[3]
    )


def planned_launches(target: Target = CUDA) -> Iterator[tuple[str, Launch]]:
    """Every launch the wrappers plan for :data:`SHAPES` in :data:`DTYPES`, each with where it
    came from."""
    from . import _triton_attention, _triton_norm, _triton_rotary, _triton_rows
    from ._reference import alibi_slopes

    for name, shape in SHAPES.items():
        heads, kv_heads, head_dim = shape.n_head, shape.n_kv_head, shape.head_dim
        for dtype in DTYPES:
            where = f"{name} {str(dtype).removeprefix('torch.')}"
            slopes = None if shape.rotary else alibi_slopes(heads).to("meta")
            if shape.rms_norm:
                for tokens in (1, 300):
                    x = _meta(1, tokens, shape.hidden, dtype=dtype)
                    weight = _meta(shape.hidden, dtype=dtype)
                    _, launches = _triton_norm.plan_rms_norm(x, weight, 1e-5)
                    yield from ((f"{where}: rms_norm", launch) for launch in launches)
            if shape.rotary:
                for tokens in (1, 2, 3, 5, 9, 300):
                    q = _meta(1, heads, tokens, head_dim, dtype=dtype)
                    k = _meta(1, kv_heads, tokens, head_dim, dtype=dtype)
                    angles = _meta(1, tokens, head_dim, dtype=dtype)
                    _, launches = _triton_rotary.plan_rotary(q, angles, angles)
                    yield from ((f"{where}: rotary T={tokens}", launch) for launch in launches)
                    cache = _meta(1, kv_heads, 512, head_dim, dtype=dtype)
                    _, launches = _triton_rotary.plan_rotary_append(
                        q, k, k, angles, angles, keys=cache, values=cache, start=0
                    )
                    yield from (
                        (f"{where}: rotary_append T={tokens}", launch) for launch in launches
                    )
            group = heads // kv_heads
            for tokens in (*range(1, MAX_DECODE_TOKENS + 1), *_PREFILL_TOKENS):
                kernel = attention_kernel(
                    dtype=dtype, new_tokens=tokens, group=group, alibi=slopes is not None
                )
                if kernel is None:
                    continue
                plan = (
                    _triton_attention.plan_decode_attention
                    if kernel == "decode"
                    else _triton_attention.plan_prefill_attention
                )
                for length in _DECODE_LENGTHS:
                    q = _meta(1, heads, tokens, head_dim, dtype=dtype)
                    k = _meta(1, kv_heads, length + tokens, head_dim, dtype=dtype)
                    _, launches = plan(
                        q, k, k, query_offset=length, alibi_slopes=slopes, target=target
                    )
                    yield from (
                        (f"{where}: {kernel} T={tokens} S={length + tokens}", launch)
                        for launch in launches
                    )
            if dtype not in CUDA_ATTENTION_DTYPES:
                continue  # decode graphs step fp32 spans eagerly on GPUs
            for rows in _ROWS:
                tables = _row_tables(rows)
                q = _meta(rows, heads, head_dim, dtype=dtype)
                k = _meta(rows, kv_heads, head_dim, dtype=dtype)
                table = _meta(4096, head_dim, dtype=dtype) if shape.rotary else None
                _, appends = _triton_rows.plan_rows_append(q, k, k, tables, cos=table, sin=table)
                yield from ((f"{where}: rows_append R={rows}", launch) for launch in appends)
                for length in _DECODE_LENGTHS:
                    _, launches = _triton_rows.plan_rows_decode_attention(
                        q,
                        kv_heads,
                        tables,
                        max_length=max(length, 1),
                        alibi_slopes=slopes,
                        target=target,
                    )
                    yield from (
                        (f"{where}: rows_decode R={rows} S={length}", launch) for launch in launches
                    )


def variants(target: Target = CUDA) -> list[Variant]:
    """The distinct compilations :func:`planned_launches` asks for, in the order first met."""
    seen: dict[Variant, None] = {}
    for where, launch in planned_launches(target):
        variant = _variant(where, launch)
        seen.setdefault(variant, None)
    return list(seen)


_POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.int64: "*i64",
    torch.int32: "*i32",
}


def _variant(where: str, launch: Launch) -> Variant:
    kernel = launch.kernel
    runtime = [param for param in kernel.params if not param.is_constexpr]
    if len(runtime) != len(launch.args):
        raise ValueError(f"{launch.name}: {len(launch.args)} arguments for {len(runtime)} params")
    signature = []
    constants: dict[str, Any] = {}
    for param, value in zip(runtime, launch.args, strict=True):
        if isinstance(value, torch.Tensor):
            signature.append((param.name, _POINTER_TYPES[value.dtype]))
        elif isinstance(value, bool):
            signature.append((param.name, "u1"))
        elif isinstance(value, int):
            if value == 1 and not param.do_not_specialize:
                constants[param.name] = 1
                signature.append((param.name, "constexpr"))
            else:
                signature.append((param.name, "i32" if -(2**31) <= value < 2**31 else "i64"))
        elif isinstance(value, float):
            signature.append((param.name, "fp32"))
        else:
            raise TypeError(f"{launch.name}: argument {param.name} is a {type(value).__name__}")
    for name, value in launch.constexprs.items():
        signature.append((name, "constexpr"))
        constants[name] = value
    return Variant(
        kernel=launch.name,
        signature=tuple(signature),
        constants=tuple(sorted(constants.items(), key=lambda item: item[0])),
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        example=where,
    )


def _kernels() -> dict[str, Any]:
    """The kernels' modules' launchable kernels (``_*_kernel``; the other jitted functions are
    helpers they call), by name."""
    from . import _triton_attention, _triton_norm, _triton_rotary, _triton_rows

    found = {}
    for module in (_triton_attention, _triton_norm, _triton_rotary, _triton_rows):
        for name, value in vars(module).items():
            if name.endswith("_kernel") and hasattr(value, "arg_names"):
                found[name] = value
    return found


def compile_launch(launch: Launch, architecture: int) -> int:
    """Compile what ``launch`` would launch, for ``sm_<architecture>``: see
    :func:`compile_variant`."""
    return compile_variant(_variant("", launch), architecture, kernel=launch.kernel)


def compile_variant(variant: Variant, architecture: int, *, kernel: Any = None) -> int:
    """Compile ``variant`` (of ``kernel``, by default the kernels module's kernel of its name)
    for ``sm_<architecture>``; returns the shared memory it needs per block, in bytes.  Raises
    what the compiler raises."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if kernel is None:
        kernel = _kernels()[variant.kernel]
    signature = dict(variant.signature)
    attributes = {
        (kernel.arg_names.index(name),): [["tt.divisibility", 16]]
        for name, kind in variant.signature
        if kind.startswith("*")
    }
    source = ASTSource(kernel, signature, constexprs=dict(variant.constants), attrs=attributes)
    options: dict[str, int] = {"num_warps": variant.num_warps}
    if variant.num_stages is not None:
        options["num_stages"] = variant.num_stages
    compiled = triton.compile(source, target=GPUTarget("cuda", architecture, 32), options=options)
    return int(compiled.metadata.shared)


@attrs.frozen(kw_only=True)
class Outcome:
    variant: Variant
    architecture: int
    shared: int | None
    error: str | None
    seconds: float


def _compile_one(job: tuple[Variant, int]) -> Outcome:
    variant, architecture = job
    started = time.perf_counter()
    try:
        shared = compile_variant(variant, architecture)
    except Exception as error:  # the report names the variant and the compiler's message
        return Outcome(
            variant=variant,
            architecture=architecture,
            shared=None,
            error=_message(error),
            seconds=time.perf_counter() - started,
        )
    limit = SHARED_MEMORY_LIMIT[architecture]
    too_large = None
    if shared > limit:
        too_large = (
            f"needs {shared} bytes of shared memory, more than the {limit} of sm_{architecture}"
        )
    return Outcome(
        variant=variant,
        architecture=architecture,
        shared=shared,
        error=too_large,
        seconds=time.perf_counter() - started,
    )


def _message(error: BaseException) -> str:
    """The compiler's error in one line: where (its first line) and what (the cause's)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    cause = error.__cause__ or error.__context__
    what = f"{type(cause).__name__}: {cause}" if cause is not None else (lines[-1] if lines else "")
    where = lines[0] if lines else ""
    return f"{type(error).__name__} {where} {what}".strip()


def compile_all(
    selected: list[Variant], architectures: tuple[int, ...] = ARCHITECTURES, *, workers: int = 1
) -> list[Outcome]:
    """Compile every variant for every architecture, in ``workers`` processes."""
    jobs = [(variant, architecture) for variant in selected for architecture in architectures]
    if workers <= 1:
        return [_compile_one(job) for job in jobs]
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        return list(pool.map(_compile_one, jobs, chunksize=4))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m petals_core.kernels._variants", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--list", action="store_true", help="list the variants, compile nothing")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("compiling needs TRITON_INTERPRET unset (the interpreter compiles nothing)")
    started = time.perf_counter()
    selected = variants()
    if args.list:
        for variant in selected:
            print(variant.kernel, dict(variant.constants), variant.num_warps, variant.example)
        print(f"{len(selected)} variants")
        return 0
    outcomes = compile_all(selected, workers=args.workers)
    failures = [outcome for outcome in outcomes if outcome.error is not None]
    unplanned = sorted(set(_kernels()) - {variant.kernel for variant in selected})
    for kernel in unplanned:
        print(f"FAILED {kernel}: no planned launch reaches it", file=sys.stderr)
    by_kernel: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        by_kernel.setdefault(outcome.variant.kernel, []).append(outcome)
    print(f"{'kernel':<24} {'compiled':>8} {'failed':>6} {'most shared memory':>20}")
    for kernel, items in sorted(by_kernel.items()):
        shared = max((item.shared or 0) for item in items)
        failed = sum(item.error is not None for item in items)
        print(f"{kernel:<24} {len(items):>8} {failed:>6} {shared:>20}")
    for outcome in failures:
        print(
            f"FAILED sm_{outcome.architecture} {outcome.variant.kernel} "
            f"{dict(outcome.variant.constants)} ({outcome.variant.example}): {outcome.error}",
            file=sys.stderr,
        )
    print(
        f"{len(outcomes)} compilations of {len(selected)} variants for "
        f"{', '.join(f'sm_{a}' for a in ARCHITECTURES)}, {len(failures)} failed, "
        f"in {time.perf_counter() - started:.1f} s"
    )
    return 1 if failures or unplanned else 0


if __name__ == "__main__":
    sys.exit(main())
