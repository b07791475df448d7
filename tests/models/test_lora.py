"""PEFT-format LoRA adapters on server blocks: loading, wrapping, and per-request switching.

Adapters are written by hand in the layout ``peft`` saves (``adapter_config.json`` and
``adapter_model.safetensors`` named ``base_model.model.<module>.lora_{A,B}.weight``), with random
A and B, and every output is compared with a block whose weights were merged, ``W + s * B @ A``.
"""

from __future__ import annotations

import copy
import json
import math
import pickle
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from safetensors.torch import save_file
from torch import nn
from transformers import BloomConfig, LlamaConfig, PreTrainedConfig

from petals_core._errors import AdapterError
from petals_core.models import _lora
from petals_core.models._lora import (
    LoraAdapter,
    LoraLinear,
    active_adapter,
    adapter_names,
    add_adapter,
    load_lora_adapter,
    using_adapter,
)
from petals_core.models.bloom import BloomBlock
from petals_core.models.llama import LlamaBlock

from .conftest import HIDDEN, Hub, tiny_bloom_config, tiny_llama_config

LLAMA_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
BLOOM_LINEARS = (
    "self_attention.query_key_value",
    "self_attention.dense",
    "mlp.dense_h_to_4h",
    "mlp.dense_4h_to_h",
)
MODULE_PREFIX = {"llama": "model.layers.", "bloom": "transformer.h."}
Weights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def make_block(config: PreTrainedConfig, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    block: nn.Module
    if isinstance(config, LlamaConfig):
        block = LlamaBlock(config)
    else:
        assert isinstance(config, BloomConfig)
        block = BloomBlock(config)
    with torch.no_grad():  # norms away from 1 and biases away from 0, so that both matter
        for parameter in block.parameters():
            if parameter.dim() == 1:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return block.eval()


def write_adapter(
    folder: Path,
    config: PreTrainedConfig,
    modules: Iterable[str],
    *,
    rank: int = 4,
    alpha: float = 8.0,
    seed: int = 0,
    blocks: Iterable[int] | None = None,
    target_modules: Any = None,
    overrides: dict[str, Any] | None = None,
    suffix: str = ".weight",
) -> Weights:
    """Write an adapter as peft saves it; returns its (A, B) per (block, module path)."""
    folder.mkdir(parents=True, exist_ok=True)
    modules = tuple(modules)
    reference = make_block(config, 0)
    generator = torch.Generator().manual_seed(seed)
    prefix = MODULE_PREFIX[config.model_type]
    weights: Weights = {}
    tensors: dict[str, torch.Tensor] = {}
    for index in range(config.num_hidden_layers) if blocks is None else blocks:
        for path in modules:
            linear = reference.get_submodule(path)
            assert isinstance(linear, nn.Linear)
            a = torch.randn(rank, linear.in_features, generator=generator) * 0.1
            b = torch.randn(linear.out_features, rank, generator=generator) * 0.1
            weights[index, path] = (a, b)
            stored = f"base_model.model.{prefix}{index}.{path}"
            tensors[f"{stored}.lora_A{suffix}"] = a
            tensors[f"{stored}.lora_B{suffix}"] = b
    save_file(tensors, folder / "adapter_model.safetensors", {"format": "pt"})
    adapter_config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.05,
        "target_modules": (
            sorted({path.rsplit(".", 1)[1] for path in modules})
            if target_modules is None
            else target_modules
        ),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "base_model_name_or_path": "petals-test/tiny",
        "modules_to_save": None,
    }
    adapter_config.update(overrides or {})
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config))
    return weights


def merged(
    block: nn.Module, weights: Weights, index: int, scaling: float, modules: Iterable[str]
) -> nn.Module:
    """A copy of ``block`` whose weights hold the adapter: W + scaling * B @ A."""
    reference = copy.deepcopy(block)
    with torch.no_grad():
        for path in modules:
            a, b = weights[index, path]
            linear = reference.get_submodule(path)
            assert isinstance(linear, nn.Linear)
            linear.weight.add_(scaling * b @ a)
    return reference


def hidden(seed: int = 1, batch: int = 2, length: int = 5) -> torch.Tensor:
    return torch.randn(batch, length, HIDDEN, generator=torch.Generator().manual_seed(seed))


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture
def llama_config() -> PreTrainedConfig:
    config = tiny_llama_config()
    assert config.num_key_value_heads == 2 < config.num_attention_heads  # GQA
    return config


# --- outputs ----------------------------------------------------------------------------------


def test_llama_adapter_equals_merged_weights(tmp_path: Path, llama_config: Any) -> None:
    weights = write_adapter(tmp_path / "lora", llama_config, LLAMA_LINEARS, rank=4, alpha=8.0)
    adapter = load_lora_adapter(tmp_path / "lora", config=llama_config, block_indices=[2, 3])
    assert adapter.name == str(tmp_path / "lora")
    assert adapter.rank == 4 and adapter.scaling == 2.0
    assert adapter.target_modules == frozenset(LLAMA_LINEARS)
    assert sorted(adapter.weights) == [2, 3]
    for path in LLAMA_LINEARS:
        for got, wrote in zip(adapter.weights[3][path], weights[3, path], strict=True):
            assert torch.equal(got, wrote)

    block = make_block(llama_config, 5)
    base = copy.deepcopy(block)
    reference = merged(block, weights, 3, 2.0, LLAMA_LINEARS)
    add_adapter(block, adapter, 3)
    assert adapter_names(block) == {adapter.name}
    assert isinstance(block.get_submodule("mlp.down_proj"), LoraLinear)
    x = hidden()
    with torch.no_grad():
        with using_adapter(adapter.name):
            assert active_adapter() == adapter.name
            assert_close(block(x), reference(x))
            # The cache path too: q/k/v go through the wrapped layers into append_rotated.
            cache = block.allocate_cache(2, 16)  # type: ignore[operator]
            expected_cache = reference.allocate_cache(2, 16)  # type: ignore[operator]
            assert_close(block(x, cache=cache), reference(x, cache=expected_cache))
            assert_close(block(x[:, :1], cache=cache), reference(x[:, :1], cache=expected_cache))
        assert active_adapter() is None
        assert_close(block(x), base(x))
        assert not torch.allclose(base(x), reference(x), atol=1e-3)  # the adapter does matter


def test_bloom_adapter_with_regex_targets_and_default_names(
    tmp_path: Path,
) -> None:
    config = tiny_bloom_config()
    modules = ("self_attention.query_key_value", "mlp.dense_4h_to_h")
    weights = write_adapter(
        tmp_path / "lora",
        config,
        modules,
        rank=2,
        alpha=5.0,
        target_modules=r".*\.(query_key_value|dense_4h_to_h)",
        suffix=".default.weight",  # how peft names the weights of an adapter in memory
    )
    adapter = load_lora_adapter(tmp_path / "lora", config=config, block_indices=range(4, 6))
    assert adapter.target_modules == frozenset(modules)
    assert adapter.scaling == 2.5
    block = make_block(config, 6)
    reference = merged(block, weights, 5, 2.5, modules)
    base = copy.deepcopy(block)
    add_adapter(block, adapter, 5)
    x = hidden()
    with torch.no_grad():
        with using_adapter(adapter.name):
            assert_close(block(x), reference(x))
        assert_close(block(x), base(x))


def test_two_adapters_on_one_block_switch(tmp_path: Path, llama_config: Any) -> None:
    attn = ("self_attn.q_proj", "self_attn.v_proj")
    mlp = ("mlp.up_proj", "mlp.down_proj", "self_attn.q_proj")
    weights_a = write_adapter(tmp_path / "a", llama_config, attn, seed=1)
    weights_b = write_adapter(tmp_path / "b", llama_config, mlp, rank=3, alpha=6.0, seed=2)
    adapter_a = load_lora_adapter(tmp_path / "a", config=llama_config, block_indices=[1])
    adapter_b = load_lora_adapter(tmp_path / "b", config=llama_config, block_indices=[1])
    block = make_block(llama_config, 7)
    base = copy.deepcopy(block)
    reference_a = merged(block, weights_a, 1, 2.0, attn)
    reference_b = merged(block, weights_b, 1, 2.0, mlp)
    add_adapter(block, adapter_a, 1)
    add_adapter(block, adapter_b, 1)
    assert adapter_names(block) == {adapter_a.name, adapter_b.name}
    q_proj = block.get_submodule("self_attn.q_proj")
    assert isinstance(q_proj, LoraLinear)
    assert type(q_proj.base) is nn.Linear  # wrapped once, not twice
    assert q_proj.adapter_names() == {adapter_a.name, adapter_b.name}
    k_proj = block.get_submodule("self_attn.k_proj")
    assert type(k_proj) is nn.Linear  # targeted by neither

    x = hidden()
    with torch.no_grad():
        for _ in range(2):
            with using_adapter(adapter_a.name):
                assert_close(block(x), reference_a(x))
                with using_adapter(adapter_b.name):
                    assert_close(block(x), reference_b(x))
                    with using_adapter(None):
                        assert_close(block(x), base(x))
                assert_close(block(x), reference_a(x))
            assert_close(block(x), base(x))

    with pytest.raises(AdapterError, match="already holds adapter"):
        add_adapter(block, adapter_a, 1)


def test_rslora_scales_by_the_square_root_of_the_rank(tmp_path: Path, llama_config: Any) -> None:
    modules = ("self_attn.o_proj", "mlp.gate_proj")
    weights = write_adapter(
        tmp_path / "lora",
        llama_config,
        modules,
        rank=4,
        alpha=6.0,
        overrides={"use_rslora": True},
    )
    adapter = load_lora_adapter(tmp_path / "lora", config=llama_config, block_indices=[0])
    assert adapter.scaling == 6.0 / math.sqrt(4)
    block = make_block(llama_config, 8)
    reference = merged(block, weights, 0, 3.0, modules)
    add_adapter(block, adapter, 0)
    x = hidden()
    with torch.no_grad(), using_adapter(adapter.name):
        assert_close(block(x), reference(x))


def test_adapter_weights_take_the_block_dtype_and_compute_in_the_input_dtype(
    tmp_path: Path, llama_config: Any
) -> None:
    modules = ("self_attn.q_proj",)
    weights = write_adapter(tmp_path / "lora", llama_config, modules)
    adapter = load_lora_adapter(
        tmp_path / "lora", config=llama_config, block_indices=[0], dtype=torch.float64
    )
    assert adapter.weights[0]["self_attn.q_proj"][0].dtype == torch.float64
    block = make_block(llama_config, 9).to(torch.bfloat16)
    add_adapter(block, adapter, 0)
    layer = block.get_submodule("self_attn.q_proj")
    assert isinstance(layer, LoraLinear)
    assert all(buffer.dtype == torch.bfloat16 for buffer in layer.buffers())
    a, b = (t.to(torch.bfloat16) for t in weights[0, "self_attn.q_proj"])
    x = hidden().to(torch.bfloat16)
    with torch.no_grad(), using_adapter(adapter.name):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, layer.base(x) + (x @ a.T @ b.T) * 2.0)


def test_a_block_the_adapter_does_not_transform_runs_the_base(
    tmp_path: Path, llama_config: Any
) -> None:
    write_adapter(
        tmp_path / "lora",
        llama_config,
        ("self_attn.q_proj",),
        blocks=[1, 2],
        overrides={"layers_to_transform": [1, 2]},
    )
    adapter = load_lora_adapter(tmp_path / "lora", config=llama_config, block_indices=[0, 1])
    assert adapter.weights[0] == {}
    block = make_block(llama_config, 10)
    base = copy.deepcopy(block)
    add_adapter(block, adapter, 0)
    assert adapter_names(block) == {adapter.name}
    x = hidden()
    with torch.no_grad(), using_adapter(adapter.name):
        assert_close(block(x), base(x))


def test_unknown_active_adapter_raises(tmp_path: Path, llama_config: Any) -> None:
    write_adapter(tmp_path / "lora", llama_config, ("self_attn.v_proj",))
    adapter = load_lora_adapter(tmp_path / "lora", config=llama_config, block_indices=[0])
    block = make_block(llama_config, 11)
    add_adapter(block, adapter, 0)
    with using_adapter("nobody/nothing"), pytest.raises(AdapterError) as raised:
        block(hidden())
    message = str(raised.value)
    assert "unknown adapter 'nobody/nothing'" in message
    assert repr(adapter.name) in message
    # A wrapped layer run on its own says the same.
    with using_adapter("nobody/nothing"), pytest.raises(AdapterError, match="unknown adapter"):
        block.get_submodule("self_attn.v_proj")(hidden())


async def test_using_adapter_inside_a_worker_thread(tmp_path: Path, llama_config: Any) -> None:
    modules = ("self_attn.k_proj", "mlp.up_proj")
    weights = write_adapter(tmp_path / "lora", llama_config, modules)
    adapter = load_lora_adapter(tmp_path / "lora", config=llama_config, block_indices=[4])
    block = make_block(llama_config, 12)
    base = copy.deepcopy(block)
    reference = merged(block, weights, 4, 2.0, modules)
    add_adapter(block, adapter, 4)
    x = hidden()

    def compute(name: str | None) -> torch.Tensor:
        with torch.no_grad(), using_adapter(name):
            out: torch.Tensor = block(x)
            return out

    with trio.fail_after(60):
        with_adapter = await trio.to_thread.run_sync(compute, adapter.name)
        without = await trio.to_thread.run_sync(compute, None)
    assert active_adapter() is None
    with torch.no_grad():
        assert_close(with_adapter, reference(x))
        assert_close(without, base(x))


def test_wraps_a_bitsandbytes_int8_linear(tmp_path: Path, llama_config: Any) -> None:
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.nn import Linear8bitLt

    from petals_core.models._quantize import quantize_block

    modules = ("mlp.down_proj",)
    weights = write_adapter(tmp_path / "lora", llama_config, modules)
    adapter = load_lora_adapter(tmp_path / "lora", config=llama_config, block_indices=[0])
    block = quantize_block(make_block(llama_config, 13), "int8")
    add_adapter(block, adapter, 0)
    layer = block.get_submodule("mlp.down_proj")
    assert isinstance(layer, LoraLinear) and isinstance(layer.base, Linear8bitLt)
    a, b = weights[0, "mlp.down_proj"]
    x = torch.randn(
        2, 3, llama_config.intermediate_size, generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        plain = layer(x)
        with using_adapter(adapter.name):
            adapted = layer(x)
    assert_close(adapted, plain + (x @ a.T @ b.T) * 2.0)


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
    real_safe_open = _lora.safe_open

    class SpyOpen:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._opened = real_safe_open(*args, **kwargs)

        def __enter__(self) -> _SpyFile:
            return _SpyFile(self._opened.__enter__(), read)

        def __exit__(self, *exc: object) -> None:
            self._opened.__exit__(*exc)

    monkeypatch.setattr(_lora, "safe_open", SpyOpen)
    adapter = load_lora_adapter(tmp_path / "lora", config=llama_config, block_indices=[1, 4])
    assert sorted(adapter.weights) == [1, 4]
    assert len(read) == 2 * 2 * len(LLAMA_LINEARS)
    assert all(".layers.1." in name or ".layers.4." in name for name in read)


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


def test_shape_mismatch_is_refused_and_leaves_the_block_alone(
    tmp_path: Path, llama_config: Any
) -> None:
    write_adapter(tmp_path / "lora", llama_config, ("self_attn.q_proj", "mlp.gate_proj"))
    adapter = load_lora_adapter(tmp_path / "lora", config=llama_config, block_indices=[0])
    other = make_block(tiny_llama_config(intermediate_size=96), 14)
    with pytest.raises(AdapterError, match=r"'mlp.gate_proj'.*\(128, 4\).*\(96, 4\)"):
        add_adapter(other, adapter, 0)
    assert adapter_names(other) == frozenset()
    assert not any(isinstance(module, LoraLinear) for module in other.modules())

    with pytest.raises(AdapterError, match=r"loaded for blocks \[0\], not block 1"):
        add_adapter(make_block(llama_config, 14), adapter, 1)


def test_adapter_of_one_family_does_not_fit_another(tmp_path: Path, llama_config: Any) -> None:
    write_adapter(tmp_path / "lora", llama_config, ("self_attn.q_proj",))
    adapter = load_lora_adapter(tmp_path / "lora", config=llama_config, block_indices=[0])
    with pytest.raises(AdapterError, match="has no such module"):
        add_adapter(make_block(tiny_bloom_config(), 0), adapter, 0)


def test_lora_adapter_validates_its_weights() -> None:
    with pytest.raises(AdapterError, match="r=2"):
        LoraAdapter(
            name="x",
            rank=2,
            scaling=1.0,
            target_modules=frozenset({"m"}),
            weights={0: {"m": (torch.zeros(3, 4), torch.zeros(5, 3))}},
        )


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
