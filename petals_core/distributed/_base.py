"""What every distributed model shares: local parts, remote blocks, prompts, sessions, generate().

A distributed model is a transformers model whose transformer blocks are a
:class:`~petals_core.client.RemoteSequential` over the servers of a swarm. The client holds only
the embeddings, the final norm, the LM head (or a classification ``score`` head) and, for
p-tuning, the trainable prompts. Three mixins hold the shared logic; the family modules
(``_llama``, ``_bloom``) pair them with transformers' own ``*PreTrainedModel`` classes.

Sessions. ``with model.inference_session(max_length=...) as session:`` makes ``session`` the
model's *active* session: every forward of the model then runs as a step of that session (the
servers keep the keys and values, so only new tokens are sent). Outside one, a forward is a full
remote forward with autograd (training).

Masks and positions. Remote blocks attend causally to every position they hold. In an inference
session (generate()), a left-padded mask (zeros then ones in each row, as tokenizers pad for
generation) is sent to the servers with the first step: each row's padding is hidden from its
real tokens, and LLaMA positions count from the row's first real token, as transformers does.
Outside a session a mask is accepted only if it changes nothing: all ones, or right padding
(ones then zeros per row), where causal attention never lets a real token see the pads after it.
Other masks, left padding with trainable prompts, and ``position_ids`` other than the positions
the servers use are refused with :class:`ValueError`.

Devices and dtypes. The local layers may be moved (``model.cuda()``, ``model.to(torch.bfloat16)``);
inputs must be on their device. What the servers return (hidden states, gradients of the prompts)
comes back on that device and in that dtype (see ``petals_core.client._placement``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import attrs
import torch
from torch import nn
from transformers.modeling_outputs import (
    CausalLMOutputWithPast,
    SequenceClassifierOutputWithPast,
)
from transformers.utils import ModelOutput

from .. import kernels
from .._errors import ConfigError
from .._hf_compat import CACHE_ARG, cache_kwargs
from ..client import RemoteSequential
from ..routing import RemoteSequenceManager, SequenceManagerConfig
from ._cache import RemoteCache
from ._session import RemoteInferenceSession

if TYPE_CHECKING:
    from transformers import GenerationConfig

__all__ = [
    "DEFAULT_LM_HEAD_CHUNK_ROWS",
    "ChunkedLMHead",
    "DistributedCausalLMMixin",
    "DistributedModelMixin",
    "DistributedSequenceClassificationMixin",
    "TuningMode",
]

TuningMode = Literal["ptune", "deep_ptune"]
_TUNING_MODES = (None, "ptune", "deep_ptune")

#: Vocabulary rows per matmul of the LM head.
DEFAULT_LM_HEAD_CHUNK_ROWS = 8192
#: Up to this many rows of hidden states, the LM head is one matmul (chunks save nothing there).
_UNCHUNKED_ROWS = 16


def make_remote_blocks(
    config: Any, sequence_manager_config: SequenceManagerConfig | None
) -> RemoteSequential:
    """The model's blocks as a :class:`RemoteSequential`, under the config's ``dht_prefix``."""
    manager_config = sequence_manager_config or SequenceManagerConfig()
    if manager_config.dht_prefix is None:
        dht_prefix = getattr(config, "dht_prefix", None)
        if dht_prefix is None:
            raise ConfigError(
                "no dht_prefix: give one in the config or the SequenceManagerConfig "
                "(from_pretrained derives it from the model name)"
            )
        manager_config = attrs.evolve(manager_config, dht_prefix=dht_prefix)
    manager = RemoteSequenceManager(manager_config, config.num_hidden_layers)
    return RemoteSequential(manager)


def tuning_settings(config: Any) -> tuple[TuningMode | None, int]:
    """``(tuning_mode, pre_seq_len)`` of a config, validated."""
    mode = getattr(config, "tuning_mode", None)
    prompt_len = getattr(config, "pre_seq_len", 0) or 0
    if mode not in _TUNING_MODES:
        raise ConfigError(f"tuning_mode must be one of {_TUNING_MODES}, got {mode!r}")
    if mode is not None and (not isinstance(prompt_len, int) or prompt_len < 1):
        raise ConfigError(f"tuning_mode={mode!r} needs pre_seq_len >= 1, got {prompt_len!r}")
    return mode, prompt_len if mode is not None else 0


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
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.chunk_rows = chunk_rows

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight  # (vocab, hidden)
        hidden_states = hidden_states.to(weight.dtype)
        rows = hidden_states.numel() // max(1, hidden_states.shape[-1])
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


def _keep_positions(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions of ``hidden`` ``(B, T, H)`` that go through the LM head, as transformers'
    ``logits_to_keep``: an int ``n`` keeps the last ``n`` (``0`` keeps all), a 1-D integer
    tensor keeps those positions."""
    if isinstance(logits_to_keep, torch.Tensor):
        dtype = logits_to_keep.dtype
        integer = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
        if logits_to_keep.dim() != 1 or not integer:
            raise ValueError(
                "logits_to_keep must be an int or a 1-D integer tensor of positions, got a "
                f"tensor of shape {tuple(logits_to_keep.shape)} and dtype {logits_to_keep.dtype}"
            )
        return hidden[:, logits_to_keep.to(hidden.device), :]
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int):
        raise ValueError(f"logits_to_keep must be an int or a tensor, got {logits_to_keep!r}")
    if logits_to_keep < 0:
        raise ValueError(f"logits_to_keep must be >= 0 (0 keeps all), got {logits_to_keep}")
    return hidden[:, -logits_to_keep:, :] if logits_to_keep else hidden


def _check_attention_mask(
    mask: torch.Tensor | None, *, tokens: int, past: int, in_session: bool, prompts: bool
) -> torch.Tensor | None:
    """Refuse masks the servers cannot honour; return the left padding ``(B,)`` of a first step
    in a session (None when there is none)."""
    if mask is None:
        return None
    if mask.dim() != 2:
        raise ValueError(f"attention_mask must be (batch, length), got {tuple(mask.shape)}")
    kept = mask.bool()
    if bool(kept.all()):
        return None
    right_padded = not bool((kept[:, 1:] & ~kept[:, :-1]).any())
    if right_padded and not in_session and past == 0 and mask.shape[1] == tokens:
        return None
    left_padded = not bool((~kept[:, 1:] & kept[:, :-1]).any())
    if in_session and left_padded and not prompts and mask.shape[1] == past + tokens:
        if past == 0:
            return (~kept).sum(dim=-1)
        if bool(kept[:, past:].all()):
            return None  # the padding went with the first step
    raise ValueError(
        "remote blocks attend causally to every position and take no attention mask, so only "
        "masks they can honour are supported: all ones; right padding (ones then zeros per row) "
        "in a forward without an inference session; left padding (zeros then ones) given with "
        "the first step of an inference session (generate()), without trainable prompts"
    )


def _check_position_ids(
    position_ids: torch.Tensor | None, *, tokens: int, past: int, mask: torch.Tensor | None
) -> None:
    if position_ids is None:
        return
    expected = torch.arange(past, past + tokens, device=position_ids.device)
    if mask is not None and position_ids.shape[-1] == tokens and mask.shape[-1] == past + tokens:
        # transformers' positions for a padded batch: counted from each row's first real token.
        kept = mask.bool().to(position_ids.device)
        padded = (kept.long().cumsum(-1) - 1)[:, past:]
        real = kept[:, past:]
        if bool((position_ids == padded)[real].all()) or bool((position_ids == expected).all()):
            return
    if position_ids.shape[-1] != tokens or not bool((position_ids == expected).all()):
        raise ValueError(
            f"custom position_ids are not supported: remote blocks use positions "
            f"{past}..{past + tokens - 1} for these {tokens} tokens"
        )


class DistributedModelMixin:
    """The base model: embeddings, trainable prompts, remote blocks, final norm.

    Family classes define the hooks :meth:`embed`, :meth:`prepare_hidden`, :meth:`final_norm` and
    :attr:`remote_blocks`, call :meth:`init_prompts` in ``__init__`` and :meth:`finish_init` at
    its end.
    """

    config: Any
    prompt_embeddings: nn.Embedding
    intermediate_prompt_embeddings: nn.Embedding
    _active_session: RemoteInferenceSession | None

    # -- family hooks ----------------------------------------------------------------------------

    @property
    def remote_blocks(self) -> RemoteSequential:
        raise NotImplementedError

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``(B, T, hidden)``."""
        raise NotImplementedError

    def prepare_hidden(self, embeddings: torch.Tensor) -> torch.Tensor:
        """What runs between the embeddings (prompts prepended) and the first block."""
        return embeddings

    def final_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # -- construction ----------------------------------------------------------------------------

    def init_prompts(self, config: Any) -> None:
        """Create the trainable prompts of ``config.tuning_mode`` (kept in float32, as Petals)."""
        self._active_session = None
        mode, prompt_len = tuning_settings(config)
        if mode is None:
            return
        hidden, blocks = config.hidden_size, config.num_hidden_layers
        self.prompt_embeddings = nn.Embedding(prompt_len, hidden, dtype=torch.float32)
        if mode == "deep_ptune":
            self.intermediate_prompt_embeddings = nn.Embedding(
                prompt_len, blocks * hidden, dtype=torch.float32
            )

    def finish_init(self) -> None:
        """Freeze the local weights (only prompts train) and draw the prompts."""
        assert isinstance(self, nn.Module)
        self.requires_grad_(False)
        std = getattr(self.config, "initializer_range", 0.02)
        for name in ("prompt_embeddings", "intermediate_prompt_embeddings"):
            module = getattr(self, name, None)
            if isinstance(module, nn.Embedding):
                with torch.no_grad():
                    module.weight.normal_(0.0, std)
                module.weight.requires_grad_(True)

    # -- sessions --------------------------------------------------------------------------------

    @property
    def tuning_mode(self) -> TuningMode | None:
        return tuning_settings(self.config)[0]

    @property
    def pre_seq_len(self) -> int:
        return tuning_settings(self.config)[1]

    @property
    def active_session(self) -> RemoteInferenceSession | None:
        """The session every forward currently steps through, if any."""
        return self._active_session

    @property
    def local_device(self) -> torch.device:
        """Where the local layers (embeddings, prompts, norm) are, and so the inputs must be."""
        assert isinstance(self, nn.Module)
        return next(self.parameters()).device

    def inference_session(self, max_length: int, **kwargs: Any) -> RemoteInferenceSession:
        """A session of up to ``max_length`` tokens: ``with model.inference_session(...) as s:``.

        Room for the trainable prompts is added on the servers. ``kwargs`` go to
        :class:`~petals_core.client.InferenceSession` (``alloc_timeout``).
        """
        inner = self.remote_blocks.inference_session(max_length + self.pre_seq_len, **kwargs)
        return RemoteInferenceSession(self, inner, max_length=max_length)

    @contextlib.contextmanager
    def use_session(self, session: RemoteInferenceSession) -> Iterator[RemoteInferenceSession]:
        """Make ``session`` the active one for the duration of the block (it stays open)."""
        previous = self._swap_active_session(session)
        try:
            yield session
        finally:
            self._swap_active_session(previous)

    def _swap_active_session(
        self, session: RemoteInferenceSession | None
    ) -> RemoteInferenceSession | None:
        previous, self._active_session = self._active_session, session
        return previous

    def shutdown(self) -> None:
        """Stop the network part (the DHT client) started for this model's blocks."""
        self.remote_blocks.shutdown()

    # -- forward ---------------------------------------------------------------------------------

    def prompts(self, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Shallow prompts ``(B, P, hidden)``; deep prompts ``(blocks, 1, P, hidden)`` or None."""
        prompt_len = self.pre_seq_len
        shallow = self.prompt_embeddings.weight.to(dtype)  # (P, hidden)
        shallow = shallow.unsqueeze(0).expand(batch, -1, -1)
        if self.tuning_mode != "deep_ptune":
            return shallow, None
        blocks, hidden = self.config.num_hidden_layers, self.config.hidden_size
        deep = self.intermediate_prompt_embeddings.weight.to(dtype)  # (P, blocks * hidden)
        deep = deep.view(prompt_len, blocks, hidden).permute(1, 0, 2).unsqueeze(1)
        return shallow, deep

    def forward_base(
        self,
        input_ids: torch.Tensor | None,
        *,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cache: Any,
        inputs_embeds: torch.Tensor | None,
        output_attentions: bool | None,
        output_hidden_states: bool | None,
    ) -> tuple[torch.Tensor, RemoteCache | None]:
        """Embeddings -> (prompts) -> remote blocks -> final norm; prompt positions dropped.

        Returns the hidden states ``(B, T, hidden)`` and the cache (advanced by ``T``)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if output_attentions or output_hidden_states:
            raise ValueError(
                "distributed models cannot return attentions or per-block hidden states: "
                "the blocks run on servers"
            )
        if cache is not None and not isinstance(cache, RemoteCache):
            raise ValueError(
                f"distributed models keep their cache on servers; got a {type(cache).__name__} "
                "(use model.inference_session(...), or pass a RemoteCache)"
            )
        inputs = input_ids if inputs_embeds is None else inputs_embeds
        assert inputs is not None
        if inputs.device != self.local_device:
            name = "input_ids" if inputs_embeds is None else "inputs_embeds"
            raise ValueError(
                f"{name} are on {inputs.device}, but the model's local layers are on "
                f"{self.local_device}: move them there (.to(model.device))"
            )
        if inputs_embeds is None:
            assert input_ids is not None
            inputs_embeds = self.embed(input_ids)
        embeddings = inputs_embeds  # (B, T, hidden)
        batch, tokens = embeddings.shape[:2]
        session = self._active_session
        past = self._synchronize(session, cache)
        padding = _check_attention_mask(
            attention_mask,
            tokens=tokens,
            past=past,
            in_session=session is not None,
            prompts=self.tuning_mode is not None,
        )
        _check_position_ids(position_ids, tokens=tokens, past=past, mask=attention_mask)

        prompt_len, deep = 0, None
        if self.tuning_mode is not None and (session is None or session.position == 0):
            shallow, deep = self.prompts(batch, embeddings.dtype)
            embeddings = torch.cat([shallow, embeddings], dim=1)  # (B, P + T, hidden)
            prompt_len = shallow.shape[1]
        hidden = self.prepare_hidden(embeddings)

        if session is None:
            hidden = self.remote_blocks(hidden, prompts=deep)
        else:
            hypo_ids = cache.take_hypo_ids() if cache is not None else None
            if hypo_ids is not None and torch.equal(hypo_ids, torch.arange(len(hypo_ids))):
                hypo_ids = None
            hidden = session.step(hidden, prompts=deep, hypo_ids=hypo_ids, padding=padding)
            session.prompt_tokens += prompt_len
        if cache is not None:
            cache.advance(tokens)
        if prompt_len:
            hidden = hidden[:, prompt_len:].contiguous()  # (B, T, hidden)
        return self.final_norm(hidden), cache

    def _synchronize(self, session: RemoteInferenceSession | None, cache: Any) -> int:
        """Tokens already on the servers; rolls the session back to what ``cache`` says."""
        if session is None:
            past = cache.get_seq_length() if cache is not None else 0
            if past:
                raise ValueError(
                    f"the cache says {past} tokens were processed, but there is no active "
                    "inference session holding them (use model.inference_session(...))"
                )
            return 0
        if cache is not None:
            wanted, held = cache.get_seq_length(), session.token_position
            if wanted > held:
                raise ValueError(
                    f"the cache says {wanted} tokens were processed, but the session holds {held}"
                )
            if wanted < held:
                session.position = wanted + session.prompt_tokens
        return session.token_position


class DistributedCausalLMMixin:
    """A causal LM over a distributed base model: chunked LM head, loss, ``generate()``."""

    config: Any
    lm_head: ChunkedLMHead
    base_model_prefix: str
    _generation_stack: contextlib.ExitStack | None = None

    @property
    def distributed_base(self) -> DistributedModelMixin:
        base = getattr(self, self.base_model_prefix)
        assert isinstance(base, DistributedModelMixin)
        return base

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

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
    ) -> CausalLMOutputWithPast | tuple[Any, ...]:
        """As transformers' ``*ForCausalLM.forward``; logits ``(B, T, vocab)`` (prompts dropped)."""
        hidden, cache = self.distributed_base.forward_base(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        logits = self.lm_head(_keep_positions(hidden, logits_to_keep))
        loss = None
        if labels is not None:
            loss_function: Any = getattr(self, "loss_function")  # noqa: B009  (transformers')
            loss = loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs
            )
        result = CausalLMOutputWithPast(loss=loss, logits=logits, **cache_kwargs(cache))
        return result if return_dict is not False else result.to_tuple()

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
            self._generation_stack = stack
            try:
                result = super().generate(inputs, *args, **kwargs)  # type: ignore[misc]
            finally:
                self._generation_stack = None
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
            if self._generation_stack is None:
                raise RuntimeError("generation outside DistributedCausalLMMixin.generate")
            max_length = max(generation_config.max_length or 0, max_cache_length + 1)
            session = self._generation_stack.enter_context(
                base.inference_session(max_length=max_length)
            )
        model_kwargs[CACHE_ARG] = RemoteCache(session.token_position)
        return True


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


class DistributedSequenceClassificationMixin:
    """A ``score`` head over the last non-pad token of a distributed base model."""

    config: Any
    score: nn.Linear
    base_model_prefix: str

    @property
    def distributed_base(self) -> DistributedModelMixin:
        base = getattr(self, self.base_model_prefix)
        assert isinstance(base, DistributedModelMixin)
        return base

    def init_score(self) -> None:
        """Draw the score head (trainable), as transformers initializes linear layers."""
        std = getattr(self.config, "initializer_range", 0.02)
        with torch.no_grad():
            self.score.weight.normal_(0.0, std)
        self.score.weight.requires_grad_(True)

    def inference_session(self, max_length: int, **kwargs: Any) -> RemoteInferenceSession:
        return self.distributed_base.inference_session(max_length, **kwargs)

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
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: RemoteCache | None = None,
        **kwargs: Any,
    ) -> SequenceClassifierOutputWithPast | tuple[Any, ...]:
        """As transformers' ``*ForSequenceClassification.forward``: logits ``(B, num_labels)``."""
        hidden, cache = self.distributed_base.forward_base(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
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
        if labels is not None:
            loss_function: Any = getattr(self, "loss_function")  # noqa: B009  (transformers')
            loss = loss_function(
                logits=logits, labels=labels, pooled_logits=pooled, config=self.config
            )
        result = SequenceClassifierOutputWithPast(loss=loss, logits=pooled, **cache_kwargs(cache))
        return result if return_dict is not False else result.to_tuple()
