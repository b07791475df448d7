"""The endpoint with the official ``openai`` client, in front of a real 2-server SmolLM2 swarm."""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.parse
from typing import Any

import openai
import pytest
import torch
import trio
from hypothesis import HealthCheck, given, settings, strategies as st

from petals_core.api import Message
from petals_core.api._detokenize import text_bytes

from ._endpoint import LIMITS, post_scope

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
DEADLINE_S = 60.0


def _greedy_reference(endpoint: Any, messages: list[dict[str, str]], max_new: int) -> list[int]:
    """``model.generate``'s greedy tokens for the chat (the endpoint's own model, from this
    thread), up to and without the end-of-sequence token."""
    engine = endpoint.api.engine
    prompt = engine.encode_chat([Message(**m) for m in messages])
    output = engine.model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)
    tokens = []
    for token in output[0, len(prompt) :].tolist():
        if token in engine.eos_token_ids:
            break
        tokens.append(token)
    return tokens


def _wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {DEADLINE_S} s: {what}")
        time.sleep(0.05)


def test_models_lists_the_served_model(endpoint: Any, client: Any) -> None:
    assert [model.id for model in client.models.list().data] == [endpoint.repo]
    assert client.models.retrieve(endpoint.repo).id == endpoint.repo
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("no/such-model")


def test_greedy_chat_answer_equals_generate(endpoint: Any, client: Any) -> None:
    expected = _greedy_reference(endpoint, CHAT, 24)
    answer = client.chat.completions.create(
        model=endpoint.repo, messages=CHAT, max_tokens=24, temperature=0
    )
    engine = endpoint.api.engine
    choice = answer.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == engine.decode(expected)
    assert choice.finish_reason == ("length" if len(expected) == 24 else "stop")
    assert answer.usage.completion_tokens == len(expected)
    assert answer.usage.prompt_tokens == len(engine.encode_chat([Message(**CHAT[0])]))
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + len(expected)
    assert answer.object == "chat.completion"
    assert answer.model == endpoint.repo
    # The endpoint tokenizes the chat as the tokenizer's own apply_chat_template does.
    reference = engine.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    if not isinstance(reference, list):
        reference = reference["input_ids"]
    assert engine.encode_chat([Message(**CHAT[0])]) == list(reference)
    # top_p 0 keeps only the likeliest token, whatever the temperature.
    narrowest = client.chat.completions.create(
        model=endpoint.repo, messages=CHAT, max_tokens=24, temperature=1.5, top_p=0, seed=3
    )
    assert narrowest.choices[0].message.content == choice.message.content


def test_answers_are_decoded_while_prompts_are_being_tokenized(endpoint: Any, client: Any) -> None:
    # Long prompts hold the tokenizer that prompts are encoded with (here, the test holds it),
    # and more wait for it than trio has worker threads; answers are decoded with another
    # tokenizer and their steps find threads, so a request given token ids is not held up.
    engine = endpoint.api.engine
    waiting = 45
    answers: list[Any] = []

    def chat() -> None:
        answers.append(
            client.chat.completions.create(model=endpoint.repo, messages=CHAT, max_tokens=1)
        )

    threads = [threading.Thread(target=chat) for _ in range(waiting)]
    with engine._encoder_lock:
        for thread in threads:
            thread.start()
        # One is tokenizing (held by the lock), the others wait their turn.
        _wait_for(
            lambda: engine.encode_limiter.statistics().tasks_waiting == waiting - 1,
            "the chats to wait for the tokenizer",
        )
        answer = client.completions.create(
            model=endpoint.repo, prompt=[504, 3458, 282], max_tokens=6, temperature=0
        )
    assert answer.usage.completion_tokens >= 1
    assert answer.choices[0].text
    for thread in threads:
        thread.join(DEADLINE_S)
    assert len(answers) == waiting
    assert all(answer.usage.completion_tokens == 1 for answer in answers)


def test_streamed_chat_equals_the_plain_answer_with_usage_and_logprobs(
    endpoint: Any, client: Any
) -> None:
    settings: dict[str, Any] = {
        "model": endpoint.repo,
        "messages": CHAT,
        "max_tokens": 16,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    plain = client.chat.completions.create(**settings)
    chunks = list(
        client.chat.completions.create(
            **settings, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == plain.choices[0].finish_reason
    assert all(reason is None for reason in finishes[:-1])
    # Asked for, the usage comes in a chunk of its own at the end, and on no other.
    assert chunks[-1].choices == []
    assert chunks[-1].usage == plain.usage
    assert all(chunk.usage is None for chunk in chunks[:-1])
    # Otherwise on the last chunk (every answer counts its tokens).
    unasked = list(client.chat.completions.create(**settings, stream=True))
    assert unasked[-1].choices and unasked[-1].usage == plain.usage
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    whole = plain.choices[0].logprobs.content
    assert len(whole) == len(streamed) == plain.usage.completion_tokens
    for token, other in zip(whole, streamed, strict=True):
        assert token.token == other.token
        assert token.logprob == pytest.approx(other.logprob, abs=1e-4)
        assert len(token.top_logprobs) == 3
        # Greedy: the token taken is the likeliest one.
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob, abs=1e-6)
        assert token.logprob <= 0.0
        assert bytes(token.bytes) == text_bytes(token.token)
    # A token's bytes are the text's: together, the answer's.
    answer = b"".join(bytes(token.bytes) for token in whole)
    assert answer.decode() == plain.choices[0].message.content


def test_a_scored_continuation_ending_the_answer_keeps_its_end_token(
    endpoint: Any, client: Any
) -> None:
    # lm-evaluation-harness scores a continuation from max_tokens=1 with echo: it reads every
    # token but the generated one, which must be there even when it ends the answer.
    engine = endpoint.api.engine
    chat = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
    ]
    prompt = engine.tokenizer.apply_chat_template(chat, tokenize=False, continue_final_message=True)
    scored = client.completions.create(
        model=endpoint.repo, prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    (choice,) = scored.choices
    assert choice.finish_reason == "stop"  # the model ends its turn here
    assert choice.text == prompt  # as sent (its special tokens' text too)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == scored.usage.prompt_tokens + 1
    assert logprobs.tokens[-1] in {engine.token_text(token) for token in engine.eos_token_ids}
    assert logprobs.token_logprobs[-1] is not None and logprobs.token_logprobs[-1] <= 0
    assert scored.usage.completion_tokens == 0


def test_prompt_scoring_stops_when_its_request_is_cancelled(endpoint: Any) -> None:
    engine = endpoint.api.engine
    hidden = torch.zeros(1, 200, engine.model.config.hidden_size)
    assert engine._prompt_logprobs(hidden, [list(range(200))], 0, lambda: True) is None
    scored = engine._prompt_logprobs(hidden[:, :3], [[1, 2, 3]], 0, lambda: False)
    assert scored is not None and len(scored[0]) == 3


def test_logprobs_of_tokens_inside_a_character_give_its_bytes(endpoint: Any, client: Any) -> None:
    prompt = "日本の首都は東京です"
    scored = client.completions.create(
        model=endpoint.repo, prompt=prompt, max_tokens=0, echo=True, logprobs=0
    )
    tokens = scored.choices[0].logprobs.tokens
    assert any(token.startswith("bytes:\\x") for token in tokens)  # characters split up
    assert b"".join(text_bytes(token) for token in tokens).decode() == prompt


def test_seeded_completions_repeat_and_stop_at_stop_sequences(endpoint: Any, client: Any) -> None:
    settings: dict[str, Any] = {
        "model": endpoint.repo,
        "prompt": ["Once upon a time", "The sky is"],
        "max_tokens": 12,
        "n": 2,
        "seed": 1234,
        "temperature": 0.9,
        "top_p": 0.95,
        "stop": ["."],
        "logprobs": 2,
    }
    first = client.completions.create(**settings)
    again = client.completions.create(**settings)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert sorted(c.index for c in first.choices) == [0, 1, 2, 3]
    for choice in first.choices:
        assert "." not in choice.text
        assert choice.finish_reason in ("stop", "length")
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs)
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert first.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in first.choices)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(**settings, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[c.index] for c in first.choices] == [c.text for c in first.choices]


def test_completions_take_token_ids_and_echo(endpoint: Any, client: Any) -> None:
    engine = endpoint.api.engine
    ids = engine.encode_prompt("The capital of Italy is")
    by_ids = client.completions.create(model=endpoint.repo, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(
        model=endpoint.repo,
        prompt="The capital of Italy is",
        max_tokens=6,
        temperature=0,
        echo=True,
    )
    assert by_text.choices[0].text == "The capital of Italy is" + by_ids.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def _prompt_logprobs(engine: Any, ids: list[int]) -> torch.Tensor:
    """Each prompt token's log-probability after the ones before it, from the model's forward
    pass over the whole prompt (through the swarm, from this thread)."""
    with torch.no_grad():
        logits = engine.model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def test_echo_with_logprobs_scores_the_prompt_as_the_model_does(endpoint: Any, client: Any) -> None:
    engine = endpoint.api.engine
    prompts = ["The capital of Italy is Rome", "Hi there"]
    ids = [engine.encode_prompt(prompt) for prompt in prompts]
    expected = [_prompt_logprobs(engine, prompt_ids) for prompt_ids in ids]

    # What lm-evaluation-harness asks to score a text: the prompt echoed with its logprobs,
    # nothing generated.
    scored = client.completions.create(
        model=endpoint.repo, prompt=prompts, max_tokens=0, echo=True, logprobs=2
    )
    assert scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == sum(len(prompt_ids) for prompt_ids in ids)
    for choice in scored.choices:
        prompt_ids = ids[choice.index]
        assert choice.text == prompts[choice.index]
        assert choice.finish_reason == "length"
        logprobs = choice.logprobs
        assert logprobs.tokens == [engine.token_text(token) for token in prompt_ids]
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        got = torch.tensor(logprobs.token_logprobs[1:])
        torch.testing.assert_close(got, expected[choice.index], atol=1e-4, rtol=0)
        for value, top in zip(logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True):
            assert 1 <= len(top) <= 2 and max(top.values()) >= value - 1e-6
        for token, offset in zip(logprobs.tokens, logprobs.text_offset, strict=True):
            assert choice.text[offset : offset + len(token)] == token

    # With a completion after it, plain and streamed (n=2): the prompt's part, then the tokens.
    settings: dict[str, Any] = {
        "model": endpoint.repo,
        "prompt": prompts[0],
        "max_tokens": 3,
        "echo": True,
        "logprobs": 1,
        "temperature": 0,
        "n": 2,
    }
    whole = client.completions.create(**settings)
    for choice in whole.choices:
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(ids[0]) + whole.usage.completion_tokens // 2
        got = torch.tensor(logprobs.token_logprobs[1 : len(ids[0])])
        torch.testing.assert_close(got, expected[0], atol=1e-4, rtol=0)
        assert logprobs.text_offset[len(ids[0])] == len(prompts[0])
        assert choice.text.startswith(prompts[0])
    texts = ["", ""]
    streamed_logprobs: list[list[float | None]] = [[], []]
    for chunk in client.completions.create(**settings, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.logprobs is not None:
                streamed_logprobs[choice.index] += choice.logprobs.token_logprobs
    for index, choice in enumerate(whole.choices):
        assert texts[index] == choice.text
        assert streamed_logprobs[index] == choice.logprobs.token_logprobs


def test_concurrent_requests_each_get_their_own_answer(endpoint: Any, client: Any) -> None:
    engine = endpoint.api.engine
    questions = ["France", "Italy", "Japan", "Spain"]
    answers: dict[str, Any] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(questions))

    def ask(country: str) -> None:
        try:
            barrier.wait(timeout=DEADLINE_S)
            answers[country] = client.chat.completions.create(
                model=endpoint.repo,
                messages=[{"role": "user", "content": f"What is the capital of {country}?"}],
                max_tokens=12,
                temperature=0,
                logprobs=True,
            )
        except BaseException as exc:
            errors.append(exc)

    engine.peak_running = 0
    engine._lineups.clear()  # fresh counts
    threads = [threading.Thread(target=ask, args=(q,)) for q in questions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE_S * 2)
    assert not errors, errors
    assert engine.peak_running > 1  # they did run at the same time
    # Their decode steps went together: some batch of the LM head held several requests.
    batches, batched = engine.decode_batches
    assert batched > batches
    # Each answer is the greedy continuation of its own question: teacher-forced through the
    # model, every token it chose is the likeliest there (up to batching's rounding).
    for country, answer in answers.items():
        message = Message(role="user", content=f"What is the capital of {country}?")
        prompt = engine.encode_chat([message])
        chosen = [engine.encode_prompt(t.token) for t in answer.choices[0].logprobs.content]
        tokens = [ids[0] for ids in chosen]
        assert len(tokens) == answer.usage.completion_tokens
        with torch.no_grad():
            logits = engine.model(torch.tensor([prompt + tokens])).logits[0]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        for step, token in enumerate(tokens):
            row = logprobs[len(prompt) - 1 + step]
            assert row[token] >= row.max() - 1e-3, (country, step)


def _stream_request(endpoint: Any, body: dict[str, Any]) -> tuple[Any, Any]:
    url = urllib.parse.urlsplit(endpoint.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=DEADLINE_S)
    connection.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    reply = connection.getresponse()
    assert reply.status == 200
    return connection, reply


def test_a_disconnect_mid_stream_frees_the_servers_caches(endpoint: Any) -> None:
    engine = endpoint.api.engine
    before = endpoint.server_infos()
    assert all(info.open_sessions == 0 for info in before)
    body = {
        "model": endpoint.repo,
        "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
        "max_tokens": LIMITS.max_request_tokens - 64,
        "stream": True,
    }
    connection, reply = _stream_request(endpoint, body)
    events = 0
    while events < 4:
        line = reply.readline()
        assert line, "the stream ended early"
        events += line.startswith(b"data: ")
    assert all(info.open_sessions == 1 for info in endpoint.server_infos())
    assert engine.running == 1
    connection.sock.close()  # the client goes away mid-stream
    connection.close()
    _wait_for(lambda: engine.running == 0, "the generation stops")
    _wait_for(
        lambda: all(info.open_sessions == 0 for info in endpoint.server_infos()),
        "the servers close the session",
    )
    after = endpoint.server_infos()
    assert [i.cache_tokens_left for i in after] == [i.cache_tokens_left for i in before]


def test_a_disconnect_before_a_plain_answer_stops_its_generation(endpoint: Any) -> None:
    engine = endpoint.api.engine
    interrupted = engine.interrupted
    body = _long_story(endpoint, "cat")
    url = urllib.parse.urlsplit(endpoint.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=DEADLINE_S)
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    _wait_for(lambda: engine.running == 1, "the generation starts")
    _wait_for(
        lambda: all(info.open_sessions == 1 for info in endpoint.server_infos()),
        "the servers open the session",
    )
    connection.sock.close()  # gone before the answer
    connection.close()
    _wait_interrupted(endpoint, interrupted)


def _long_story(endpoint: Any, about: str, **fields: Any) -> bytes:
    """A chat request whose answer runs long (nearly to the endpoint's limit)."""
    return json.dumps(
        {
            "model": endpoint.repo,
            "messages": [{"role": "user", "content": f"Write a long story about a {about}."}],
            "max_tokens": LIMITS.max_request_tokens - 64,
            **fields,
        }
    ).encode()


def _wait_interrupted(endpoint: Any, interrupted: int) -> None:
    """Wait for one more interrupted generation than ``interrupted``, and its sessions closed."""
    engine = endpoint.api.engine
    _wait_for(lambda: engine.interrupted == interrupted + 1, "the generation is interrupted")
    _wait_for(lambda: engine.running == 0, "the generation stops")
    _wait_for(
        lambda: all(info.open_sessions == 0 for info in endpoint.server_infos()),
        "the servers close the session",
    )


def test_a_client_leaving_as_its_stream_begins_stops_the_generation(endpoint: Any) -> None:
    """The client leaves as its stream begins (before the stream reads its first event, with
    sse-starlette): the generation ends all the same."""
    from petals_core.api import create_app

    engine = endpoint.api.engine
    interrupted = engine.interrupted
    body = _long_story(endpoint, "fox", stream=True)
    scope = post_scope("/v1/chat/completions")

    async def leave() -> list[str]:
        received = 0

        async def receive() -> dict[str, Any]:
            nonlocal received
            received += 1
            if received == 1:
                return {"type": "http.request", "body": body, "more_body": False}
            return {"type": "http.disconnect"}

        sent: list[str] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message["type"])
            await trio.lowlevel.checkpoint()  # as a server's send does: others run meanwhile

        with trio.fail_after(DEADLINE_S):
            await create_app(engine)(scope, receive, send)
        return sent

    assert endpoint.run(leave)[0] == "http.response.start"
    _wait_interrupted(endpoint, interrupted)


def test_a_generation_cut_short_by_shutdown_counts_as_interrupted(endpoint: Any) -> None:
    from petals_core.api import Chunk, Engine, Limits, Sampling

    prompt = endpoint.api.engine.encode_prompt("Once upon a time")

    async def shut_down_mid_answer() -> tuple[int, int]:
        async with trio.open_nursery() as nursery:
            engine = Engine(
                endpoint.api.engine.model,
                endpoint.api.engine.tokenizer,
                name="short-lived",
                limits=Limits(max_concurrent_requests=1),
                nursery=nursery,
            )
            sampling = Sampling(max_tokens=64, temperature=0.0)
            async with engine.generate([prompt], sampling) as events:
                assert isinstance(await anext(events), Chunk)
                nursery.cancel_scope.cancel()  # the endpoint shuts down
        return engine.completed, engine.interrupted

    assert endpoint.run(shut_down_mid_answer) == (0, 1)


def test_requests_beyond_the_queue_are_refused_with_429(endpoint: Any) -> None:
    """An engine that runs one request and queues none: a second one at the same time gets 429,
    and the first is unaffected. With a queue of one, a request that leaves the queue frees its
    place at once."""
    from petals_core.api import ApiError, Chunk, Engine, Limits, Sampling, Usage

    prompt = endpoint.api.engine.encode_prompt("Once upon a time")
    sampling = Sampling(max_tokens=4, temperature=0.0)

    def small_engine(nursery: trio.Nursery, queued: int) -> Engine:
        return Engine(
            endpoint.api.engine.model,
            endpoint.api.engine.tokenizer,
            name="small",
            limits=Limits(max_concurrent_requests=1, max_queued_requests=queued),
            nursery=nursery,
        )

    async def two_at_once() -> tuple[list[Any], ApiError]:
        async with trio.open_nursery() as nursery:
            engine = small_engine(nursery, 0)
            async with engine.generate([prompt], sampling) as events:
                with pytest.raises(ApiError) as refused:
                    engine.generate([prompt], sampling)
                received = [event async for event in events]
        return received, refused.value

    received, refused = endpoint.run(two_at_once)
    assert refused.status == 429 and refused.code == "too_many_requests"

    async def one_left_the_queue() -> list[Any]:
        async with trio.open_nursery() as nursery:
            engine = small_engine(nursery, 1)
            async with engine.generate([prompt], sampling) as events:
                async with engine.generate([prompt], sampling):
                    pass  # queued behind the first, then gone
                async with engine.generate([prompt], sampling) as third:
                    received = [event async for event in events]
                    received += [event async for event in third]
            assert engine.interrupted == 1
        return received

    async def waiting_for_the_tokenizer() -> ApiError:
        """Requests waiting for the tokenizer count as waiting: with one turn and no queue, a
        second request while the first is tokenized gets 429 before it is tokenized."""
        async with trio.open_nursery() as nursery:
            engine = small_engine(nursery, 0)
            held, release = trio.Event(), threading.Event()

            def slow() -> list[int]:
                trio.from_thread.run_sync(held.set)
                release.wait()
                return prompt

            nursery.start_soon(engine.tokenize, slow)
            await held.wait()
            try:
                with pytest.raises(ApiError) as refused:
                    await engine.tokenize(lambda: prompt)
            finally:
                release.set()
        return refused.value

    refused = endpoint.run(waiting_for_the_tokenizer)
    assert refused.status == 429 and refused.code == "too_many_requests"

    events = endpoint.run(one_left_the_queue)
    assert sum(isinstance(event, Usage) for event in events) == 2
    assert isinstance(received[-1], Usage) and received[-1].completion_tokens >= 1
    assert all(isinstance(event, Chunk) for event in received[:-1])


def test_a_conversation_sends_the_answer_back_as_the_client_returns_it(
    endpoint: Any, client: Any
) -> None:
    """The openai package sends an answer's message back as it got it (with ``refusal``)."""
    messages: list[Any] = [{"role": "user", "content": "Hi!"}]
    first = client.chat.completions.create(
        model=endpoint.repo, messages=messages, max_tokens=8, temperature=0
    )
    messages += [first.choices[0].message, {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(
        model=endpoint.repo, messages=messages, max_tokens=4, temperature=1e-40
    )
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_a_stop_sequence_is_never_sent_in_part(endpoint: Any) -> None:
    """Text that may begin a stop sequence is held back, also while its last character is
    still incomplete (a character spread over several tokens)."""
    from petals_core.api import Sampling

    engine = endpoint.api.engine
    stop = "x\U0001f600"  # x, then an emoji that takes several tokens
    tokens = engine.encode_prompt("ab" + stop + "cd")
    job = engine.job([[1]], Sampling(max_tokens=64, stop=(stop,)), 64)
    chunks = []
    for token in tokens:
        emitted, done = job.on_tokens(torch.tensor([token]))
        chunks += emitted
        if done:
            break
    assert "".join(chunk.text for chunk in chunks) == "ab"
    assert chunks[-1].finish_reason == "stop"


def test_decode_groups_give_the_same_answers(endpoint: Any) -> None:
    """Requests spread over two decode groups get the greedy answers of one group; a group
    count that is not a positive integer is refused."""
    from petals_core.api import Chunk, Engine, Limits, Sampling

    base = endpoint.api.engine
    prompts = [base.encode_prompt(text) for text in ("Once upon a time", "The sky is", "Hi")]
    sampling = Sampling(max_tokens=6, temperature=0.0)

    async def answers(groups: int) -> tuple[list[str], int]:
        async with trio.open_nursery() as nursery:
            engine = Engine(
                base.model,
                base.tokenizer,
                name="grouped",
                limits=Limits(),
                nursery=nursery,
                decode_groups=groups,
            )
            texts = [""] * len(prompts)

            async def ask(index: int) -> None:
                async with engine.generate([prompts[index]], sampling) as events:
                    async for event in events:
                        if isinstance(event, Chunk):
                            texts[index] += event.text

            async with trio.open_nursery() as asking:
                for index in range(len(prompts)):
                    asking.start_soon(ask, index)
        return texts, len(engine._lineups)

    one, made_one = endpoint.run(lambda: answers(1))
    two, made_two = endpoint.run(lambda: answers(2))
    assert (made_one, made_two) == (1, 2)
    assert one == two and all(one)

    async def refused() -> None:
        async with trio.open_nursery() as nursery:
            for bad, error in ((0, ValueError), (-1, ValueError), (1.5, TypeError)):
                with pytest.raises(error, match="decode_groups"):
                    Engine(
                        base.model,
                        base.tokenizer,
                        name="x",
                        limits=Limits(),
                        nursery=nursery,
                        decode_groups=bad,  # type: ignore[arg-type]
                    )

    endpoint.run(refused)


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    prompts=st.lists(
        st.sampled_from(["The capital of Italy is", "日本の首都は", "Hi", "a b c d e f g"]),
        min_size=1,
        max_size=2,
    ),
    max_tokens=st.integers(0, 3),
    n=st.integers(1, 2),
    logprobs=st.integers(0, 2),
    stream=st.booleans(),
)
def test_echoed_scores_line_up_with_the_text_for_any_request(
    endpoint: Any,
    client: Any,
    prompts: list[str],
    max_tokens: int,
    n: int,
    logprobs: int,
    stream: bool,
) -> None:
    settings_: dict[str, Any] = {
        "model": endpoint.repo,
        "prompt": prompts,
        "max_tokens": max_tokens,
        "n": n,
        "echo": True,
        "logprobs": logprobs,
        "seed": 5,
    }
    texts = [""] * (len(prompts) * n)
    tokens: list[list[str]] = [[] for _ in texts]
    offsets: list[list[int]] = [[] for _ in texts]
    answers = client.completions.create(**settings_, stream=True) if stream else None
    chunks = list(answers) if answers is not None else [client.completions.create(**settings_)]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.logprobs is not None:
                tokens[choice.index] += choice.logprobs.tokens
                offsets[choice.index] += choice.logprobs.text_offset
    for index, text in enumerate(texts):
        assert text.startswith(prompts[index // n])
        assert offsets[index] == sorted(offsets[index])
        assert all(0 <= offset <= len(text) for offset in offsets[index])
        assert len(tokens[index]) >= len(endpoint.api.engine.encode_prompt(prompts[index // n]))


def test_events_nobody_reads_are_bounded_and_then_given_up(endpoint: Any) -> None:
    """A request's events wait for their reader in a channel of bounded size, and its steps
    never wait for room there: once the reader is that far behind, the request is given up on
    (interrupted, its session closed), what it left is dropped, and the reader learns it."""
    from petals_core.api import Sampling
    from petals_core.api._engine import EVENTS_PER_ROW, SlowReader

    engine = endpoint.api.engine
    completed, interrupted = engine.completed, engine.interrupted
    prompt = engine.encode_prompt(", ".join(str(number) for number in range(1, 30)) + ",")
    sampling = Sampling(max_tokens=3 * EVENTS_PER_ROW, temperature=0.0)  # counts on and on
    generation = engine.generate([prompt], sampling)

    async def start() -> Any:
        return await generation.__aenter__()

    events = endpoint.run(start)  # and not read
    ended = completed + interrupted
    _wait_for(
        lambda: engine.running == 0 and engine.completed + engine.interrupted > ended,
        "the generation ends",
    )
    assert (engine.completed, engine.interrupted) == (completed, interrupted + 1)

    async def read() -> None:
        try:
            with pytest.raises(SlowReader):
                await anext(events)
        finally:
            await generation.__aexit__(None, None, None)

    endpoint.run(read)
    _wait_for(
        lambda: all(info.open_sessions == 0 for info in endpoint.server_infos()),
        "the servers close the session",
    )


def test_a_client_that_stops_reading_its_stream_is_given_up(
    endpoint: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that keeps its connection open but stops reading its stream (the server's write
    to it waits) is given up on once it falls ``EVENTS_PER_ROW`` events behind: the generation
    stops and its session closes while the response still waits to write. A client that reads
    again gets an error event and the stream's end, with no ``[DONE]`` and no error logged."""
    from petals_core.api import create_app
    from petals_core.api._engine import EVENTS_PER_ROW

    engine = endpoint.api.engine
    abandoned, interrupted = engine.abandoned, engine.interrupted
    prompt = ", ".join(str(number) for number in range(1, 30)) + ","
    body = json.dumps(
        {
            "model": endpoint.repo,
            "prompt": prompt,
            "max_tokens": 3 * EVENTS_PER_ROW,  # counts on and on
            "temperature": 0,
            "stream": True,
        }
    ).encode()
    scope = post_scope("/v1/completions")

    async def stop_reading() -> tuple[list[dict[str, Any]], bool]:
        requested = False

        async def receive() -> dict[str, Any]:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": body, "more_body": False}
            await trio.sleep_forever()  # the client keeps its connection open
            raise AssertionError

        reading = trio.Event()
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                await reading.wait()  # the client's window is full until it reads again
            sent.append(message)

        answered = False

        async def answer() -> None:
            nonlocal answered
            await create_app(engine)(scope, receive, send)
            answered = True

        def given_up() -> None:
            _wait_for(
                lambda: engine.abandoned > abandoned and engine.running == 0,
                "the endpoint gives up on the stream",
            )
            _wait_for(
                lambda: all(info.open_sessions == 0 for info in endpoint.server_infos()),
                "the servers close the session",
            )

        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(answer)
                await trio.to_thread.run_sync(given_up)
                waiting = not answered
                reading.set()
        return sent, waiting

    with caplog.at_level(logging.WARNING):
        sent, waiting = endpoint.run(stop_reading)
    assert waiting  # given up on while its response still waited to write
    assert (engine.abandoned, engine.interrupted) == (abandoned + 1, interrupted + 1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [
        f"gave up on a request whose reader fell {EVENTS_PER_ROW} events per row behind "
        "(its client stopped reading its stream)"
    ]
    assert (sent[0]["type"], sent[0]["status"]) == ("http.response.start", 200)
    assert sent[-1]["more_body"] is False
    stream = b"".join(message.get("body", b"") for message in sent).decode()
    data = [line[len("data: ") :] for line in stream.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in data
    error = json.loads(data[-1])["error"]
    assert error["code"] == "slow_reader"
    assert error["type"] == "invalid_request_error"
    assert f"{EVENTS_PER_ROW} events per choice behind" in error["message"]
    # What it was sent before it stopped reading, and nothing of what was dropped.
    assert [json.loads(line)["object"] for line in data[:-1]] == ["text_completion"]
