"""The heads over a distributed base model: the causal LM (``generate()``) and the classifier.

One implementation serves every family: :class:`DistributedHeadMixin` builds the family's base
model under transformers' ``base_model_prefix`` (``model.``, ``transformer.``) and holds the one
``forward`` of both heads; :class:`DistributedCausalLMMixin` adds the chunked LM head, the loss and
``generate()`` as steps of an inference session, :class:`DistributedSequenceClassificationMixin`
the ``score`` head over the last non-pad token.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, ClassVar, cast

import attrs
import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast, SequenceClassifierOutputWithPast
from transformers.utils import ModelOutput

from .. import kernels
from .._errors import ConfigError
from .._hf_compat import CACHE_ARG, cache_kwargs
from ..client import SequenceManagerConfig
from ._base import DistributedModelMixin
from ._cache import RemoteCache
from ._pretrained import FromPretrainedMixin
from ._session import RemoteInferenceSession
from ._shared_matmul import SharedMatmul

if TYPE_CHECKING:
    from transformers import GenerationConfig

__all__ = [
    "DEFAULT_LM_HEAD_CHUNK_ROWS",
    "ChunkedLMHead",
    "DistributedCausalLMMixin",
    "DistributedHeadMixin",
    "DistributedSequenceClassificationMixin",
    "HeadInputs",
]

#: Where ``generate()`` (in this thread or task) keeps the session it opened for the call.
_GENERATION_STACK: ContextVar[contextlib.ExitStack | None] = ContextVar(
    "petals_core_generation_stack", default=None
)

#: Vocabulary rows per matmul of the LM head.
DEFAULT_LM_HEAD_CHUNK_ROWS = 8192
#: Up to this many rows of hidden states, the LM head is one matmul (chunks save nothing there).
_UNCHUNKED_ROWS = 16


class ChunkedLMHead(nn.Module):
    """``hidden @ weight.T`` computed ``chunk_rows`` vocabulary rows at a time.

    Each logit is the same dot product as in one big matmul; chunking only bounds the temporary
    memory of one matmul, which matters for large vocabularies on CPU clients. ``weight`` is
    ``(vocab, hidden)``, as in ``nn.Linear`` (and shared with the embeddings when tied).
    """

    def __init__(
        self, hidden_size: int, vocab_size: int, *, chunk_rows: int = DEFAULT_LM_HEAD_CHUNK_ROWS
    ) -> None:
        super().__init__()
        if chunk_rows < 1:
            raise ConfigError(f"chunk_rows must be >= 1, got {chunk_rows}")
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.chunk_rows = chunk_rows
        #: Set (``share_across_threads()``): decode steps of threads that arrive together share
        #: one matmul. Their logits may then differ from separate ones in the last bits.
        self.shared: SharedMatmul | None = None

    def share_across_threads(self, enabled: bool = True) -> None:
        """Let concurrent decode steps of several threads (without autograd) share one matmul
        (see ``_shared_matmul``); a thread alone computes at once, as before."""
        self.shared = SharedMatmul() if enabled else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight  # (vocab, hidden)
        hidden_states = hidden_states.to(weight.dtype)
        rows = hidden_states.numel() // max(1, hidden_states.shape[-1])
        if self.shared is not None and rows <= _UNCHUNKED_ROWS and not torch.is_grad_enabled():
            flat = hidden_states.reshape(rows, hidden_states.shape[-1])
            logits = self.shared(flat, lambda x: kernels.linear(x, weight))
            return logits.reshape(*hidden_states.shape[:-1], weight.shape[0])
        if weight.shape[0] <= self.chunk_rows or rows <= _UNCHUNKED_ROWS:
            # A few rows (decoding) need no bound: one matmul is the fastest.
            return kernels.linear(hidden_states, weight)
        chunks = [
            kernels.linear(hidden_states, weight[start : start + self.chunk_rows])
            for start in range(0, weight.shape[0], self.chunk_rows)
        ]
        return torch.cat(chunks, dim=-1)  # (..., vocab)

    def extra_repr(self) -> str:
        vocab, hidden = self.weight.shape
        return f"hidden={hidden}, vocab={vocab}, chunk_rows={self.chunk_rows}"


@attrs.frozen(kw_only=True, eq=False)
class HeadInputs:
    """What a head's forward was given besides what the base model takes."""

    input_ids: torch.Tensor | None
    labels: torch.Tensor | None
    logits_to_keep: int | torch.Tensor
    #: Further keyword arguments of ``forward``, for the loss (``num_items_in_batch``, ...).
    loss_kwargs: dict[str, Any]


class DistributedHeadMixin(FromPretrainedMixin, nn.Module):
    """A head over a distributed base model: what the causal LM and the classifier share.

    A family class names its base model class in ``base_model_class``; it is built under
    transformers' ``base_model_prefix`` (``self.model``, ``self.transformer``), so that the
    checkpoint's tensor names fit. Subclasses build their head in ``__init__`` and compute it in
    :meth:`head_outputs`.
    """

    config: Any
    #: The family's base model (``DistributedLlamaModel``, ``DistributedBloomModel``).
    base_model_class: ClassVar[type[DistributedModelMixin]]

    def __init__(
        self, config: Any, *, sequence_manager_config: SequenceManagerConfig | None = None
    ) -> None:
        super().__init__(config)  # the family's *PreTrainedModel
        base = self.base_model_class(config, sequence_manager_config=sequence_manager_config)
        setattr(self, self.base_model_prefix, base)

    @property
    def distributed_base(self) -> DistributedModelMixin:
        base = getattr(self, self.base_model_prefix)
        assert isinstance(base, DistributedModelMixin)
        return base

    def get_input_embeddings(self) -> nn.Embedding:
        return self.distributed_base.get_input_embeddings()

    def inference_session(self, max_length: int, **kwargs: Any) -> RemoteInferenceSession:
        """See :meth:`DistributedModelMixin.inference_session`."""
        return self.distributed_base.inference_session(max_length, **kwargs)

    def use_session(
        self, session: RemoteInferenceSession
    ) -> contextlib.AbstractContextManager[RemoteInferenceSession]:
        return self.distributed_base.use_session(session)

    @property
    def active_session(self) -> RemoteInferenceSession | None:
        return self.distributed_base.active_session

    def shutdown(self) -> None:
        self.distributed_base.shutdown()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: RemoteCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: RemoteCache | None = None,
        **kwargs: Any,
    ) -> ModelOutput | tuple[Any, ...]:
        """As transformers' ``*ForCausalLM.forward`` / ``*ForSequenceClassification.forward``
        (``logits_to_keep`` is the causal LM's); other keyword arguments go to the loss."""
        inputs = HeadInputs(
            input_ids=input_ids, labels=labels, logits_to_keep=logits_to_keep, loss_kwargs=kwargs
        )
        self.check_inputs(inputs)
        hidden, cache = self.distributed_base.forward_base(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        result = self.head_outputs(hidden, cache, inputs)
        return result if return_dict is not False else result.to_tuple()

    def check_inputs(self, inputs: HeadInputs) -> None:
        """Refuse what this head cannot take, before anything is sent to the servers."""

    def head_outputs(
        self, hidden: torch.Tensor, cache: RemoteCache | None, inputs: HeadInputs
    ) -> ModelOutput:
        """The head's output for the base model's ``hidden`` ``(B, T, hidden)``."""
        raise NotImplementedError


def _check_logits_to_keep(logits_to_keep: int | torch.Tensor) -> None:
    """transformers' ``logits_to_keep``: an int ``n >= 0`` or a 1-D integer tensor of positions."""
    if isinstance(logits_to_keep, torch.Tensor):
        dtype = logits_to_keep.dtype
        integer = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
        if logits_to_keep.dim() != 1 or not integer:
            raise ValueError(
                "logits_to_keep must be an int or a 1-D integer tensor of positions, got a "
                f"tensor of shape {tuple(logits_to_keep.shape)} and dtype {logits_to_keep.dtype}"
            )
        return
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int):
        raise ValueError(f"logits_to_keep must be an int or a tensor, got {logits_to_keep!r}")
    if logits_to_keep < 0:
        raise ValueError(f"logits_to_keep must be >= 0 (0 keeps all), got {logits_to_keep}")


def _keep_positions(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions of ``hidden`` ``(B, T, H)`` that go through the LM head: an int ``n`` keeps
    the last ``n`` (``0`` keeps all), a tensor keeps those positions."""
    if isinstance(logits_to_keep, torch.Tensor):
        return hidden[:, logits_to_keep.to(hidden.device), :]
    return hidden[:, -logits_to_keep:, :] if logits_to_keep else hidden


class DistributedCausalLMMixin(DistributedHeadMixin):
    """A causal LM over a distributed base model: chunked LM head, loss, ``generate()``."""

    lm_head: ChunkedLMHead
    _local_heads = ("lm_head.",)

    def __init__(
        self, config: Any, *, sequence_manager_config: SequenceManagerConfig | None = None
    ) -> None:
        super().__init__(config, sequence_manager_config=sequence_manager_config)
        self.vocab_size = config.vocab_size
        self.lm_head = ChunkedLMHead(config.hidden_size, config.vocab_size)
        self.post_init()
        self.tie_client_weights()
        self.lm_head.requires_grad_(False)

    def tie_client_weights(self) -> None:
        """Share the embeddings' weight with the LM head, if the config ties them."""
        if self.config.tie_word_embeddings:
            weight = self.get_input_embeddings().weight
            assert isinstance(weight, nn.Parameter)
            self.lm_head.weight = weight

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def check_inputs(self, inputs: HeadInputs) -> None:
        _check_logits_to_keep(inputs.logits_to_keep)

    def head_outputs(
        self, hidden: torch.Tensor, cache: RemoteCache | None, inputs: HeadInputs
    ) -> CausalLMOutputWithPast:
        """Logits ``(B, T, vocab)`` (prompts dropped) of the positions ``logits_to_keep`` keeps."""
        logits = self.lm_head(_keep_positions(hidden, inputs.logits_to_keep))
        loss = None
        if inputs.labels is not None:
            loss_function: Any = getattr(self, "loss_function")  # noqa: B009  (transformers')
            loss = loss_function(
                logits=logits,
                labels=inputs.labels,
                vocab_size=self.config.vocab_size,
                **inputs.loss_kwargs,
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, **cache_kwargs(cache))

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        *args: Any,
        session: RemoteInferenceSession | None = None,
        **kwargs: Any,
    ) -> Any:
        """transformers' ``generate()``, run as steps of an inference session.

        The session is ``session`` if given, else the active one, else one opened (and closed)
        here, sized for ``max_length`` (or the prompt plus ``max_new_tokens``).

        In a session where an earlier ``generate()`` ran, the call continues from its output:
        ``inputs`` either repeat that output and add new tokens (transformers' way; the result is
        the whole sequence), or hold only the new tokens, or are None (Petals' way; the previous
        output is prepended, and the result starts after it). Either way only the tokens the
        servers have not seen are sent.
        """
        if inputs is None:
            inputs = kwargs.pop("input_ids", None)
        # Cached decoding is what a session does; without a cache transformers would resend the
        # whole sequence every step. The tokens come out the same.
        kwargs["use_cache"] = True
        base = self.distributed_base
        with contextlib.ExitStack() as stack:
            if session is not None:
                stack.enter_context(base.use_session(session))
            skipped = 0
            active = base.active_session
            if active is not None and active.output_ids is not None:
                # On the device of the new inputs, or the model's (it may have moved since).
                device = base.local_device if inputs is None else inputs.device
                inputs, skipped = _continue_from(active.output_ids.to(device), inputs)
                if kwargs.get("attention_mask") is None:
                    mask = _continuation_mask(inputs, self._generation_ids(kwargs))
                    if mask is not None:
                        kwargs["attention_mask"] = mask
            reset = _GENERATION_STACK.set(stack)
            try:
                result = super().generate(inputs, *args, **kwargs)  # type: ignore[misc]
            finally:
                _GENERATION_STACK.reset(reset)
            sequences = result["sequences"] if isinstance(result, ModelOutput) else result
            active = base.active_session
            if active is not None:
                active.output_ids = sequences
            if skipped:
                sequences = sequences[:, skipped:]
                if isinstance(result, ModelOutput):
                    result["sequences"] = sequences
                else:
                    result = sequences
        return result

    def prepare_inputs_for_generation(
        self, input_ids: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        """transformers' inputs for the next forward, without the tokens the servers hold:
        assisted decoding's first forward sends the whole sequence (its prompt and drafts),
        which in a session that already holds some of it would resend those."""
        inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)  # type: ignore[misc]
        cache, ids = inputs.get(CACHE_ARG), inputs.get("input_ids")
        if isinstance(cache, RemoteCache) and ids is not None:
            held = cache.get_seq_length()
            if 0 < held < ids.shape[1] == input_ids.shape[1]:
                inputs["input_ids"] = ids[:, held:]
                position_ids = inputs.get("position_ids")
                if position_ids is not None and position_ids.shape[-1] == ids.shape[1]:
                    inputs["position_ids"] = position_ids[..., held:]
        return inputs

    def _generation_ids(self, kwargs: dict[str, Any]) -> tuple[int | None, list[int]]:
        """The pad token id and end-of-sequence ids a generate() call with ``kwargs`` uses."""
        config = cast("GenerationConfig", kwargs.get("generation_config") or self.generation_config)
        pad = kwargs.get("pad_token_id", config.pad_token_id)
        if pad is None:
            pad = self.config.pad_token_id
        eos = kwargs.get("eos_token_id", config.eos_token_id)
        if isinstance(eos, torch.Tensor):
            eos = eos.tolist()
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return (None if pad is None else int(pad)), [int(token) for token in eos_ids]

    def _prepare_cache_for_generation(
        self,
        generation_config: GenerationConfig,
        model_kwargs: dict[str, Any],
        generation_mode: Any,
        batch_size: int,
        max_cache_length: int,
    ) -> bool:
        """transformers' hook for the cache: ours opens the session if none is active.

        Returns True, as transformers' does (nothing reads it)."""
        if generation_config.cache_implementation is not None:
            raise ValueError("cache_implementation is not supported: the cache lives on servers")
        given = model_kwargs.get(CACHE_ARG)
        if given is not None and not isinstance(given, RemoteCache):
            raise ValueError(f"distributed models cannot use a {type(given).__name__}")
        base = self.distributed_base
        session = base.active_session
        if session is None:
            stack = _GENERATION_STACK.get()
            if stack is None:
                raise RuntimeError("generation outside DistributedCausalLMMixin.generate")
            max_length = max(generation_config.max_length or 0, max_cache_length + 1)
            if getattr(generation_mode, "value", generation_mode) == "assisted_generation":
                # Drafts are checked past the last position generated: room for a window.
                max_length += (generation_config.prompt_lookup_num_tokens or 0) + 1
            session = stack.enter_context(base.inference_session(max_length=max_length))
        model_kwargs[CACHE_ARG] = RemoteCache(session.token_position)
        return True


def _continuation_mask(
    ids: torch.Tensor, special: tuple[int | None, list[int]]
) -> torch.Tensor | None:
    """The attention mask of a generate() that continues a session, when transformers would
    infer one from the pad token (``ids`` hold it, and it is not an end-of-sequence token): only
    each row's leading pad tokens (the first call's left padding) are masked.  A generated token
    that happens to be the pad id is a token the servers hold like any other, not padding."""
    pad, eos = special
    if pad is None or pad in eos or not bool((ids == pad).any()):
        return None
    leading = torch.cumprod((ids == pad).to(torch.int64), dim=1).bool()  # (B, T)
    return (~leading).to(torch.int64)


def _continue_from(previous: torch.Tensor, inputs: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """The whole sequence for a generate() that continues ``previous`` (on the device of
    ``inputs``), and how many tokens of the result to drop (Petals' way) or 0 (transformers'
    way)."""
    if inputs is None:
        return previous, previous.shape[1]
    if inputs.dim() != 2 or inputs.shape[0] != previous.shape[0]:
        raise ValueError(
            f"this session continues {previous.shape[0]} sequences; got inputs of shape "
            f"{tuple(inputs.shape)}"
        )
    count = previous.shape[1]
    if inputs.shape[1] >= count and torch.equal(inputs[:, :count], previous):
        return inputs, 0
    return torch.cat([previous, inputs], dim=1), count


class DistributedSequenceClassificationMixin(DistributedHeadMixin):
    """A ``score`` head over the last non-pad token of a distributed base model."""

    score: nn.Linear

    def __init__(
        self, config: Any, *, sequence_manager_config: SequenceManagerConfig | None = None
    ) -> None:
        super().__init__(config, sequence_manager_config=sequence_manager_config)
        assert config.num_labels is not None
        self.num_labels: int = config.num_labels
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()
        self.init_score()

    def init_score(self) -> None:
        """Draw the score head (trainable), as transformers initializes linear layers."""
        std = getattr(self.config, "initializer_range", 0.02)
        with torch.no_grad():
            self.score.weight.normal_(0.0, std)
        self.score.weight.requires_grad_(True)

    def check_inputs(self, inputs: HeadInputs) -> None:
        keep = inputs.logits_to_keep
        if not (isinstance(keep, int) and not isinstance(keep, bool) and keep == 0):
            raise ValueError(
                "logits_to_keep is a causal LM's: a sequence classifier scores each row's last "
                f"non-pad token (got logits_to_keep={keep!r})"
            )

    def head_outputs(
        self, hidden: torch.Tensor, cache: RemoteCache | None, inputs: HeadInputs
    ) -> SequenceClassifierOutputWithPast:
        """Logits ``(B, num_labels)`` of each row's last non-pad token, as transformers."""
        input_ids = inputs.input_ids
        logits = self.score(hidden.to(self.score.weight.dtype))  # (B, T, labels)
        batch = logits.shape[0]
        pad_token_id = self.config.pad_token_id
        if pad_token_id is None and batch != 1:
            raise ValueError("cannot handle batch sizes > 1 if no padding token is defined")
        if pad_token_id is None or input_ids is None:
            last: torch.Tensor | int = -1
        else:
            # The rightmost token that is not padding, as transformers picks it.
            not_pad = (input_ids != pad_token_id).to(logits.device, torch.int32)
            indices = torch.arange(input_ids.shape[-1], device=logits.device, dtype=torch.int32)
            last = (indices * not_pad).argmax(-1)
        pooled = logits[torch.arange(batch, device=logits.device), last]  # (B, L)
        loss = None
        if inputs.labels is not None:
            loss_function: Any = getattr(self, "loss_function")  # noqa: B009  (transformers')
            loss = loss_function(
                logits=logits, labels=inputs.labels, pooled_logits=pooled, config=self.config
            )
        return SequenceClassifierOutputWithPast(loss=loss, logits=pooled, **cache_kwargs(cache))
