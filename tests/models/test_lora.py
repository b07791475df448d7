"""PEFT-format LoRA adapters on server blocks: loading, wrapping, and per-request switching.

Adapters are written by hand in the layout ``peft`` saves (``adapter_config.json`` and
``adapter_model.safetensors`` named ``base_model.model.<module>.lora_{A,B}.weight``), with random
A and B, and every output is compared with a block whose weights were merged, ``W + s * B @ A``.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedConfig

from petals_core._errors import AdapterError
from petals_core.models import new_block
from petals_core.models._lora import (
    LoraAdapter,
    LoraLinear,
    active_adapter,
    adapter_names,
    add_adapter,
    using_adapter,
)
from petals_core.models._lora_loading import load_lora_adapter
from petals_core.testing import tiny_falcon_config, tiny_mixtral_config

from .conftest import HIDDEN, tiny_bloom_config, tiny_llama_config

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
FALCON_LINEARS = BLOOM_LINEARS  # the same names, in the same places
MODULE_PREFIX = {
    "llama": "model.layers.",
    "bloom": "transformer.h.",
    "falcon": "transformer.h.",
    "mixtral": "model.layers.",
}
Weights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def make_block(config: PreTrainedConfig, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    block: nn.Module = new_block(config)
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


def adapted_blocks(
    config: PreTrainedConfig,
    seed: int,
    adapter: LoraAdapter,
    weights: Weights,
    index: int,
    modules: Iterable[str],
) -> tuple[nn.Module, nn.Module, nn.Module]:
    """A random block as block ``index`` with ``adapter`` added, the same block with the adapter
    merged into its weights, and the block without it."""
    block = make_block(config, seed)
    reference = merged(block, weights, index, adapter.scaling, modules)
    base = copy.deepcopy(block)
    add_adapter(block, adapter, index)
    return block, reference, base


def check_merged(
    adapter: LoraAdapter, block: nn.Module, reference: nn.Module, base: nn.Module
) -> None:
    """With the adapter active, ``block`` equals ``reference`` (the merged weights) without a
    cache, on a prefill and on a decode step; without it, ``base``."""
    x = hidden()
    with torch.no_grad():
        with using_adapter(adapter.name):
            assert_close(block(x), reference(x))
            cache = block.allocate_cache(2, 16)  # type: ignore[operator]
            expected_cache = reference.allocate_cache(2, 16)  # type: ignore[operator]
            assert_close(block(x, cache=cache), reference(x, cache=expected_cache))
            assert_close(block(x[:, :1], cache=cache), reference(x[:, :1], cache=expected_cache))
        assert_close(block(x), base(x))
        assert not torch.allclose(base(x), reference(x), atol=1e-3)  # the adapter does matter


def hidden(seed: int = 1, batch: int = 2, length: int = 5) -> torch.Tensor:
    return torch.randn(batch, length, HIDDEN, generator=torch.Generator().manual_seed(seed))


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


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
    block, reference, base = adapted_blocks(config, 6, adapter, weights, 5, modules)
    x = hidden()
    with torch.no_grad():
        with using_adapter(adapter.name):
            assert_close(block(x), reference(x))
        assert_close(block(x), base(x))


@pytest.mark.parametrize(
    "config",
    [tiny_falcon_config(), tiny_falcon_config(multi_query=True, new_decoder_architecture=False)],
    ids=["falcon-40b-layout", "falcon-7b-layout"],
)
def test_falcon_adapter_equals_merged_weights_with_and_without_a_cache(
    tmp_path: Path, config: PreTrainedConfig
) -> None:
    weights = write_adapter(tmp_path / "lora", config, FALCON_LINEARS, rank=4, alpha=4.0)
    adapter = load_lora_adapter(tmp_path / "lora", config=config, block_indices=[1])
    assert adapter.target_modules == frozenset(FALCON_LINEARS)
    check_merged(adapter, *adapted_blocks(config, 7, adapter, weights, 1, FALCON_LINEARS))


def test_mixtral_adapter_on_attention_router_and_experts(tmp_path: Path) -> None:
    """PEFT's names for Mixtral: the attention's projections, the router (``gate``) and each
    expert's ``w1``/``w2``/``w3``; a list of short names selects them in every expert."""
    config = tiny_mixtral_config(num_local_experts=4)
    modules = (
        "self_attn.q_proj",
        "self_attn.v_proj",
        "block_sparse_moe.gate",
        *(f"block_sparse_moe.experts.{e}.{w}" for e in range(4) for w in ("w1", "w2", "w3")),
    )
    weights = write_adapter(
        tmp_path / "lora",
        config,
        modules,
        rank=2,
        alpha=4.0,
        target_modules=["q_proj", "v_proj", "gate", "w1", "w2", "w3"],
    )
    adapter = load_lora_adapter(tmp_path / "lora", config=config, block_indices=[2])
    assert adapter.target_modules == frozenset(modules)
    check_merged(adapter, *adapted_blocks(config, 8, adapter, weights, 2, modules))
    write_adapter(tmp_path / "bad", config, (), target_modules=["w4"])
    with pytest.raises(AdapterError, match=r"unknown target modules \['w4'\] for Mixtral"):
        load_lora_adapter(tmp_path / "bad", config=config, block_indices=[0])


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
