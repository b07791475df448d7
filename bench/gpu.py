"""``python -m bench gpu``: everything that runs on a GPU, measured within one 10-minute command.

On one H100 the default run takes at most 8.5 minutes, server starts included.  Each phase runs in
a process of its own under a time limit: a phase that fails, hangs or breaks the GPU's
context costs that phase alone.  A phase records what it measures as it goes into ``gpu.json``
(under ``bench/results``, or the folder ``$BENCH_RESULTS`` names), and one killed at its limit
keeps what it recorded.  The phases, in order, with their limits in seconds:

1. **tests** (150): the tests marked ``cuda`` (skipped in CPU runs) with compiled Triton kernels:
   decode graphs against the eager path (every family, captured at load too), a client on the
   GPU, quantised blocks against bf16; each file in a pytest process of its own (at most 75 s,
   each test at most 30 s), its cases recorded as it ends.  Judged: every test passes.
2. **kernels** (60): :mod:`bench.kernels_cuda`: each kernel's parity, each row naming the path
   that ran and each path forced once; decode attention eagerly and replayed from a CUDA graph
   against SDPA; the row-table kernel's splits and tiles; prefill.
3. **trust** (25): :func:`bench.trust.honest_disagreement` with the session on the GPU and the
   checks replayed on the CPU, in float32, bfloat16 and float16: how far two honest servers on
   different hardware differ, against the bound a check allows.  Judged: no honest answer
   beyond it.
4. **swarm-llama** (90), **swarm-bloom** (70): :mod:`bench._gpu_swarm`, one family each: fp32
   parity with transformers, bf16 decode and prefill beside transformers' eager model, 1, 8 and
   32 concurrent sessions (each level warmed untimed first), the servers' memory and graphs.
5. **transport** (25): :mod:`bench.transport`'s quick sizes, QUIC against trio TCP on this host.
6. **api** (85): the OpenAI endpoint in front of 2 bf16 servers of a random TinyLlama-shaped
   model on this GPU (:mod:`bench.api`): HTTP against ``generate()`` per token, 1, 4 and 8
   concurrent requests.

Then the targets, each MET, NOT MET or NOT MEASURED (its phase failed, was killed, or did not
run); the process exits 0 only if every target is MET.  ``--phases``, ``--families`` and
``--variants`` (nf4 and int8 beside fp32 and bf16) choose what runs; ``--limit PHASE=SECONDS``
changes a phase's limit.

``--dry-run``: the same phases on the CPU at the smallest sizes that run their code (tiny models,
the kernels through Triton's interpreter, nothing timed on a GPU), into ``gpu-dry-run.json``: a
check of the benchmark itself, whose numbers mean nothing (its GPU targets are NOT MEASURED).
bench/README.md lists the packages a bare CUDA machine lacks and how to bring them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from . import _report
from ._report import print_table, summarize

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("tests", "kernels", "trust", "swarm", "transport", "api")
FAMILIES = ("llama", "bloom", "falcon", "mixtral")
DEFAULT_FAMILIES = ("llama", "bloom")
DEFAULT_VARIANTS = ("fp32", "bf16")
#: Each phase's limit in seconds on a GPU (a family's swarm phase: its own).
LIMITS_S = {
    "tests": 150.0,
    "kernels": 60.0,
    "trust": 25.0,
    "swarm-llama": 90.0,
    "swarm-bloom": 70.0,
    "swarm-falcon": 110.0,
    "swarm-mixtral": 110.0,
    "transport": 25.0,
    "api": 85.0,
}
#: The same on the CPU, at the dry run's sizes.
DRY_LIMITS_S = {name: 120.0 for name in LIMITS_S}
#: After the limit, how long a phase has to end on SIGTERM before it is killed.
GRACE_S = 10.0
#: A CUDA test running longer fails (pytest-timeout), and the others go on.
TEST_TIMEOUT_S = 30
#: A file of CUDA tests running longer is killed, and the next file runs.
FILE_LIMIT_S = 75.0
DRY_FILE_LIMIT_S = 110.0
CONCURRENCY = (1, 8, 32)
DRY_CONCURRENCY = (1, 4)
ATTENTION_BATCHES = (1, 8)
ATTENTION_LENGTHS = (1024, 4096, 16384)
PEAK_FRACTION_TARGET = 0.85
DECODE_TARGET_MS = 6.0
DECODE_VS_TRANSFORMERS = 0.25
SESSIONS_SPEEDUP = 15.0
LOGITS_TOLERANCE = 1e-4
RTT_RATIO = 3.0
API_PER_TOKEN = 1.05
API_SPEEDUP = 4.0


@attrs.frozen(kw_only=True)
class Plan:
    """What a run measures."""

    phases: tuple[str, ...]  # swarm expanded into one phase per family
    families: tuple[str, ...]
    variants: tuple[str, ...]
    dry: bool
    limits: dict[str, float]

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"


# -- the record of a run -------------------------------------------------------------------------


class Store:
    """``gpu.json`` (``gpu-dry-run.json``): what each phase recorded, rewritten whole (through a
    temporary file, so a reader never sees half of it) at every change."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def start(self, results: dict[str, Any]) -> None:
        self._write(results)

    def read(self) -> dict[str, Any]:
        results: dict[str, Any] = json.loads(self.path.read_text())["results"]
        return results

    def update(self, change: Callable[[dict[str, Any]], None]) -> None:
        results = self.read()
        change(results)
        self._write(results)

    def record(self, phase: str, part: dict[str, Any]) -> None:
        """Merge ``part`` into what ``phase`` measured."""

        def merge(results: dict[str, Any]) -> None:
            entry = results["phases"].setdefault(phase, {"status": "running"})
            entry.setdefault("data", {}).update(part)

        self.update(merge)

    def _write(self, results: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".json.tmp")
        document = _report.document(self.path.stem, results)
        temporary.write_text(json.dumps(document, indent=2, default=str))
        os.replace(temporary, self.path)


# -- the parent: phases in processes of their own, then the targets -------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated phases")
    parser.add_argument(
        "--families",
        default=",".join(DEFAULT_FAMILIES),
        help=f"comma-separated, of {', '.join(FAMILIES)}",
    )
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help="the swarm's server variants, of fp32 (always), bf16, nf4, int8",
    )
    parser.add_argument("--dry-run", action="store_true", help="every phase, tiny, on the CPU")
    parser.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="PHASE=SECONDS",
        help="a phase's time limit (a swarm phase is named swarm-FAMILY)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a phase, in its own process
    args = parser.parse_args([] if argv is None else argv)
    plan = _plan(parser, args)
    store = Store(_report.RESULTS / ("gpu-dry-run.json" if plan.dry else "gpu.json"))
    if args.child:
        _child(plan, store, args.child)
        return
    status = run(plan, store)
    if status:
        raise SystemExit(status)


def _plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Plan:
    phases = [phase for phase in args.phases.split(",") if phase]
    families = tuple(family for family in args.families.split(",") if family)
    variants = tuple(dict.fromkeys(["fp32", *(v for v in args.variants.split(",") if v)]))
    unknown = (
        [p for p in phases if p not in PHASES]
        + [f for f in families if f not in FAMILIES]
        + [v for v in variants if v not in ("fp32", "bf16", "nf4", "int8")]
    )
    if unknown:
        parser.error(f"unknown phase, family or variant: {', '.join(unknown)}")
    expanded = []
    for phase in phases:
        expanded += [f"swarm-{family}" for family in families] if phase == "swarm" else [phase]
    limits = dict(DRY_LIMITS_S if args.dry_run else LIMITS_S)
    for item in args.limit:
        name, _, seconds = item.partition("=")
        if name not in limits:
            parser.error(f"--limit {item}: no phase {name!r}")
        try:
            limits[name] = float(seconds)
        except ValueError:
            parser.error(f"--limit {item}: SECONDS must be a number")
    return Plan(
        phases=tuple(expanded),
        families=families,
        variants=variants,
        dry=args.dry_run,
        limits=limits,
    )


def run(plan: Plan, store: Store) -> int:
    """Every phase of ``plan`` in turn, then the targets; 0 if all are MET, else 1."""
    import torch

    if not plan.dry and not torch.cuda.is_available():
        raise SystemExit("bench.gpu needs a CUDA GPU (or --dry-run): no CUDA device here")
    environment = _environment(plan)
    store.start(
        {
            "environment": environment,
            "dry_run": plan.dry,
            "limits_s": {phase: plan.limits[phase] for phase in plan.phases},
            "phases": {},
        }
    )
    print_table("environment", ["what", "value"], list(environment.items()))
    started = time.monotonic()
    for phase in plan.phases:
        print(f"\n== {phase} (at most {plan.limits[phase]:.0f} s) ==", flush=True)
        status, seconds = _run_phase(plan, phase)
        print(f"== {phase}: {status} in {seconds:.0f} s ==", flush=True)

        store.update(
            lambda results, phase=phase, status=status, seconds=seconds: (
                results["phases"].setdefault(phase, {}).update(status=status, seconds=seconds)
            )
        )
    verdicts = judge(plan, store.read())
    store.update(lambda results: results.update(targets=verdicts))
    _print_phases(plan, store.read())
    _print_targets(verdicts)
    print(f"\nall phases in {time.monotonic() - started:.0f} s; wrote {store.path}")
    return 0 if all(v["status"] == "MET" for v in verdicts) else 1


def _finish(store: Store, phase: str, status: str, seconds: float) -> None:
    def change(results: dict[str, Any]) -> None:
        results["phases"].setdefault(phase, {}).update(status=status, seconds=seconds)

    store.update(change)


def _run_phase(plan: Plan, phase: str) -> tuple[str, float]:
    """Run ``phase`` in a process of its own (a process group: its servers too) and wait at most
    its limit; then SIGTERM, and after a grace period SIGKILL.  Returns (status, seconds)."""
    command = [sys.executable, "-m", "bench.gpu", "--child", phase]
    command += ["--families", ",".join(plan.families), "--variants", ",".join(plan.variants)]
    command += ["--dry-run"] if plan.dry else []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if plan.dry:
        # The kernels run on CPU tensors through Triton's interpreter; one thread per process.
        env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    else:
        env.pop("TRITON_INTERPRET", None)
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
    try:
        code = process.wait(timeout=plan.limits[phase])
    except subprocess.TimeoutExpired:
        _end_group(process)
        return f"killed at its limit of {plan.limits[phase]:.0f} s", time.monotonic() - started
    _end_group(process)  # whatever it left behind (a server still loading, say)
    seconds = time.monotonic() - started
    return ("done" if code == 0 else f"failed (exit status {code})"), seconds


def _end_group(process: subprocess.Popen[bytes]) -> None:
    """End the phase's process group: SIGTERM, up to :data:`GRACE_S` for every member to leave
    (servers announce themselves offline), then SIGKILL for those still there, whatever the
    phase's process did meanwhile.  Nothing of a phase outlives it into the next."""
    _signal_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        if process.poll() is not None and not _group_alive(process.pid):
            break
        time.sleep(0.1)
    _signal_group(process.pid, signal.SIGKILL)
    process.wait()


def _group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _signal_group(pid: int, number: signal.Signals) -> None:
    try:
        os.killpg(pid, number)
    except ProcessLookupError:
        pass


def _environment(plan: Plan) -> dict[str, Any]:
    import torch

    versions: dict[str, str | None] = {}
    for package in ("torch", "triton", "transformers", "bitsandbytes", "aioquic", "trio"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    if plan.dry:
        return {"gpu": None, "cpus": os.cpu_count(), "kernel": os.uname().release, **versions}
    properties = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    return {
        "gpu": properties.name,
        "multiprocessors": properties.multi_processor_count,
        "gpu_memory_gib": total / 2**30,
        "gpu_free_gib": free / 2**30,
        "cpus": os.cpu_count(),
        "kernel": os.uname().release,
        **versions,
    }


def _print_phases(plan: Plan, results: dict[str, Any]) -> None:
    rows = []
    for phase in plan.phases:
        entry = results["phases"].get(phase, {})
        rows.append([phase, entry.get("status", "not run"), entry.get("seconds"),
                     plan.limits[phase]])  # fmt: skip
    print_table("phases", ["phase", "status", "seconds", "limit s"], rows)


# -- the child: one phase ------------------------------------------------------------------------


def _child(plan: Plan, store: Store, phase: str) -> None:
    def record(part: dict[str, Any]) -> None:
        store.record(phase, part)

    try:
        if phase == "tests":
            _tests(plan, record)
        elif phase == "kernels":
            _kernels(plan, record)
        elif phase == "trust":
            _trust(plan, record)
        elif phase.startswith("swarm-"):
            _swarm(plan, phase.removeprefix("swarm-"), record)
        elif phase == "transport":
            _transport(plan, record)
        elif phase == "api":
            _api(plan, record)
        else:
            raise ValueError(f"no phase {phase!r}")
    except BaseException:
        record({"error": traceback.format_exc()})
        raise


def _tests(plan: Plan, record: Callable[[dict[str, Any]], None]) -> None:
    # Every test marked ``cuda``; only the files that hold one are collected, which keeps the
    # CPU parity tests (they select Triton's interpreter for the whole process) out.  Each file
    # runs in a pytest process of its own under FILE_LIMIT_S, and its cases are recorded when it
    # ends: a file that hangs (a wait in C that pytest-timeout's signal cannot interrupt) costs
    # itself alone, and faulthandler prints every thread's stack into the log before it is killed.
    files = sorted(
        str(path.relative_to(ROOT))
        for path in ROOT.glob("tests/**/test_*.py")
        if "pytest.mark.cuda" in path.read_text()
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1" if plan.dry else "4"}
    if not plan.dry:
        env["TRITON_INTERPRET"] = "0"
    limit = DRY_FILE_LIMIT_S if plan.dry else FILE_LIMIT_S
    cases: list[dict[str, Any]] = []
    codes: list[int] = []
    record({"files": files, "running": True, "cases": cases})
    with tempfile.TemporaryDirectory() as folder:
        for file in files:
            junit = Path(folder) / "report.xml"
            junit.unlink(missing_ok=True)
            command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                       "-m", "cuda", f"--junitxml={junit}", "--durations=5",
                       "-o", f"faulthandler_timeout={TEST_TIMEOUT_S + 5}", file]  # fmt: skip
            if importlib.util.find_spec("pytest_timeout") is not None:
                command[4:4] = ["--timeout", str(TEST_TIMEOUT_S)]  # a hung test fails, alone
            print(f"-- {file} (at most {limit:.0f} s)", flush=True)
            process = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
            try:
                codes.append(process.wait(timeout=limit))
            except subprocess.TimeoutExpired:
                codes.append(-int(signal.SIGKILL))
                cases.append(
                    {"test": file, "outcome": "error", "message": f"killed after {limit:.0f} s"}
                )
            _end_group(process)
            if junit.exists():
                cases.extend(_junit_cases(junit))
            record({"cases": cases, "exit_codes": dict(zip(files, codes, strict=False))})
    counts = {o: sum(c["outcome"] == o for c in cases) for o in ("passed", "failed", "error")}
    counts["skipped"] = sum(c["outcome"] == "skipped" for c in cases)
    # pytest exits 5 when a file's cuda tests were all deselected: not a failure.
    code = max((c for c in codes if c not in (0, 5)), key=abs, default=0)
    record({"running": False, "exit_code": code, "counts": counts, "cases": cases})
    print_table("CUDA tests", ["files", "passed", "failed", "errors", "skipped"],
                [[len(files), counts["passed"], counts["failed"], counts["error"],
                  counts["skipped"]]])  # fmt: skip
    for case in cases:
        if case["outcome"] in ("failed", "error"):
            print(f"{case['outcome'].upper()} {case['test']}: {case['message']}")


def _junit_cases(junit: Path) -> list[dict[str, Any]]:
    cases = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", None
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = (child.get("message") or "")[:500]
        name = f"{case.get('classname')}::{case.get('name')}"
        cases.append({"test": name, "outcome": outcome, "message": message})
    return cases


def _kernels(plan: Plan, record: Callable[[dict[str, Any]], None]) -> None:
    import torch

    from . import kernels_cuda

    kernels_cuda.measure(torch.device(plan.device), record=record)


def _swarm(plan: Plan, family: str, record: Callable[[dict[str, Any]], None]) -> None:
    from . import _gpu_swarm

    setup = _gpu_swarm.SwarmSetup(
        device=plan.device,
        family=family,
        variants=plan.variants,
        concurrency=DRY_CONCURRENCY if plan.dry else CONCURRENCY,
        dry=plan.dry,
    )
    measured: dict[str, Any] = {}

    def keep(part: dict[str, Any]) -> None:
        measured.update(part)
        record(part)

    _gpu_swarm.run(setup, keep)
    _gpu_swarm.print_family(setup, measured)


#: Sessions per dtype of the trust phase (each 16 checked answers), on a GPU and in a dry run.
TRUST_SESSIONS = {"float32": 20, "bfloat16": 60, "float16": 60}
DRY_TRUST_SESSIONS = 2


def _trust(plan: Plan, record: Callable[[dict[str, Any]], None]) -> None:
    from petals_core.client._checks import TOLERANCE

    from . import trust

    rows = []
    found_all: dict[str, Any] = {}
    for dtype, sessions in TRUST_SESSIONS.items():
        found = trust.honest_disagreement(
            dtype, DRY_TRUST_SESSIONS if plan.dry else sessions, device=plan.device
        )
        bound = TOLERANCE[dtype]
        found_all[dtype] = {
            "answers": len(found),
            "max": max(found),
            "p999": _report.percentile(found, 0.999),
            "bound": bound,
            "beyond_bound": sum(value > bound for value in found),
        }
        record({"device": plan.device, "honest": found_all})
        rows.append([dtype, len(found), f"{_report.percentile(found, 0.999):.2e}",
                     f"{max(found):.2e}", bound, found_all[dtype]["beyond_bound"]])  # fmt: skip
    print_table(
        f"trust: answers on {plan.device} against replays on the CPU (relative L2 per token)",
        ["dtype", "answers", "p99.9", "max", "bound", "beyond"],
        rows,
    )


def _transport(plan: Plan, record: Callable[[dict[str, Any]], None]) -> None:
    from . import transport

    results = transport.measure(quick=True, tiny=plan.dry)
    transport.report(results)
    rows = results["rows"]
    results["headline"] = {
        "rtt_quic_ms": rows["RTT reused stream ms (median)"]["quic"],
        "rtt_tcp_ms": rows["RTT reused stream ms (median)"]["tcp"],
        "bulk_1452_mb_s": rows["bulk, 1452 B datagrams, MB/s"]["quic"],
        "bulk_16k_mb_s": rows["bulk, 16 KiB datagrams, MB/s"]["quic"],
    }
    record(results)


def _api(plan: Plan, record: Callable[[dict[str, Any]], None]) -> None:
    from . import api

    argv = ["--device", plan.device, "--random"] + (["--smoke"] if plan.dry else [])
    report = api.main(argv, progress=record)  # what is measured is recorded at once
    if report is not None:
        record(report)


# -- targets -------------------------------------------------------------------------------------

#: A target's measurement: (ours, the baseline in the same unit or None, met); a KeyError,
#: IndexError, TypeError or StopIteration while reading it means it was not measured.
Reading = Callable[[], tuple[float, float | None, bool]]


def _data(results: dict[str, Any], phase: str) -> dict[str, Any]:
    data: dict[str, Any] = results["phases"][phase]["data"]
    return data


def targets(plan: Plan) -> Iterator[tuple[str, str, str, Callable[[dict[str, Any]], Any]]]:
    """Every target ``plan`` can judge: (what, target in words, unit, reading of the results)."""
    if "tests" in plan.phases:

        def tests(results: dict[str, Any]) -> tuple[float, float | None, bool]:
            counts = _data(results, "tests")["counts"]
            bad = counts["failed"] + counts["error"]
            if counts["passed"] == 0 and bad == 0:
                raise KeyError("no CUDA test ran")
            code = _data(results, "tests")["exit_code"]
            return float(bad), None, bad == 0 and code == 0

        yield "CUDA tests failing", "0", "tests", tests
    if "kernels" in plan.phases:

        def parity(results: dict[str, Any]) -> tuple[float, float | None, bool]:
            rows = _data(results, "kernels")["parity"]
            bad = sum(not row["ok"] for row in rows)
            return float(bad), None, bad == 0 and len(rows) > 0

        yield "kernel parity rows off their bound", "0", "rows", parity
        for batch in ATTENTION_BATCHES:
            for length in ATTENTION_LENGTHS:

                def attention(
                    results: dict[str, Any], batch: int = batch, length: int = length
                ) -> tuple[float, float | None, bool]:
                    shape = next(
                        s
                        for s in _data(results, "kernels")["decode_attention"]
                        if (s["batch"], s["length"]) == (batch, length)
                    )
                    sdpa = min(shape["graph_sdpa_us"], shape["eager_sdpa_us"])
                    return shape["graph_rows_us"], sdpa, shape["graph_rows_us"] <= sdpa

                name = f"decode attention B{batch} S{length // 1024}k, graph rows vs SDPA"
                yield name, "<= SDPA", "us", attention

        def peak(results: dict[str, Any]) -> tuple[float, float | None, bool]:
            shape = next(
                s
                for s in _data(results, "kernels")["decode_attention"]
                if (s["batch"], s["length"]) == (8, 16384)
            )
            fraction = float(shape["graph_rows_peak_fraction"])
            return fraction, None, fraction >= PEAK_FRACTION_TARGET

        yield "decode attention B8 S16k, fraction of peak", f">= {PEAK_FRACTION_TARGET}", "", peak
    for family in plan.families:
        phase = f"swarm-{family}"
        if phase not in plan.phases:
            continue
        if family == "llama" and "bf16" in plan.variants:

            def decode(results: dict[str, Any]) -> tuple[float, float | None, bool]:
                ours = _data(results, "swarm-llama")["bf16"]["ours"]["decode_ms"]
                return ours, None, ours <= DECODE_TARGET_MS

            def versus(results: dict[str, Any]) -> tuple[float, float | None, bool]:
                bf16 = _data(results, "swarm-llama")["bf16"]
                ours, theirs = bf16["ours"]["decode_ms"], bf16["transformers"]["decode_ms"]
                return ours / theirs, None, ours <= DECODE_VS_TRANSFORMERS * theirs

            yield "TinyLlama bf16 decode ms/token", f"<= {DECODE_TARGET_MS}", "ms", decode
            yield (
                "TinyLlama bf16 decode vs transformers eager",
                f"<= {DECODE_VS_TRANSFORMERS}",
                "ratio",
                versus,
            )
        if "bf16" in plan.variants:

            def sessions(
                results: dict[str, Any], phase: str = phase
            ) -> tuple[float, float | None, bool]:
                rates = {
                    c["sessions"]: c["tokens_per_s"] for c in _data(results, phase)["concurrency"]
                }
                ratio = rates[32] / rates[1]
                return ratio, None, ratio >= SESSIONS_SPEEDUP

            yield f"{family}: 32 sessions vs one, tokens/s", f">= {SESSIONS_SPEEDUP}", "x", sessions

        def logits(results: dict[str, Any], phase: str = phase) -> tuple[float, float | None, bool]:
            diff = _data(results, phase)["fp32"]["logits_max_abs_diff"]
            return diff, None, diff <= LOGITS_TOLERANCE

        def greedy(results: dict[str, Any], phase: str = phase) -> tuple[float, float | None, bool]:
            equal = bool(_data(results, phase)["fp32"]["greedy_equal"])
            return float(equal), None, equal

        yield f"{family}: fp32 logits max |diff|", f"<= {LOGITS_TOLERANCE}", "", logits
        yield f"{family}: fp32 greedy tokens equal", "equal", "", greedy
    if "trust" in plan.phases:

        def honest(results: dict[str, Any]) -> tuple[float, float | None, bool]:
            data = _data(results, "trust")
            found = data["honest"]
            if data["device"] != "cuda" or set(found) != set(TRUST_SESSIONS):
                raise KeyError("not every dtype was measured on a GPU")
            beyond = sum(entry["beyond_bound"] for entry in found.values())
            return float(beyond), None, beyond == 0

        yield (
            "trust: honest GPU answers beyond the check's bound (CPU replays)",
            "0",
            "answers",
            honest,
        )
    if "transport" in plan.phases:

        def rtt(results: dict[str, Any]) -> tuple[float, float | None, bool]:
            headline = _data(results, "transport")["headline"]
            ratio = headline["rtt_quic_ms"] / headline["rtt_tcp_ms"]
            return ratio, None, ratio <= RTT_RATIO

        yield "transport RTT, QUIC / trio TCP", f"<= {RTT_RATIO}", "x", rtt
    if "api" in plan.phases:

        def per_token(results: dict[str, Any]) -> tuple[float, float | None, bool]:
            ms = _data(results, "api")["per_token_ms"]
            ratio = ms["http_stream"] / ms["generate"]
            return ratio, None, ratio <= API_PER_TOKEN

        def concurrent(results: dict[str, Any]) -> tuple[float, float | None, bool]:
            rates = _data(results, "api")["concurrency"]
            ratio = rates["8"]["tokens_per_s"] / rates["1"]["tokens_per_s"]
            return ratio, None, ratio >= API_SPEEDUP

        yield "api: ms/token, HTTP streaming vs generate()", f"<= {API_PER_TOKEN}", "x", per_token
        yield "api: tokens/s, 8 concurrent requests vs 1", f">= {API_SPEEDUP}", "x", concurrent


def judge(plan: Plan, results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of ``plan``: MET, NOT MET, or NOT MEASURED (its phase failed, was killed or
    did not run, or measured something else), with what was measured."""
    verdicts = []
    for what, target, unit, reading in targets(plan):
        try:
            ours, baseline, met = reading(results)
        except (KeyError, IndexError, TypeError, StopIteration, ZeroDivisionError):
            verdicts.append({"what": what, "target": target, "status": "NOT MEASURED"})
            continue
        status = "MET" if met else "NOT MET"
        verdicts.append(
            {"what": what, "target": target, "status": status, "ours": ours, "baseline": baseline}
        )
        summarize("gpu", what, ours, baseline, unit=unit, target=target, met=met)
    return verdicts


def _print_targets(verdicts: list[dict[str, Any]]) -> None:
    print_table(
        "targets",
        ["what", "ours", "baseline", "target", "status"],
        [[v["what"], v.get("ours"), v.get("baseline"), v["target"], v["status"]]
         for v in verdicts],
    )  # fmt: skip
    counts = {s: sum(v["status"] == s for v in verdicts) for s in ("MET", "NOT MET")}
    unmeasured = len(verdicts) - counts["MET"] - counts["NOT MET"]
    print(f"targets: {counts['MET']} MET, {counts['NOT MET']} NOT MET, {unmeasured} NOT MEASURED")


if __name__ == "__main__":
    main(sys.argv[1:])
