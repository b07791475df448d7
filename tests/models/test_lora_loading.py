"""Loading PEFT-format LoRA adapters: only the requested blocks' tensors are read, anything a
server cannot apply is refused with a clear error, and Hub repos load like folders.

Adapters are written by hand (``write_adapter`` in ``test_lora``), in the layout ``peft`` saves.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from petals_core._errors import AdapterError
from petals_core.models import _lora_loading
from petals_core.models._lora import add_adapter, using_adapter
from petals_core.models._lora_loading import load_lora_adapter

from .conftest import HIDDEN, Hub
from .test_lora import (
    LLAMA_LINEARS,
    Weights,
    assert_close,
    hidden,
    make_block,
    merged,
    write_adapter,
)

# --- what is read -----------------------------------------------------------------------------


class _SpyFile:
    def __init__(self, file: Any, read: list[str]) -> None:
        self._file, self._read = file, read

    def keys(self) -> list[str]:
        keys: list[str] = self._file.keys()
        return keys

    def get_tensor(self, name: str) -> torch.Tensor:
        self._read.append(name)
        tensor: torch.Tensor = self._file.get_tensor(name)
        return tensor


def test_only_the_requested_blocks_tensors_are_read(
    tmp_path: Path, llama_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spy around safetensors' reader (which still reads the file) logs every tensor read."""
    write_adapter(tmp_path / "lora", llama_config, LLAMA_LINEARS)
    read: list[str] = []
    real_safe_open = _lora_loading.safe_open

    class SpyOpen:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._opened = real_safe_open(*args, **kwargs)

        def __enter__(self) -> _SpyFile:
            return _SpyFile(self._opened.__enter__(), read)

        def __exit__(self, *exc: object) -> None:
            self._opened.__exit__(*exc)

    monkeypatch.setattr(_lora_loading, "safe_open", SpyOpen)
    adapter = load_lora_adapter(tmp_path / "lora", config=llama_config, block_indices=[1, 4])
    assert sorted(adapter.weights) == [1, 4]
    assert len(read) == 2 * 2 * len(LLAMA_LINEARS)
    assert all(".layers.1." in name or ".layers.4." in name for name in read)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_memory_an_adapter_adds_to_a_block_is_what_its_weights_take(
    tmp_path: Path, llama_config: Any, dtype: torch.dtype
) -> None:
    """What a server counts per block before choosing how many blocks fit: the most any block's
    loaded weights take, read off the adapter's config (rank 8 on every projection)."""
    write_adapter(tmp_path / "lora", llama_config, LLAMA_LINEARS, rank=8)
    nbytes = _lora_loading.adapter_nbytes_per_block(
        tmp_path / "lora", config=llama_config, dtype=dtype
    )
    blocks = range(llama_config.num_hidden_layers)
    adapter = load_lora_adapter(
        tmp_path / "lora", config=llama_config, block_indices=blocks, dtype=dtype
    )
    loaded = [
        sum(a.nbytes + b.nbytes for a, b in adapter.weights[index].values()) for index in blocks
    ]
    assert nbytes == max(loaded) > 0


# --- refusals ---------------------------------------------------------------------------------


class _Booby:
    """Unpickling this would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return (Path.touch, (self.marker,))


def test_pickled_adapter_is_refused_without_unpickling(tmp_path: Path, llama_config: Any) -> None:
    folder = tmp_path / "lora"
    write_adapter(folder, llama_config, ("self_attn.q_proj",))
    (folder / "adapter_model.safetensors").unlink()
    marker = tmp_path / "unpickled"
    (folder / "adapter_model.bin").write_bytes(pickle.dumps(_Booby(marker)))
    with pytest.raises(AdapterError, match=r"adapter_model\.bin.*unpickling runs arbitrary code"):
        load_lora_adapter(folder, config=llama_config, block_indices=[0])
    assert not marker.exists()


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(config: dict[str, Any]) -> None:
        config[key] = value

    return edit


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda config: config.pop(key)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_set("peft_type", "PREFIX_TUNING"), "only 'LORA'"),
        (_set("bias", "all"), "bias is 'all'"),
        (_set("fan_in_fan_out", True), "fan_in_fan_out"),
        (_set("use_dora", True), "DoRA"),
        (_set("r", 0), "r must be a positive integer"),
        (_drop("lora_alpha"), "lora_alpha must be a finite number"),
        (_set("target_modules", ["q_proj", "c_attn"]), r"unknown target modules \['c_attn'\]"),
        (_set("target_modules", r".*\.c_attn"), "matches no module"),
        (_set("target_modules", 7), "target_modules must be"),
        (_set("rank_pattern", {"q_proj": 8}), "rank_pattern"),
        (_set("layers_to_transform", "all"), "layers_to_transform"),
    ],
)
def test_bad_config_is_refused(
    tmp_path: Path,
    llama_config: Any,
    edit: Callable[[dict[str, Any]], None],
    match: str,
) -> None:
    folder = tmp_path / "lora"
    write_adapter(folder, llama_config, ("self_attn.q_proj",))
    config = json.loads((folder / "adapter_config.json").read_text())
    edit(config)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match=match):
        load_lora_adapter(folder, config=llama_config, block_indices=[0])


def test_config_that_is_not_json_or_missing_is_refused(tmp_path: Path, llama_config: Any) -> None:
    folder = tmp_path / "lora"
    write_adapter(folder, llama_config, ("self_attn.q_proj",))
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not valid JSON"):
        load_lora_adapter(folder, config=llama_config, block_indices=[0])
    (folder / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
        load_lora_adapter(folder, config=llama_config, block_indices=[0])


def _rewrite_tensors(
    folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]
) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = load_file(folder / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "adapter_model.safetensors")
    return tensors


Q = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda t: t.pop(f"{Q}.lora_B.weight"), "lacks lora_B"),
        (
            lambda t: t.update({f"{Q}.lora_A.weight": torch.zeros(3, HIDDEN)}),
            r"lora_A is \(3, 64\).*r=4",
        ),
        (
            lambda t: t.update({Q.replace("q_proj", "k_proj") + ".lora_A.weight": torch.zeros(4)}),
            r"\['self_attn.k_proj'\], which the config does not target",
        ),
        (
            lambda t: t.update({Q.replace("q_proj", "rotary") + ".lora_A.weight": torch.zeros(4)}),
            "unknown modules",
        ),
        (lambda t: t.update({f"{Q}.lora_B.bias": torch.zeros(4)}), "not a LoRA weight"),
        (
            lambda t: t.update({f"{Q}.lora_A.default.weight": torch.zeros(4, HIDDEN)}),
            "hold the same weight",
        ),
        (
            lambda t: t.update({f"{Q}.lora_A.weight": torch.zeros(4, HIDDEN, dtype=torch.int8)}),
            "not floating point",
        ),
    ],
)
def test_bad_weights_are_refused(
    tmp_path: Path,
    llama_config: Any,
    edit: Callable[[dict[str, torch.Tensor]], None],
    match: str,
) -> None:
    folder = tmp_path / "lora"
    write_adapter(folder, llama_config, ("self_attn.q_proj",))
    _rewrite_tensors(folder, edit)
    with pytest.raises(AdapterError, match=match):
        load_lora_adapter(folder, config=llama_config, block_indices=[0])


def test_unknown_family_and_block_out_of_range_are_refused(
    tmp_path: Path, llama_config: Any
) -> None:
    write_adapter(tmp_path / "lora", llama_config, ("self_attn.q_proj",))
    with pytest.raises(AdapterError, match="out of range"):
        load_lora_adapter(tmp_path / "lora", config=llama_config, block_indices=[6])
    from transformers import GPT2Config

    with pytest.raises(AdapterError, match="model_type 'gpt2'"):
        load_lora_adapter(tmp_path / "lora", config=GPT2Config(), block_indices=[0])


# --- through the Hub --------------------------------------------------------------------------


LORA_REPO = "petals-test/llama-lora"


@pytest.fixture
def served(hub: Hub, tmp_path: Path, llama_config: Any) -> Weights:
    weights = write_adapter(tmp_path / "repo", llama_config, ("self_attn.q_proj", "mlp.up_proj"))
    hub.server.serve(LORA_REPO, tmp_path / "repo")
    return weights


def test_loads_from_a_hub_repo(
    hub: Hub, served: Weights, llama_config: Any, tmp_path: Path
) -> None:
    adapter = load_lora_adapter(
        LORA_REPO, config=llama_config, block_indices=[2], cache_dir=hub.cache_dir
    )
    assert adapter.name == LORA_REPO
    assert hub.server.count("GET", LORA_REPO) == {
        "adapter_config.json": 1,
        "adapter_model.safetensors": 1,
    }
    for path in ("self_attn.q_proj", "mlp.up_proj"):
        for got, wrote in zip(adapter.weights[2][path], served[2, path], strict=True):
            assert torch.equal(got, wrote)
    block = make_block(llama_config, 15)
    reference = merged(block, served, 2, 2.0, ("self_attn.q_proj", "mlp.up_proj"))
    add_adapter(block, adapter, 2)
    x = hidden()
    with torch.no_grad(), using_adapter(LORA_REPO):
        assert_close(block(x), reference(x))

    # Cached: offline, it loads again without the Hub.
    hub.server.clear_log()
    again = load_lora_adapter(
        LORA_REPO,
        config=llama_config,
        block_indices=[2],
        cache_dir=hub.cache_dir,
        local_files_only=True,
    )
    assert hub.server.requests == []
    assert torch.equal(again.weights[2]["mlp.up_proj"][1], served[2, "mlp.up_proj"][1])


def test_hub_failures_are_adapter_errors(hub: Hub, tmp_path: Path, llama_config: Any) -> None:
    with pytest.raises(AdapterError, match="no such repo"):
        load_lora_adapter(
            "petals-test/missing", config=llama_config, block_indices=[0], cache_dir=hub.cache_dir
        )
    folder = tmp_path / "pickled"
    write_adapter(folder, llama_config, ("self_attn.q_proj",))
    (folder / "adapter_model.safetensors").unlink()
    (folder / "adapter_model.bin").write_bytes(b"not even a pickle")
    hub.server.serve("petals-test/pickled", folder)
    with pytest.raises(AdapterError, match=r"adapter_model\.bin"):
        load_lora_adapter(
            "petals-test/pickled", config=llama_config, block_indices=[0], cache_dir=hub.cache_dir
        )
    assert hub.server.count("GET", "petals-test/pickled")["adapter_model.bin"] == 0


def test_unreadable_weights_file_is_refused(tmp_path: Path, llama_config: Any) -> None:
    folder = tmp_path / "lora"
    write_adapter(folder, llama_config, ("self_attn.q_proj",))
    (folder / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(AdapterError, match="cannot be read"):
        load_lora_adapter(folder, config=llama_config, block_indices=[0])
