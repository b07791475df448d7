"""``generate()`` and inference sessions of distributed models equal transformers' generation."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch

from petals_core import ConfigError
from petals_core.distributed import AutoDistributedSpeculativeModel, RemoteInferenceSession

from .._served_swarm import ServedModel
from ._causal_lm import PROMPT_LEN, load_prompt_tuned, no_eos, random_ids

TOLERANCE = 1e-4


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_transformers(models: tuple[Any, Any], batch: int) -> None:
    model, reference = models
    ids = random_ids(batch, 6, seed=batch)
    ours = model.generate(ids, max_new_tokens=8, do_sample=False, **no_eos(reference))
    theirs = reference.generate(ids, max_new_tokens=8, do_sample=False, **no_eos(reference))
    assert ours.shape == (batch, 14)
    assert torch.equal(ours, theirs)
    assert model.active_session is None  # the session generate() opened is closed


@pytest.mark.parametrize("batch", [1, 2])
def test_seeded_sampling_equals_transformers(models: tuple[Any, Any], batch: int) -> None:
    model, reference = models
    ids = random_ids(batch, 5, seed=10 + batch)
    settings = {"do_sample": True, "top_k": 20, "temperature": 1.3, **no_eos(reference)}
    torch.manual_seed(7)
    ours = model.generate(ids, max_new_tokens=8, **settings)
    torch.manual_seed(7)
    theirs = reference.generate(ids, max_new_tokens=8, **settings)
    assert torch.equal(ours, theirs)


def test_beam_search_equals_transformers(models: tuple[Any, Any]) -> None:
    model, reference = models
    ids = random_ids(2, 5, seed=20)
    settings = {"num_beams": 3, "do_sample": False, "max_new_tokens": 8, **no_eos(reference)}
    ours = model.generate(ids, num_return_sequences=3, **settings)
    theirs = reference.generate(ids, num_return_sequences=3, **settings)
    assert torch.equal(ours, theirs)


def test_generate_calls_in_one_session_continue(models: tuple[Any, Any]) -> None:
    model, reference = models
    ids = random_ids(2, 5, seed=30)
    settings = {"do_sample": False, **no_eos(reference)}
    whole = reference.generate(ids, max_new_tokens=12, **settings)
    with model.inference_session(max_length=40) as session:
        assert model.active_session is session
        first = model.generate(ids, max_new_tokens=4, **settings)
        # transformers' way: the whole sequence so far, plus nothing new.
        second = model.generate(first, max_new_tokens=4, **settings)
        # Petals' way: no inputs; the result starts after the previous output.
        third = model.generate(None, max_new_tokens=4, **settings)
        # The last generated token of each call is sent by the next one, never twice.
        assert session.token_position == 5 + 12 - 1
    assert model.active_session is None
    assert torch.equal(second, whole[:, :13])
    assert torch.equal(torch.cat([second, third], dim=1), whole)


def test_a_session_continues_past_tokens_equal_to_the_pad_id(models: tuple[Any, Any]) -> None:
    """A token of the history that happens to be the pad id is a token, not padding: only each
    row's leading pad tokens (the first call's left padding) stay masked when a session goes on
    without an attention mask (transformers would infer one masking every pad id)."""
    model, reference = models
    settings = {"do_sample": False, **no_eos(reference)}
    pad = settings["pad_token_id"]
    ids = random_ids(2, 5, seed=50)
    ids[1, :2] = pad  # row 1 is left-padded
    mask = (ids != pad).long()
    with model.inference_session(max_length=32):
        first = model.generate(ids, attention_mask=mask, max_new_tokens=2, **settings)
        # transformers' way, adding a pad-id token to every row, then Petals' way.
        extended = torch.cat([first, torch.full((2, 1), pad)], dim=1)
        second = model.generate(extended, max_new_tokens=2, **settings)
        third = model.generate(None, max_new_tokens=2, **settings)
    full_mask = torch.ones_like(second)
    full_mask[1, :2] = 0
    expected = reference.generate(
        second[:, :-2], attention_mask=full_mask[:, :-2], **settings, max_new_tokens=4
    )
    assert torch.equal(torch.cat([second, third], dim=1), expected)


def test_new_tokens_petals_style_continue_the_session(models: tuple[Any, Any]) -> None:
    model, reference = models
    ids = random_ids(1, 4, seed=40)
    extra = random_ids(1, 3, seed=41)
    settings = {"do_sample": False, **no_eos(reference)}
    with model.inference_session(max_length=32):
        first = model.generate(ids, max_new_tokens=3, **settings)
        more = model.generate(extra, max_new_tokens=3, **settings)
    expected = reference.generate(torch.cat([first, extra], dim=1), max_new_tokens=3, **settings)
    assert torch.equal(torch.cat([first, more], dim=1), expected)


def test_explicit_session_argument(models: tuple[Any, Any]) -> None:
    model, reference = models
    ids = random_ids(1, 4, seed=50)
    settings = {"do_sample": False, **no_eos(reference)}
    session = model.inference_session(max_length=16)
    assert isinstance(session, RemoteInferenceSession)
    try:
        ours = model.generate(ids, max_new_tokens=5, session=session, **settings)
        assert session.token_position == 4 + 5 - 1
    finally:
        session.close()
    assert torch.equal(ours, reference.generate(ids, max_new_tokens=5, **settings))


def test_forwards_in_a_session_step_through_it(models: tuple[Any, Any]) -> None:
    model, reference = models
    ids = random_ids(2, 7, seed=60)
    with torch.no_grad():
        expected = reference(ids).logits
        with model.inference_session(max_length=7) as session:
            parts = [model(ids[:, :3]).logits]
            parts += [model(ids[:, t : t + 1]).logits for t in range(3, 7)]
            assert session.position == 7
            session.position = 5  # roll back two tokens and send them again
            again = model(ids[:, 5:]).logits
    torch.testing.assert_close(torch.cat(parts, dim=1), expected, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(again, expected[:, 5:], atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("mode", ["greedy", "sampling", "beams"])
def test_left_padded_batches_equal_transformers(models: tuple[Any, Any], mode: str) -> None:
    """Prompts of different lengths in one batch, left-padded as tokenizers pad for generation."""
    model, reference = models
    ids = random_ids(3, 7, seed=70)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, reference.config.pad_token_id or 0)
    settings: dict[str, Any] = {"attention_mask": mask, "max_new_tokens": 6, **no_eos(reference)}
    if mode == "sampling":
        settings.update(do_sample=True, top_k=20)
    elif mode == "beams":
        settings.update(num_beams=3, do_sample=False)
    else:
        settings.update(do_sample=False)
    torch.manual_seed(8)
    ours = model.generate(ids, **settings)
    torch.manual_seed(8)
    theirs = reference.generate(ids, **settings)
    assert torch.equal(ours, theirs)
    assert model.active_session is None


def test_left_padding_in_a_session_is_refused_with_trainable_prompts_only(
    models: tuple[Any, Any], served: ServedModel
) -> None:
    """A session's first step may carry left padding, unless the model has trainable prompts
    (outside a session it never may: ``test_models.py``)."""
    model, _ = models
    ids = random_ids(2, 5, seed=71)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with model.inference_session(max_length=5):
        assert model(ids, attention_mask=mask).logits.shape[:2] == (2, 5)
    tuned = load_prompt_tuned(served, "ptune")
    try:
        with (
            tuned.inference_session(max_length=5 + PROMPT_LEN),
            pytest.raises(ValueError, match="left padding"),
        ):
            tuned(ids, attention_mask=mask)
    finally:
        tuned.shutdown()


def test_a_full_session_says_so(models: tuple[Any, Any]) -> None:
    model, reference = models
    ids = random_ids(1, 4, seed=80)
    with (
        model.inference_session(max_length=6),
        pytest.raises(ValueError, match="max_length"),
    ):
        model.generate(ids, max_new_tokens=5, **no_eos(reference))


def test_threads_sharing_a_model_generate_in_sessions_of_their_own(
    models: tuple[Any, Any],
) -> None:
    model, reference = models
    prompts = [random_ids(1, 4 + i, seed=40 + i) for i in range(3)]
    settings = {"do_sample": False, "max_new_tokens": 6, **no_eos(reference)}
    expected = [reference.generate(ids, **settings) for ids in prompts]
    barrier = threading.Barrier(len(prompts))
    results: list[torch.Tensor | BaseException | None] = [None] * len(prompts)

    def generate(i: int) -> None:
        try:
            with model.inference_session(max_length=20) as session:
                barrier.wait(timeout=60)  # every thread's session is open at once
                assert model.active_session is session
                results[i] = model.generate(prompts[i], **settings)
                barrier.wait(timeout=60)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for result, want in zip(results, expected, strict=True):
        if isinstance(result, BaseException):
            raise result
        assert result is not None
        assert torch.equal(result, want)
    assert model.active_session is None  # none of the threads' sessions is active here


def test_prompt_lookup_decoding_equals_greedy(models: tuple[Any, Any]) -> None:
    model, reference = models
    ids = random_ids(1, 6, seed=40).repeat(1, 3)  # a repetitive prompt: lookups find drafts
    settings = {"do_sample": False, "max_new_tokens": 12, **no_eos(reference)}
    plain = reference.generate(ids, **settings)
    ours = model.generate(ids, prompt_lookup_num_tokens=4, **settings)
    assert torch.equal(ours, plain)


def test_prompt_lookup_in_a_session_continues_like_greedy(models: tuple[Any, Any]) -> None:
    """Rejected draft tokens roll the session back with the next step; a second generate() in
    the session continues from the first's output."""
    model, reference = models
    ids = random_ids(1, 5, seed=41).repeat(1, 3)
    settings = {"do_sample": False, **no_eos(reference)}
    whole = reference.generate(ids, max_new_tokens=16, **settings)
    with model.inference_session(max_length=40):
        first = model.generate(ids, max_new_tokens=8, prompt_lookup_num_tokens=3, **settings)
        second = model.generate(first, max_new_tokens=8, prompt_lookup_num_tokens=3, **settings)
    assert torch.equal(first, whole[:, :23])
    assert torch.equal(second, whole)


def test_assisted_decoding_with_a_local_draft_model_equals_greedy(models: tuple[Any, Any]) -> None:
    """A local model drafts tokens; the swarm checks each window in one step."""
    model, reference = models
    ids = random_ids(1, 7, seed=42)
    settings = {"do_sample": False, "max_new_tokens": 10, **no_eos(reference)}
    plain = reference.generate(ids, **settings)
    assert torch.equal(model.generate(ids, assistant_model=reference, **settings), plain)


def test_seeded_sampling_with_prompt_lookup_equals_transformers(models: tuple[Any, Any]) -> None:
    """Sampled drafts are kept by transformers' rule (each position sampled from the model, a
    draft token kept only if it is the one sampled), so the tokens are the model's distribution;
    seeded alike, the swarm's draw equals transformers' own."""
    model, reference = models
    ids = random_ids(1, 5, seed=43).repeat(1, 3)
    settings = {
        "do_sample": True,
        "top_k": 20,
        "max_new_tokens": 10,
        "prompt_lookup_num_tokens": 3,
        **no_eos(reference),
    }
    torch.manual_seed(8)
    ours = model.generate(ids, **settings)
    torch.manual_seed(8)
    theirs = reference.generate(ids, **settings)
    assert torch.equal(ours, theirs)


def test_the_speculative_model_drafts_with_a_small_model_and_equals_greedy(
    served: ServedModel, models: tuple[Any, Any]
) -> None:
    """Petals' speculative class: a draft model that often disagrees (its LM head perturbed, as
    Petals' test does) costs rejected windows, never a different token."""
    _, reference = models
    draft = copy.deepcopy(reference)
    with torch.no_grad():
        head = draft.get_output_embeddings().weight
        head += torch.randn(head.shape, generator=torch.Generator().manual_seed(5)) * 0.05
    model = AutoDistributedSpeculativeModel.from_pretrained(
        served.folder, initial_peers=served.initial_peers, small_model=draft
    )
    try:
        assert not any(p is head for p in model.parameters())  # the draft is not ours
        ids = random_ids(1, 6, seed=44)
        settings = {"do_sample": False, "max_new_tokens": 12, **no_eos(reference)}
        plain = reference.generate(ids, **settings)
        assert torch.equal(model.generate(ids, **settings), plain)
        window = draft.generation_config.num_assistant_tokens
        fixed = model.generate(ids, speculative_inference_iteration_size=3, **settings)
        assert torch.equal(fixed, plain)
        assert draft.generation_config.num_assistant_tokens == window  # set for the call only
    finally:
        model.shutdown()
    with pytest.raises(ConfigError, match="needs small_model="):
        AutoDistributedSpeculativeModel.from_pretrained(
            served.folder, initial_peers=served.initial_peers
        )
