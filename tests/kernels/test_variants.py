"""Every Triton launch the served models lead to compiles for sm_80 and sm_90, with the shared
memory the smaller cards of each have (:mod:`petals_core.kernels._variants`).

Compiling runs in a process of its own: this one runs Triton's interpreter (tests/conftest.py),
which compiles nothing.  The triton wheel carries ptxas, so no GPU or driver is needed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from petals_core.kernels._variants import ARCHITECTURES

from ._branch_kernel import plan_scaled_copy

ROOT = Path(__file__).resolve().parents[2]
KERNELS = (
    "_combine_kernel",
    "_decode_kernel",
    "_prefill_kernel",
    "_rms_norm_kernel",
    "_rotary_kernel",
    "_rows_append_kernel",
    "_rows_decode_kernel",
)


def _compiling(tmp_path: Path, *command: str) -> subprocess.CompletedProcess[str]:
    """``command`` in a fresh Python with compiled (not interpreted) Triton and an empty cache of
    compiled kernels, from the repository's root."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    return subprocess.run(
        [sys.executable, *command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_every_planned_launch_compiles_for_ampere_and_hopper(tmp_path: Path) -> None:
    result = _compiling(tmp_path, "-m", "petals_core.kernels._variants", "--workers", "2")
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    assert ", 0 failed" in result.stdout, report
    assert "FAILED" not in report
    table = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines() if line}
    for kernel in KERNELS:
        compiled, failed, _ = table[kernel]
        assert int(compiled) >= len(ARCHITECTURES) and failed == "0", report


def test_the_check_fails_a_kernel_that_only_the_interpreter_runs(tmp_path: Path) -> None:
    """The mistake that once broke the row-table append: the interpreter runs the kernel, the
    check reports the compiler's error for both architectures, and the same kernel with the
    name defined compiles."""
    x = torch.arange(12, dtype=torch.float32).view(3, 4)
    out = torch.empty_like(x)
    plan_scaled_copy(x, out, scale=False)()
    torch.testing.assert_close(out, x)

    script = textwrap.dedent(
        """
        import torch
        from petals_core.kernels._variants import ARCHITECTURES, compile_launch
        from tests.kernels._branch_kernel import plan_scaled_copy

        x = torch.empty(3, 4, device="meta")
        for architecture in ARCHITECTURES:
            compile_launch(plan_scaled_copy(x, x, scale=True), architecture)
            try:
                compile_launch(plan_scaled_copy(x, x, scale=False), architecture)
            except Exception as error:
                print(architecture, "refused:", str(error).splitlines()[-1])
            else:
                print(architecture, "compiled")
        """
    )
    result = _compiling(tmp_path, "-c", script)
    assert result.returncode == 0, result.stdout + result.stderr
    for architecture in ARCHITECTURES:
        assert f"{architecture} refused: NameError('factor is not defined')" in result.stdout, (
            result.stdout + result.stderr
        )
