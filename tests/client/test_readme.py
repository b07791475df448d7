"""The README's Python examples run as written, against a swarm of our own: only the lines
naming the swarm (``INITIAL_PEERS = ...``) and the model (``MODEL = ...``) are replaced."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .._served_swarm import ServedModel

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## Using a swarm from Python"


def examples() -> list[str]:
    text = README.read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def test_the_readme_has_three_examples() -> None:
    assert len(examples()) == 3


@pytest.mark.parametrize("index", range(3))
def test_readme_example_runs(index: int, served_llama: ServedModel) -> None:
    code = examples()[index]
    code, peers = re.subn(
        r"^INITIAL_PEERS = .*$",
        f"INITIAL_PEERS = {list(served_llama.initial_peers)!r}",
        code,
        flags=re.MULTILINE,
    )
    code, models = re.subn(
        r"^MODEL = .*$", f"MODEL = {str(served_llama.folder)!r}", code, flags=re.MULTILINE
    )
    assert (peers, models) == (1, 1)
    exec(compile(code, f"README example {index + 1}", "exec"), {"__name__": "__readme__"})
