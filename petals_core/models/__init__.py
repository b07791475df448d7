"""Model families (BLOOM, Falcon, LLaMA, Mixtral): blocks with our KV cache, configs,
shard-selective loading.

This package knows nothing of the network; the server and client build on it.  Its modules:

- ``llama``, ``bloom``, ``falcon``, ``mixtral``: one block module per family, with transformers'
  parameter names and one forward, whatever :class:`AttentionCache` it attends through;
- ``_cache``: ``AttentionCache`` (``KVCache`` per session, ``CacheBatch`` of several sessions,
  ``Uncached`` for training) and the position encodings (rotary, ALiBi);
- ``_families``: the block class of each ``model_type``; ``_config``: the ``Distributed*Config``
  classes and the ``dht_prefix`` rules;
- ``_loading`` (only the shards a span needs), ``_hub`` (a repo at one commit), ``_disk`` (the
  cache under a disk budget), ``_smollm2`` (the packaged GGUF as a checkpoint);
- ``_quantize`` (bitsandbytes int8 / nf4), ``_lora`` and ``_lora_loading`` (PEFT adapters);
- ``_batched`` and ``_span_steps``: several sessions' steps through one forward;
- ``_cpu_decode`` (with ``_numpy_ops``): fp32 CPU decode steps in numpy;
- ``_decode_graphs``: CUDA graphs of a span's decode step, captured per bucket and replayed,
  the blocks attending through ``_row_caches`` (each row's cache found by pointer).
"""

from ._cache import KVCache as KVCache
from ._config import (
    AutoDistributedConfig as AutoDistributedConfig,
    DistributedBloomConfig as DistributedBloomConfig,
    DistributedConfig as DistributedConfig,
    DistributedFalconConfig as DistributedFalconConfig,
    DistributedLlamaConfig as DistributedLlamaConfig,
    DistributedMixtralConfig as DistributedMixtralConfig,
    default_dht_prefix as default_dht_prefix,
    original_repo as original_repo,
)
from ._cpu_decode import CpuDecode as CpuDecode, CpuDecodeChoice as CpuDecodeChoice
from ._decode_graphs import (
    DecodeGraphs as DecodeGraphs,
    DecodeGraphsConfig as DecodeGraphsConfig,
    DecodeGraphsStatistics as DecodeGraphsStatistics,
)
from ._families import BLOCK_CLASSES as BLOCK_CLASSES, Block as Block, new_block as new_block
from ._loading import (
    block_state_dict as block_state_dict,
    client_state_dict as client_state_dict,
    load_blocks as load_blocks,
)
from ._lora import (
    LoraAdapter as LoraAdapter,
    LoraLinear as LoraLinear,
    active_adapter as active_adapter,
    adapter_names as adapter_names,
    add_adapter as add_adapter,
    using_adapter as using_adapter,
)
from ._lora_loading import (
    adapter_nbytes_per_block as adapter_nbytes_per_block,
    load_lora_adapter as load_lora_adapter,
)
from ._quantize import (
    QuantType as QuantType,
    quantize_block as quantize_block,
    quantized_linears as quantized_linears,
)
from ._smollm2 import (
    SMOLLM2_REPO_ID as SMOLLM2_REPO_ID,
    prepare_smollm2 as prepare_smollm2,
    smollm2_gguf_path as smollm2_gguf_path,
)
from ._span_steps import EagerSteps as EagerSteps, SpanSteps as SpanSteps
from .bloom import BloomBlock as BloomBlock
from .falcon import FalconBlock as FalconBlock
from .llama import LlamaBlock as LlamaBlock
from .mixtral import MixtralBlock as MixtralBlock, MixtralSparseMoE as MixtralSparseMoE
