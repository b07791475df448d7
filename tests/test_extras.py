"""Optional dependencies: each part that needs one names the extra to install when it is missing.

Each case runs in a fresh interpreter where the extra's modules cannot be imported (their
``sys.modules`` entries are None, which makes ``import`` fail as for a package not installed)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from petals_core._extras import EXTRAS

ROOT = Path(__file__).resolve().parent.parent

#: Per extra: code that uses a part needing it (``tmp`` is a fresh folder).
USES = {
    "http": [
        "import petals_core.api",
        "import petals_core.monitor",
        "import functools, trio; from petals_core._http import serve_http\n"
        "trio.run(functools.partial(serve_http, None, host='127.0.0.1', port=0))",
    ],
    "quant": [
        "from transformers import LlamaConfig\n"
        "from petals_core.models import new_block, quantize_block\n"
        "config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,\n"
        "                     num_hidden_layers=1, vocab_size=32)\n"
        "quantize_block(new_block(config, 0), 'int8')",
    ],
    "gguf": ["from petals_core.models import prepare_smollm2; prepare_smollm2(tmp)"],
}


def _run_without(extra: str, code: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    blocked = "".join(f"sys.modules[{module!r}] = None\n" for module in EXTRAS[extra])
    program = f"import sys\n{blocked}tmp = {str(tmp)!r}\n{code}\n"
    return subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )


@pytest.mark.parametrize(
    ("extra", "code"), [(extra, code) for extra, codes in USES.items() for code in codes]
)
def test_a_missing_extra_is_named(extra: str, code: str, tmp_path: Path) -> None:
    done = _run_without(extra, code, tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("petals_core._errors.MissingExtra: "), done.stderr[-2000:]
    assert f"pip install 'petals_core[{extra}]'" in last
    assert re.search("|".join(EXTRAS[extra]), last)


def test_nf4_on_a_device_without_bitsandbytes_names_the_extra(tmp_path: Path) -> None:
    code = (
        "import torch\n"
        "from petals_core.server._defaults import bitsandbytes_problem\n"
        "print(bitsandbytes_problem(torch.device('cpu')))"
    )
    done = _run_without("quant", code, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pip install 'petals_core[quant]'" in done.stdout


def test_each_extra_brings_the_modules_checked_for_it() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        brought = {Requirement(line).name.replace("-", "_") for line in extras[extra]}
        assert brought == set(modules), extra
        # Not required by the package itself: an install without the extra lacks them.
        required = {Requirement(line).name.replace("-", "_") for line in project["dependencies"]}
        assert not brought & required, extra
    assert Requirement(extras["all"][0]).extras == set(EXTRAS)
