"""``echo``: a completion's answer begins with the prompt as the client sent it, and the prompt's
tokens' logprobs sit at their places in it."""

from __future__ import annotations

from typing import Any

from petals_core.api._tokenizing import token_starts

#: A chat written out by hand: SmolLM2's tokenizer reads its markers as special tokens, which
#: decoding leaves out.
PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def test_the_echo_is_the_prompt_as_sent(endpoint: Any, client: Any) -> None:
    engine = endpoint.api.engine
    ids = engine.encode_prompt(PROMPT)
    assert engine.decode(ids) != PROMPT  # the round trip through the tokenizer changes it
    settings: dict[str, Any] = {"model": endpoint.repo, "temperature": 0, "echo": True}

    plain = client.completions.create(prompt=PROMPT, max_tokens=3, **settings).choices[0]
    assert plain.text.startswith(PROMPT) and len(plain.text) > len(PROMPT)
    streamed = client.completions.create(prompt=PROMPT, max_tokens=3, stream=True, **settings)
    assert "".join(chunk.choices[0].text for chunk in streamed) == plain.text

    scored = client.completions.create(prompt=PROMPT, max_tokens=0, logprobs=1, **settings)
    logprobs = scored.choices[0].logprobs
    assert scored.choices[0].text == PROMPT
    assert logprobs.tokens == [engine.token_text(token) for token in ids]
    for token, offset in zip(logprobs.tokens, logprobs.text_offset, strict=True):
        assert PROMPT[offset : offset + len(token)] == token

    answered = client.completions.create(prompt=PROMPT, max_tokens=3, logprobs=1, **settings)
    choice = answered.choices[0]
    assert choice.text.startswith(PROMPT)
    offsets = choice.logprobs.text_offset
    assert offsets[: len(ids)] == logprobs.text_offset
    assert offsets[len(ids)] == len(PROMPT)  # the answer's first token, right after the echo
    text = ""
    streamed_offsets: list[int] = []
    for chunk in client.completions.create(
        prompt=PROMPT, max_tokens=3, logprobs=1, stream=True, **settings
    ):
        text += chunk.choices[0].text
        streamed_offsets += chunk.choices[0].logprobs.text_offset
    assert (text, streamed_offsets) == (choice.text, offsets)

    # Token ids are echoed as their text.
    by_ids = client.completions.create(prompt=ids, max_tokens=0, **settings).choices[0]
    assert by_ids.text == engine.decode(ids)


def test_tokens_start_along_the_text_they_were_read_from() -> None:
    # A start token added (no text), a leading space left out of a span, two tokens of one
    # character, an end token added.
    spans = [(0, 0), (0, 5), (6, 11), (11, 12), (11, 12), (12, 12)]
    assert token_starts(spans) == (0, 0, 5, 11, 11, 12)
    assert token_starts([]) == ()
