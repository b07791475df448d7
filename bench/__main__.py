"""``python -m bench [NAME ...]``: run the named benchmarks, or all of them.

Each benchmark prints its own tables and writes ``bench/results/NAME.json``; at the end one
"Summary" table gathers every benchmark's headline numbers (``bench/results/summary.json``).
"""

from __future__ import annotations

import argparse
import importlib

from ._report import print_summary, summary_rows, write_summary

BENCHMARKS = {
    "transport": "bench.transport",
    "blocks": "bench.blocks",
    "dht": "bench.dht",
    "server": "bench.server",
    "routing": "bench.routing",
    "inference": "bench.inference",
    "swarm": "bench.swarm",
    "compression": "bench.compression",
    "wan": "bench.wan",
    "api": "bench.api",
}
# Run only when named: needs a CUDA GPU.
ON_DEMAND = {"kernels_cuda": "bench.kernels_cuda", "gpu": "bench.gpu"}


def main() -> None:
    parser = argparse.ArgumentParser(prog="nox -s bench --", description=__doc__)
    parser.add_argument("names", nargs="*", help=f"benchmarks to run: {', '.join(BENCHMARKS)}")
    args = parser.parse_args()
    known = BENCHMARKS | ON_DEMAND
    unknown = [name for name in args.names if name not in known]
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(known)}")
    try:
        for name in args.names or list(BENCHMARKS):
            importlib.import_module(known[name]).main()
    finally:
        # Also after a failure: the benchmarks that did run keep their headline numbers.
        print_summary()
        if summary_rows():
            write_summary()


if __name__ == "__main__":
    main()
