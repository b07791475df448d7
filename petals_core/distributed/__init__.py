"""Hugging Face-style models whose transformer blocks run on a swarm (Petals' client classes).

``AutoDistributedModelForCausalLM.from_pretrained(name, initial_peers=[...])`` loads only the
embeddings, final norm and LM head; the blocks are a :class:`~petals_core.client.RemoteSequential`.
``generate()`` and ``with model.inference_session(max_length=...)`` work as in Petals;
``tuning_mode="ptune" | "deep_ptune"`` adds trainable prompts.  ``generate()`` takes
transformers' assisted decoding (``prompt_lookup_num_tokens=``, ``assistant_model=``): each
window of drafts is checked in one step through the swarm; ``AutoDistributedSpeculativeModel``
(``small_model=``) does it by default, as Petals' speculative classes.

This package sits above the client: importing it imports the client (the network). Nothing below
it imports it; the configs (``AutoDistributedConfig`` and the family configs, which the server
reads too) live in :mod:`petals_core.models` and are re-exported here.
"""

from ..models import (
    AutoDistributedConfig as AutoDistributedConfig,
    DistributedBloomConfig as DistributedBloomConfig,
    DistributedConfig as DistributedConfig,
    DistributedFalconConfig as DistributedFalconConfig,
    DistributedLlamaConfig as DistributedLlamaConfig,
    DistributedMixtralConfig as DistributedMixtralConfig,
)
from ._auto import (
    AutoDistributedModel as AutoDistributedModel,
    AutoDistributedModelForCausalLM as AutoDistributedModelForCausalLM,
    AutoDistributedModelForSequenceClassification as AutoDistributedModelForSequenceClassification,
)
from ._base import DistributedModelMixin as DistributedModelMixin
from ._bloom import (
    DistributedBloomForCausalLM as DistributedBloomForCausalLM,
    DistributedBloomForSequenceClassification as DistributedBloomForSequenceClassification,
    DistributedBloomModel as DistributedBloomModel,
)
from ._cache import RemoteCache as RemoteCache
from ._falcon import (
    DistributedFalconForCausalLM as DistributedFalconForCausalLM,
    DistributedFalconForSequenceClassification as DistributedFalconForSequenceClassification,
    DistributedFalconModel as DistributedFalconModel,
)
from ._heads import (
    DEFAULT_LM_HEAD_CHUNK_ROWS as DEFAULT_LM_HEAD_CHUNK_ROWS,
    ChunkedLMHead as ChunkedLMHead,
    DistributedCausalLMMixin as DistributedCausalLMMixin,
    DistributedHeadMixin as DistributedHeadMixin,
    DistributedSequenceClassificationMixin as DistributedSequenceClassificationMixin,
)
from ._llama import (
    DistributedLlamaForCausalLM as DistributedLlamaForCausalLM,
    DistributedLlamaForSequenceClassification as DistributedLlamaForSequenceClassification,
    DistributedLlamaModel as DistributedLlamaModel,
)
from ._mixtral import (
    DistributedMixtralForCausalLM as DistributedMixtralForCausalLM,
    DistributedMixtralForSequenceClassification as DistributedMixtralForSequenceClassification,
    DistributedMixtralModel as DistributedMixtralModel,
)
from ._pretrained import TuningMode as TuningMode
from ._session import RemoteInferenceSession as RemoteInferenceSession
from ._speculative import (
    AutoDistributedSpeculativeModel as AutoDistributedSpeculativeModel,
    DistributedBloomForSpeculativeGeneration as DistributedBloomForSpeculativeGeneration,
    DistributedFalconForSpeculativeGeneration as DistributedFalconForSpeculativeGeneration,
    DistributedLlamaForSpeculativeGeneration as DistributedLlamaForSpeculativeGeneration,
    DistributedMixtralForSpeculativeGeneration as DistributedMixtralForSpeculativeGeneration,
)
