"""The README's OpenAI examples (the curl request's body, the openai client's streaming loop) run
against the endpoint, with only its address and model name replaced."""

from __future__ import annotations

import contextlib
import io
import json
import re
import urllib.request
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## The OpenAI API"
URL = "http://127.0.0.1:8000/v1"
MODEL = "petals-core/SmolLM2-135M-Instruct"


def _section() -> str:
    text = README.read_text()
    section = text[text.index(SECTION) :]
    return section[: section.index("\n## ", len(SECTION))]


def test_the_curl_example(endpoint: Any) -> None:
    bash = re.search(r"```bash\n(.*?)```", _section(), flags=re.DOTALL)
    assert bash is not None
    command = bash.group(1)
    assert f"curl {URL}/chat/completions" in command
    body = json.loads(re.search(r"-d '(.*?)'", command, flags=re.DOTALL).group(1))  # type: ignore[union-attr]
    assert body["model"] == MODEL
    body["model"] = endpoint.repo
    request = urllib.request.Request(
        f"{endpoint.url}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        answer = json.loads(reply.read())
    assert answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] <= body["max_tokens"]


def test_the_openai_client_example(endpoint: Any) -> None:
    python = re.search(r"```python\n(.*?)```", _section(), flags=re.DOTALL)
    assert python is not None
    code = python.group(1)
    assert URL in code and MODEL in code
    code = code.replace(URL, f"{endpoint.url}/v1").replace(MODEL, endpoint.repo)
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(code, "README OpenAI example", "exec"), {"__name__": "__readme__"})
    assert output.getvalue().strip()
