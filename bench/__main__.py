"""``python -m bench [NAME ...]``: run the named benchmarks, or all of them.

Each benchmark prints its own tables and writes ``bench/results/NAME.json``; at the end one
"Summary" table gathers every benchmark's headline numbers (``bench/results/summary.json``).
Options after a single name go to that benchmark (``python -m bench gpu --dry-run``).
"""

from __future__ import annotations

import argparse
import importlib
import inspect

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
    "nat": "bench.nat",
    "api": "bench.api",
    "trust": "bench.trust",
}
# Run only when named: the first two need a CUDA GPU.
ON_DEMAND = {
    "kernels_cuda": "bench.kernels_cuda",
    "gpu": "bench.gpu",
    # Whole benchmarks of this tree beside another tree's (``compare --against REF``).
    "compare": "bench.compare",
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="nox -s bench --", description=__doc__)
    parser.add_argument("names", nargs="*", help=f"benchmarks to run: {', '.join(BENCHMARKS)}")
    args, options = parser.parse_known_args()
    known = BENCHMARKS | ON_DEMAND
    unknown = [name for name in args.names if name not in known]
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(known)}")
    if options and len(args.names) != 1:
        parser.error(f"options {' '.join(options)} go to one benchmark: name exactly one")
    try:
        for name in args.names or list(BENCHMARKS):
            module = importlib.import_module(known[name])
            if not options:
                module.main()
            elif "argv" in inspect.signature(module.main).parameters:
                module.main(options)
            else:
                parser.error(f"{name} takes no options: {' '.join(options)}")
    finally:
        # Also after a failure: the benchmarks that did run keep their headline numbers.
        print_summary()
        if summary_rows():
            write_summary()


if __name__ == "__main__":
    main()
