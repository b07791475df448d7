"""Code run in fresh interpreters, many at a time.

What an import loads, or whether a name imports at all, must be seen from an interpreter that has
imported nothing of the package yet.  Starting one per check costs seconds of imports of torch and
transformers each time; :func:`run_fresh` starts one driver process that imports only
``preload`` (third-party modules, never the package itself) and forks a child per snippet: each
child starts from that state, with no module of the package loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence

import attrs

__all__ = ["MODEL_STACK", "Fresh", "run_fresh"]

#: What the package's model code and root imports load from other projects.
MODEL_STACK = (
    "numpy",
    "torch",
    "safetensors.torch",
    "huggingface_hub",
    "transformers",
    "transformers.modeling_utils",
    "transformers.generation",
    "transformers.models.auto",
    "transformers.models.llama.modeling_llama",
    "transformers.models.bloom.modeling_bloom",
    "transformers.models.falcon.modeling_falcon",
    "transformers.models.mixtral.modeling_mixtral",
)

_DRIVER = """
import importlib, json, os, sys, tempfile, traceback
task = json.loads(sys.stdin.read())
for name in task["preload"]:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m == "petals_core" or m.startswith("petals_core.")
    or any(m == w or m.startswith(w + ".") for w in task["absent"]))
if loaded:
    sys.exit(f"the preload loaded {loaded}")
results = {}
folder = tempfile.mkdtemp()
for number, (key, code) in enumerate(task["snippets"].items()):
    paths = [os.path.join(folder, f"{number}.{stream}") for stream in ("out", "err")]
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for fd, path in zip((1, 2), paths):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        status = 0
        try:
            exec(compile(code, key, "exec"), {"__name__": "__main__"})
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    _, status = os.waitpid(pid, 0)
    out, err = (open(path).read() for path in paths)
    results[key] = {"status": os.waitstatus_to_exitcode(status), "out": out, "err": err}
print(json.dumps(results))
"""


@attrs.frozen
class Fresh:
    """What a snippet did: its exit status and what it wrote."""

    status: int
    out: str
    err: str

    def check(self) -> str:
        """The snippet's standard output; fails with its traceback if it raised."""
        assert self.status == 0, f"exit status {self.status}:\n{self.err}"
        return self.out


def run_fresh(
    snippets: Mapping[str, str],
    *,
    preload: Sequence[str] = (),
    absent: Sequence[str] = (),
    timeout: float = 300,
) -> dict[str, Fresh]:
    """Each snippet run as ``__main__`` in a child of a process that has imported ``preload``
    only; ``absent`` (module names) must not have been loaded by ``preload``."""
    task = {"snippets": dict(snippets), "preload": list(preload), "absent": list(absent)}
    result = subprocess.run(
        [sys.executable, "-c", _DRIVER],
        input=json.dumps(task),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise AssertionError(f"the driver failed ({result.returncode}):\n{result.stderr}")
    return {key: Fresh(**answer) for key, answer in json.loads(result.stdout).items()}
