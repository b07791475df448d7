"""The base model every distributed model is built on: local parts, remote blocks, prompts,
sessions.

A distributed model is a transformers model whose transformer blocks are a
:class:`~petals_core.client.RemoteSequential` over the servers of a swarm. The client holds only
the embeddings, the final norm, the LM head (or a classification ``score`` head, see ``_heads``)
and, for p-tuning, the trainable prompts. :class:`DistributedModelMixin` is the one implementation
of the base model; a family module (``_llama``, ``_bloom``, ``_falcon``, ``_mixtral``) pairs it
with transformers' own ``*PreTrainedModel`` and says only what differs: its local layers and their
names.

Sessions. ``with model.inference_session(max_length=...) as session:`` makes ``session`` the
model's *active* session: every forward of the model then runs as a step of that session (the
servers keep the keys and values, so only new tokens are sent). Outside one, a forward is a full
remote forward with autograd (training). The active session belongs to the thread (or trio task)
that entered it, held in a context variable: threads sharing one model each generate in sessions
of their own (a worker started by ``trio.to_thread.run_sync`` starts from its caller's).

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
import itertools
import types
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any, ClassVar

import attrs
import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast

from .._errors import ConfigError
from .._hf_compat import cache_kwargs
from ..client import RemoteSequenceManager, RemoteSequential, SequenceManagerConfig
from ._cache import RemoteCache
from ._pretrained import FromPretrainedMixin, TuningMode, tuning_settings
from ._session import RemoteInferenceSession

__all__ = ["DistributedModelMixin", "make_remote_blocks"]

#: Each model's active session (by the model's serial number) in this thread or task.
_ACTIVE_SESSIONS: ContextVar[Mapping[int, RemoteInferenceSession]] = ContextVar(
    "petals_core_active_sessions", default=types.MappingProxyType({})
)
_serial_numbers = itertools.count()


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
    manager = RemoteSequenceManager(
        manager_config, config.num_hidden_layers, hidden_size=config.hidden_size
    )
    return RemoteSequential(manager)


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


class DistributedModelMixin(FromPretrainedMixin, nn.Module):
    """The base model: embeddings, trainable prompts, remote blocks, final norm.

    A family class pairs it with transformers' ``*PreTrainedModel`` and its config class, defines
    :meth:`init_layers` (its local layers and the remote blocks, under transformers' names), names
    three of them (:attr:`embeddings_name`, :attr:`blocks_name`, :attr:`norm_name`), and defines
    :meth:`prepare_hidden` where something runs between the embeddings and the first block.
    """

    config: Any
    config_class: type[Any]
    #: transformers' names of the family's input embeddings, blocks (remote here) and final norm.
    embeddings_name: ClassVar[str]
    blocks_name: ClassVar[str]
    norm_name: ClassVar[str]
    prompt_embeddings: nn.Embedding
    intermediate_prompt_embeddings: nn.Embedding
    _serial: int
    _is_base_model = True

    def __init__(
        self, config: Any, *, sequence_manager_config: SequenceManagerConfig | None = None
    ) -> None:
        super().__init__(config)  # the family's *PreTrainedModel
        self._serial = next(_serial_numbers)
        self.init_layers(config, make_remote_blocks(config, sequence_manager_config))
        self._init_prompts(config)
        self.post_init()
        self._freeze_all_but_prompts()

    # -- family hooks ----------------------------------------------------------------------------

    def init_layers(self, config: Any, blocks: RemoteSequential) -> None:
        """Create the local layers and hold ``blocks``, under the family's attribute names."""
        raise NotImplementedError

    @property
    def remote_blocks(self) -> RemoteSequential:
        blocks: RemoteSequential = getattr(self, self.blocks_name)
        return blocks

    def get_input_embeddings(self) -> nn.Embedding:
        embeddings: nn.Embedding = getattr(self, self.embeddings_name)
        return embeddings

    def prepare_hidden(self, embeddings: torch.Tensor) -> torch.Tensor:
        """What runs between the embeddings (prompts prepended) and the first block."""
        return embeddings

    def final_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
        normed: torch.Tensor = getattr(self, self.norm_name)(hidden_states)
        return normed

    # -- construction ----------------------------------------------------------------------------

    def _init_prompts(self, config: Any) -> None:
        """Create the trainable prompts of ``config.tuning_mode`` (kept in float32, as Petals)."""
        mode, prompt_len = tuning_settings(config)
        if mode is None:
            return
        hidden, blocks = config.hidden_size, config.num_hidden_layers
        self.prompt_embeddings = nn.Embedding(prompt_len, hidden, dtype=torch.float32)
        if mode == "deep_ptune":
            self.intermediate_prompt_embeddings = nn.Embedding(
                prompt_len, blocks * hidden, dtype=torch.float32
            )

    def _freeze_all_but_prompts(self) -> None:
        """Freeze the local weights (only prompts train) and draw the prompts."""
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
        """The session every forward in this thread (or trio task) steps through, if any."""
        return _ACTIVE_SESSIONS.get().get(self._serial)

    @property
    def local_device(self) -> torch.device:
        """Where the local layers (embeddings, prompts, norm) are, and so the inputs must be."""
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
        sessions = dict(_ACTIVE_SESSIONS.get())
        previous = sessions.pop(self._serial, None)
        if session is not None:
            sessions[self._serial] = session
        _ACTIVE_SESSIONS.set(types.MappingProxyType(sessions))
        return previous

    def shutdown(self) -> None:
        """Stop the network part (the DHT client) started for this model's blocks."""
        self.remote_blocks.shutdown()

    # -- forward ---------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: RemoteCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: RemoteCache | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast | tuple[Any, ...]:
        """As transformers' base models: ``last_hidden_state`` after the final norm."""
        hidden, cache = self.forward_base(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        outputs = BaseModelOutputWithPast(last_hidden_state=hidden, **cache_kwargs(cache))
        return outputs if return_dict is not False else outputs.to_tuple()

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
            inputs_embeds = self.get_input_embeddings()(input_ids)
        embeddings = inputs_embeds  # (B, T, hidden)
        batch, tokens = embeddings.shape[:2]
        session = self.active_session
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
