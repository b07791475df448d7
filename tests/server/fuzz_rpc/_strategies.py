"""Hypothesis strategies drawing every kind of fuzzing example."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hypothesis import strategies as st

from petals_core.protocol import BACKWARD, FORWARD

from ._cases import MUTATIONS, Concurrent, Opening, RawStream, Steps, Transfer
from ._harness import Case
from ._wire import (
    ATTN_CACHE_TOKENS,
    CANARY_ID,
    CANARY_TOKENS,
    FLOAT_DTYPES,
    FLOAT_FILLS,
    HIDDEN,
    INT_DTYPES,
    INT_FILLS,
    LIMITS,
    MAX_FRAME_BYTES,
    METHODS,
    MISSING,
    RawTag,
    TensorSpec,
    frame,
)

_text = st.text(st.characters(codec="utf-8"), max_size=8)
#: Any value the codec can carry, none of them meaningful.
junk: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64 - 1),
    st.sampled_from([2**63, -(2**63), 2**64 - 1, -(2**64), -1, 0]),
    st.floats(),
    _text,
    st.binary(max_size=8),
    st.lists(st.integers(-3, 10), max_size=4),
    st.dictionaries(_text, st.integers(-(2**64), 2**64 - 1), max_size=2),
)


def float_tensors(shape: st.SearchStrategy[tuple[int, ...]]) -> st.SearchStrategy[TensorSpec]:
    return st.builds(TensorSpec, st.sampled_from(FLOAT_DTYPES), shape, st.sampled_from(FLOAT_FILLS))


def any_tensors(shape: st.SearchStrategy[tuple[int, ...]]) -> st.SearchStrategy[TensorSpec]:
    ints = st.builds(
        TensorSpec,
        st.sampled_from((*INT_DTYPES, "bool")),
        shape,
        st.sampled_from(INT_FILLS),
    )
    return st.one_of(float_tensors(shape), ints)


#: Small shapes of any rank (at most 8**4 elements).
small_shapes = st.lists(st.integers(0, 8), max_size=4).map(tuple)
raw_tags = st.builds(
    RawTag,
    st.sampled_from(["float64", "complex64", "float32", "int64", "bool", "", "x" * 17]),
    st.lists(
        st.one_of(st.integers(0, 70), st.sampled_from([2**31, 2**32, 2**63, 2**64 - 1])),
        max_size=10,
    ).map(tuple),
    st.integers(0, 300),
)


def _some_hostile(
    draw: st.DrawFn, fields: Mapping[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]]
) -> tuple[dict[str, Any], bool]:
    """Draw every field from its valid strategy but none, one or two from their hostile ones;
    also whether all were drawn valid.  Fields drawn as ``MISSING`` are left out."""
    hostile = draw(st.sets(st.sampled_from(sorted(fields)), max_size=2))
    message = {name: draw(fields[name][name in hostile]) for name in fields}
    return {k: v for k, v in message.items() if v != MISSING}, not hostile


valid_blocks = st.tuples(st.integers(0, 5), st.integers(1, 6)).filter(lambda b: b[0] < b[1])


@st.composite
def openings(draw: st.DrawFn) -> Opening:
    fields = {
        "session_id": (
            st.text(st.characters(codec="utf-8"), min_size=1, max_size=20).filter(
                lambda s: s != CANARY_ID and len(s.encode()) <= 128
            ),
            st.one_of(
                st.sampled_from([MISSING, "", CANARY_ID, "x" * 129]),
                junk.filter(lambda v: not isinstance(v, str)),
            ),
        ),
        "blocks": (
            valid_blocks.map(list),
            st.one_of(
                st.sampled_from([MISSING, [3, 3], [4, 2], [0, 7], [-1, 2], [0], [0, 1, 2], "0:6"]),
                st.sampled_from([[True, 2], [0, 2**63], [0.0, 2.0], [0, 2**64 - 1]]),
                junk,
            ),
        ),
        "max_length": (
            st.one_of(st.integers(1, 64), st.sampled_from([4096, 8192])),
            st.one_of(
                st.sampled_from([MISSING, 0, -1, 8193, 2**63, 1.5, "8", True]),
                junk.filter(lambda v: not (type(v) is int and 1 <= v <= 8192)),
            ),
        ),
        "batch_size": (
            st.one_of(st.just(MISSING), st.integers(1, 3), st.just(LIMITS.max_batch_tokens)),
            st.one_of(
                st.sampled_from([0, -5, LIMITS.max_batch_tokens + 1, 2**63, 1.0, False]),
                junk.filter(lambda v: not (type(v) is int and 1 <= v <= LIMITS.max_batch_tokens)),
            ),
        ),
        "alloc_timeout": (
            st.one_of(st.just(MISSING), st.sampled_from([0, 0.0, 0.01, 1e308])),
            st.sampled_from([-1, -0.0001, math.nan, math.inf, "1", True, [1]]),
        ),
        "active_adapter": (
            st.sampled_from([MISSING, None, ""]),
            st.one_of(st.sampled_from(["nope", "lora"]), st.integers(-9, 9), st.lists(_text)),
        ),
        "points": (
            st.one_of(st.just(MISSING), st.floats(allow_nan=False, allow_infinity=False)),
            st.sampled_from([math.nan, math.inf, -math.inf, "1", True, None, [0.5]]),
        ),
    }
    message, valid = _some_hostile(draw, fields)
    if valid:
        # Valid fields, but the cache it asks for may not fit next to the canary's: refused.
        start, end = message["blocks"]
        tokens = message.get("batch_size", 1) * message["max_length"] * (end - start)
        valid = tokens <= ATTN_CACHE_TOKENS * 6 - CANARY_TOKENS
    extra = draw(st.dictionaries(_text.filter(lambda k: k not in fields), junk, max_size=2))
    return Opening({**message, **extra}, valid)


@st.composite
def steps_cases(draw: st.DrawFn) -> Steps:
    start, end = draw(valid_blocks)
    batch = draw(st.integers(1, 3))
    max_length = draw(st.integers(1, 32))
    nblocks = end - start
    hidden_shapes = st.one_of(
        st.tuples(st.just(batch), st.integers(0, max_length + 2), st.just(HIDDEN)),
        st.tuples(st.integers(0, 4), st.integers(0, 3), st.sampled_from([HIDDEN, 1, 63, 65])),
        small_shapes,
    )
    in_range = st.builds(
        TensorSpec,
        st.sampled_from(INT_DTYPES),
        st.just((batch,)),
        st.sampled_from(["ints", "zeros"]),
    )
    fields = {
        "hidden_states": (
            float_tensors(st.tuples(st.just(batch), st.integers(0, 12), st.just(HIDDEN))),
            st.one_of(any_tensors(hidden_shapes), raw_tags, junk, st.just(MISSING)),
        ),
        "start_from_position": (
            st.one_of(st.just(MISSING), st.just(None), st.integers(0, max_length)),
            st.one_of(
                st.integers(-3, max_length + 3),
                st.sampled_from([2**63, -(2**63), 2**64 - 1, True, 1.0, "0"]),
            ),
        ),
        "hypo_ids": (
            st.one_of(st.just(MISSING), st.just(None), in_range),
            st.one_of(
                any_tensors(st.one_of(st.just((batch,)), small_shapes)),
                st.builds(
                    TensorSpec,
                    st.sampled_from(INT_DTYPES),
                    st.just((batch,)),
                    st.sampled_from(INT_FILLS),
                ),
                junk,
            ),
        ),
        "prompts": (
            st.one_of(
                st.just(MISSING),
                st.just(None),
                float_tensors(
                    st.tuples(
                        st.just(nblocks),
                        st.sampled_from([1, batch]),
                        st.integers(0, 3),
                        st.just(HIDDEN),
                    )
                ),
            ),
            st.one_of(
                float_tensors(
                    st.tuples(
                        st.sampled_from([nblocks, nblocks + 1, 0]),
                        st.sampled_from([1, batch, batch + 1]),
                        st.integers(0, 4),
                        st.sampled_from([HIDDEN, 3]),
                    )
                ),
                any_tensors(small_shapes),
                junk,
            ),
        ),
    }

    @st.composite
    def steps(draw: st.DrawFn) -> dict[str, Any]:
        return _some_hostile(draw, fields)[0]

    return Steps(
        (start, end),
        batch,
        max_length,
        tuple(draw(st.lists(steps(), min_size=1, max_size=4))),
        draw(st.booleans()),
    )


concurrent_cases = st.builds(
    Concurrent,
    st.lists(st.sampled_from(["a", "a", "b", CANARY_ID, "c", "d", "e"]), min_size=2, max_size=10)
    .map(tuple)
    .map(
        lambda ids: tuple(s if s == "a" or s == CANARY_ID else f"{s}{i}" for i, s in enumerate(ids))
    ),
)


@st.composite
def transfers(draw: st.DrawFn) -> Transfer:
    method = draw(st.sampled_from([FORWARD, BACKWARD]))
    start, end = draw(valid_blocks)
    batch, tokens = draw(st.integers(1, 2)), draw(st.integers(1, 6))
    shape = (batch, tokens, HIDDEN)
    tensors = {"hidden_states": draw(float_tensors(st.just(shape)))}
    if method == BACKWARD:
        tensors["grad_outputs"] = draw(float_tensors(st.just(shape)))
    if draw(st.booleans()):
        prompt_shape = (
            end - start,
            draw(st.sampled_from([1, batch])),
            draw(st.integers(0, tokens)),
        )
        tensors["prompts"] = draw(float_tensors(st.just((*prompt_shape, HIDDEN))))
    meta: dict[str, Any] = {"blocks": [start, end]}
    if draw(st.integers(0, 3)) == 0:
        key, value = draw(
            st.sampled_from(
                [
                    ("blocks", [0, 7]),
                    ("blocks", [2, 2]),
                    ("blocks", None),
                    ("active_adapter", "nope"),
                    ("active_adapter", 5),
                    ("points", math.nan),
                    ("points", "1"),
                ]
            )
        )
        meta[key] = value
    return Transfer(
        method,
        meta,
        tensors,
        per_part=draw(st.sampled_from([1 << 20, 64, 7, 1])),
        mutation=draw(st.one_of(st.none(), st.sampled_from(MUTATIONS))),
        index=draw(st.integers(0, 1000)),
        huge_shape=draw(
            st.sampled_from([(2**32, 2**32), (2**63, 2), (2**64 - 1,) * 8, (1 << 28, 2), (-1, 4)])
        ),
        abandon_after=draw(st.sampled_from([None, None, None, 0, 1, 2, 5, 30])),
    )


@st.composite
def raw_streams(draw: st.DrawFn) -> RawStream:
    kind = draw(st.sampled_from(["bytes", "header+", "truncated", "oversized"]))
    method = draw(
        st.one_of(st.sampled_from(METHODS), st.sampled_from(["", "petals.", "x" * 300]), _text)
    )
    data = draw(
        st.one_of(
            st.binary(max_size=64),
            st.builds(frame, st.fixed_dictionaries({"msg": junk})),
            st.builds(frame, st.fixed_dictionaries({"call": junk})),
            st.builds(frame, st.dictionaries(_text, junk, max_size=3)),
            st.builds(
                lambda tag: frame({"msg": {"hidden_states": tag}}),
                raw_tags,
            ),
        )
    )
    return RawStream(
        kind,
        method,
        data,
        cut=draw(st.integers(0, 200)),
        length=draw(
            st.one_of(
                st.integers(0, 1 << 16),
                st.integers(MAX_FRAME_BYTES - 4, 2**32 - 1),
            )
        ),
        abandon=draw(st.sampled_from(["", "reset", "unread"])),
    )


@st.composite
def raw_tag_steps(draw: st.DrawFn) -> Steps:
    """A session whose step carries a hand-written tensor tag (float64, complex, huge shapes)."""
    step = {"hidden_states": draw(raw_tags)}
    return Steps((0, 2), 1, 8, (step,))


def cases() -> st.SearchStrategy[Case]:
    """Every kind of hostile example, about equally often."""
    return st.one_of(
        raw_streams(),
        openings(),
        steps_cases(),
        raw_tag_steps(),
        concurrent_cases,
        transfers(),
    )
