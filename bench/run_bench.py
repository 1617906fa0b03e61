#!/usr/bin/env python
"""Run the benchmark suite: the same code and flags as ``rfmem bench``.

Examples::

    python bench/run_bench.py --quick
    python bench/run_bench.py                          # the full preset (~10 min on 2 CPU cores)
    python bench/run_bench.py --workloads latency --scales 32K,128K,1M,4M --backends native
    python bench/run_bench.py --workloads batch --shared-sizes 1e6 --batch-sizes 1,64,1024

Results: bench/results/local/bench-<timestamp>.json (+ -latency.png, -throughput.png).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rfmem_fast.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
