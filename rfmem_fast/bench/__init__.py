"""Benchmark suite of rfmem_fast (``rfmem bench``; DESIGN.md, "Benchmark workloads").

Modules:

* :mod:`~rfmem_fast.bench.workloads`: sizes ("32K" tokens, "1e6" vectors), the seeded
  synthetic clustered banks and queries, PersonaBench embeddings (MiniLM, cached).
* :mod:`~rfmem_fast.bench.systems`: the systems run side by side (our backends through
  :func:`rfmem_fast.search`, faiss ``IndexFlatIP``, the reference backend one query at
  a time) and the timing helpers.
* :mod:`~rfmem_fast.bench.runners`: the workloads latency, batch, multitenant,
  personabench (:class:`Bench`, :class:`BenchSettings`).
* :mod:`~rfmem_fast.bench.report`: headline ratios, JSON, tables.
* :mod:`~rfmem_fast.bench.plots`: PNG plots.
* :mod:`~rfmem_fast.bench.cli`: the ``rfmem bench`` sub-command (``add_parser``, ``main``).

Example::

    rfmem bench --quick --threads 1         # ~15 s on 2 CPU cores (+~25 s once: PersonaBench embeddings)
    rfmem bench                             # full: 32K/128K/1M tokens, 1e5/1e6 shared, 1000 x 4096
    python bench/run_bench.py --workloads latency --scales 32K,1M,4M
"""
from __future__ import annotations

from .runners import WORKLOADS, Bench, BenchSettings
from .workloads import SyntheticSpec, parse_size, synthetic_bank

__all__ = ["WORKLOADS", "Bench", "BenchSettings", "SyntheticSpec", "parse_size", "synthetic_bank"]
