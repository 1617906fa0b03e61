"""The four benchmark workloads (DESIGN.md, "Benchmark workloads").

* ``latency``: one user's memory of each token scale (32K / 128K / 1M tokens = 128 /
  512 / 4,096 chunks of 256 tokens), one query per call; p50 / p99 per system and mode.
* ``batch``: one shared bank of 10^5 .. 10^6 vectors (a single user), batches of 1, 64,
  1,024 queries; queries per second per system, mode and batch size (the native
  backend's GEMM path against faiss IndexFlatIP's BLAS), at each thread count of
  ``thread_counts``.
* ``multitenant``: U users x n items, a batch of queries each against a random user;
  our backends on the bank of each dtype of ``dtypes`` (float32 and float16 by default:
  the half-precision scan against the float32 one, same ids), at each thread count.
* ``personabench``: the real MiniLM embeddings of PersonaBench's chunks and questions;
  per-question latency per system and mode, and one whole-batch run.

The *hybrid* rows (``hybrid``: on by default): the headline backend (native where it is
built, else the first of ``backends``) searching with ``RFMemConfig.recommended()``
(hybrid dense + BM25, never recollecting) on a twin of the workload's bank that carries
an item text per row, given a text per query (:class:`~rfmem_fast.bench.systems.HybridSystem`).
The synthetic workloads generate seeded texts (:func:`~rfmem_fast.bench.workloads.synthetic_texts`:
60 Zipf words per item, a query text of 3 words of the query's item plus 5 Zipf draws);
PersonaBench uses its real chunk and question texts. They run in the latency workload
(every scale), the multi-tenant workload (float32 bank, every thread count; up to
``hybrid_max_items`` items) and PersonaBench; each record carries the same backend's
dense figure and the ratio (hybrid p50 / dense p50, hybrid q/s / dense q/s), a sample of
its rows (``check_rows``) and the fraction of those queries whose top-k differs from
dense. Generating the texts and building the lexical index is untimed (``text_build_s``).

Every workload runs the same seeded queries on the same bank through our backends
(:class:`~rfmem_fast.bench.systems.OursSystem`), faiss ``IndexFlatIP`` (dense) and the
reference backend one query at a time (on a seeded sample of the queries, bounded by a
count and a time budget). Warm-up calls run before each timed series and are excluded.
The batch and multi-tenant workloads run each of ours and faiss once per thread count
(variants pinned with :func:`~rfmem_fast.bench.systems.thread_scope`), so that scaling
shows side by side; the latency and PersonaBench workloads run at the process's threads.
Each workload returns a JSON-ready dict: its sizes, ``results`` (one record per system,
mode and size), ``route_split`` and notes.

This stays one module: the four workloads are methods of one :class:`Bench`, sharing its
settings, systems, progress bars and timed series (per query and per batch).
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .._optional import install_hint
from ..config import RFMemConfig
from .systems import (
    FaissSystem,
    HybridSystem,
    OursSystem,
    ReferenceSystem,
    System,
    agreement,
    peak_rss_bytes,
    route_summary,
    stats_ms,
    time_batches,
    time_reference,
)
from .workloads import (
    SHARED_ITEMS_PER_CLUSTER,
    SyntheticSpec,
    TextSpec,
    check_memory,
    chunks_for_tokens,
    format_count,
    format_tokens,
    personabench_embeddings,
    synthetic_bank,
    synthetic_texts,
)

WORKLOADS = ("latency", "batch", "multitenant", "personabench")


@dataclass
class BenchSettings:
    """Everything that sizes a benchmark run (the CLI's flags, resolved).

    Attributes:
        config: the RFMemConfig searched with.
        backends: our backends to run (names for :func:`rfmem_fast.get_backend`).
        device: torch device for device-capable backends (None: their default).
        faiss: run faiss IndexFlatIP beside them.
        reference: run the reference backend's per-query loop beside them.
        workloads: subset of :data:`WORKLOADS`, run in that order.
        modes: modes of the latency, multi-tenant and PersonaBench workloads.
        shared_modes: modes of the shared-bank batch workload.
        spec: synthetic data parameters.
        seed: seed of banks and queries.
        warmup: warm-up calls per system and mode (excluded from the figures).
        scales: token scales of the latency workload; chunk_tokens: tokens per chunk.
        latency_queries: timed queries per scale.
        shared_sizes: vectors of the shared bank; batch_sizes: its batch sizes;
        min_queries: each batch-size cell runs ``max(1, ceil(min_queries / bs))``
            batches.
        users, items, mt_batch: the multi-tenant bank and batch size.
        dtypes: bank dtypes of the multi-tenant workload (our backends run on each;
            the float32 bank is built, the others are :meth:`MemoryBank.astype` twins).
        thread_counts: CPU thread counts of the batch and multi-tenant workloads (each
            of ours and faiss runs once per count); None: the process's setting only.
        reference_queries: at most this many queries per reference cell (a seeded
            sample); reference_budget_s: and at most this many seconds.
        personabench: PersonaBench folder (None: skip that workload).
        pb_users_per_community, noise: the PersonaBench subset.
        cache_dir: embedding cache (None: no cache).
        encoder: optional encoder object for PersonaBench (default MiniLM).
        hybrid: run the hybrid rows (module docstring).
        hybrid_backend: their backend (None: "native" when among ``backends``, else the
            first of ``backends``).
        hybrid_max_items: the multi-tenant hybrid row runs only on banks of at most this
            many items (its text twin and index take about 1.5 KB per item and ~0.1 ms
            per item to build; the full preset's 4M items are left out, with a note).
        text_spec: the synthetic texts' parameters.
    """

    config: RFMemConfig = field(default_factory=RFMemConfig)
    backends: list[str] = field(default_factory=list)
    device: str | None = None
    faiss: bool = True
    reference: bool = True
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    modes: list[str] = field(default_factory=lambda: ["dense", "recollection", "rfmem"])
    shared_modes: list[str] = field(default_factory=lambda: ["dense", "rfmem"])
    spec: SyntheticSpec = field(default_factory=SyntheticSpec)
    seed: int = 0
    warmup: int = 5
    scales: list[int] = field(default_factory=lambda: [32 * 1024, 128 * 1024, 1024 * 1024])
    chunk_tokens: int = 256
    latency_queries: int = 200
    shared_sizes: list[int] = field(default_factory=lambda: [100_000])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 64, 1024])
    min_queries: int = 32
    users: int = 1000
    items: int = 4096
    mt_batch: int = 1024
    dtypes: list[str] = field(default_factory=lambda: ["float32"])
    thread_counts: list[int] | None = None
    reference_queries: int = 64
    reference_budget_s: float = 10.0
    personabench: Path | None = None
    pb_users_per_community: int = 3
    noise: float = 0.0
    cache_dir: Path | None = None
    encoder: Any = None
    hybrid: bool = True
    hybrid_backend: str | None = None
    hybrid_max_items: int = 1 << 20
    text_spec: TextSpec = field(default_factory=TextSpec)


#: bytes per item of a synthetic text twin (string, forward index, postings), for the memory check
TEXT_BYTES_PER_ITEM = 1536


class _NullBar:
    """Stand-in for a tqdm bar when progress is off."""

    def update(self, n: int = 1) -> None:
        """Ignore progress."""

    def set_postfix_str(self, s: str) -> None:
        """Ignore the status text."""

    def close(self) -> None:
        """Nothing to close."""


class Bench:
    """Runs the workloads of one benchmark invocation.

    Args:
        settings: the resolved sizes and systems.
        progress: show tqdm progress bars on stderr.
        say: callable receiving status lines (default: nothing).

    Raises:
        ValueError: an unknown backend name (from :func:`rfmem_fast.get_backend`).
    """

    def __init__(self, settings: BenchSettings, progress: bool = True, say: Callable[[str], None] | None = None):
        self.s = settings
        self.progress = progress
        self.say = say or (lambda msg: None)
        self.notes: list[str] = []
        self._twins: dict[tuple[int, str], Any] = {}
        # (id of a bank, dtype) -> bytes of that bank's scan copy in the dtype
        # (``BankSnapshot.scan_nbytes``), recorded as each system is prepared on it
        self.scan_nbytes: dict[tuple[int, str], int] = {}
        self.ours: list[OursSystem] = [OursSystem(b, settings.device) for b in settings.backends]
        self.reference = ReferenceSystem() if settings.reference else None
        self.faiss_ok = settings.faiss
        hb = settings.hybrid_backend or ("native" if "native" in settings.backends else (settings.backends or [None])[0])
        self.hybrid_backend: str | None = hb if settings.hybrid else None
        if settings.faiss:
            try:
                FaissSystem()
            except ImportError:
                self.faiss_ok = False
                self.notes.append(f"faiss is not installed: no faiss baseline ({install_hint('bench')})")

    # ------------------------------------------------------------------ helpers
    def _bar(self, total: int, desc: str):
        if not self.progress:
            return _NullBar()
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="cell", leave=True, dynamic_ncols=True)

    def _row_bar(self, total: int, desc: str):
        if not self.progress:
            return _NullBar()
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="vec", unit_scale=True, leave=False, dynamic_ncols=True)

    def _systems(self, modes: list[str], variants: bool = False, dtypes: list[str] | None = None) -> list[tuple[System, str]]:
        """(system, mode) pairs of a workload: ours x modes, faiss dense, reference x modes.

        With ``variants``, ours (x ``dtypes``) and faiss once per thread count of the
        settings; the float32 variants come first, then by thread count.
        """
        counts: list[int | None] = list(self.s.thread_counts or [None]) if variants else [None]
        ours: list[System] = list(self.ours)
        if variants:
            ours = [
                OursSystem(o.backend.name, self.s.device, threads=t, dtype=dt)
                for dt in (dtypes or ["float32"]) for o in self.ours for t in counts
            ]  # fmt: skip
        pairs: list[tuple[System, str]] = [(o, m) for o in ours for m in modes]
        if self.faiss_ok and "dense" in modes:
            pairs += [(FaissSystem(threads=t), "dense") for t in counts]
        if self.reference is not None:
            pairs += [(self.reference, m) for m in modes]
        return pairs

    def _bank_for(self, bank: Any, system: System) -> Any:
        """``bank`` in the dtype ``system`` searches (an :meth:`MemoryBank.astype` twin, made once)."""
        if system.dtype == bank.dtype:
            return bank
        key = (id(bank), system.dtype)
        if key not in self._twins:
            self.say(f"converting the bank to {system.dtype}")
            self._twins[key] = bank.astype(system.dtype)
        return self._twins[key]

    def _ref_sample(self, lo: int, hi: int, salt: int) -> np.ndarray:
        """The reference's seeded sample of pool indices in [lo, hi)."""
        rng = np.random.default_rng([self.s.seed, 0xEF, salt])
        idx = np.arange(lo, hi)
        rng.shuffle(idx)
        return idx[: max(1, min(self.s.reference_queries, idx.size))]

    def _hybrid_system(self, threads: int | None = None) -> HybridSystem:
        """The hybrid system: ``RFMemConfig.recommended()``'s first stage (with the run's
        ``out_k``; the second stage's cost is measured apart, bench/bench_second_stage.py) on
        the hybrid backend."""
        cfg = RFMemConfig.recommended(out_k=self.s.config.out_k, second_stage=None)
        return HybridSystem(self.hybrid_backend, self.s.device, threads=threads, config=cfg)

    @staticmethod
    def _hybrid_fields(system: HybridSystem) -> dict[str, Any]:
        return {"config": "RFMemConfig.recommended()", "search_mode": system.search_mode,
                "lexical_weight": system.config.lexical_weight, "fusion": system.config.fusion}  # fmt: skip

    @staticmethod
    def _differs(mine: dict[int, np.ndarray], dense: dict[int, np.ndarray] | None) -> float | None:
        a = agreement(mine, dense or {})
        return None if a is None else 1.0 - a

    @staticmethod
    def _check_rows(kept: dict[int, np.ndarray], n_warm: int) -> dict[str, list[int]]:
        """{query index after the warm-up rows: rows} of a kept sample (JSON object keys)."""
        return {str(int(i) - n_warm): [int(x) for x in r] for i, r in sorted(kept.items())}

    @staticmethod
    def _gpu_reset(system: System) -> None:
        if system.device is not None and system.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(system.device)

    @staticmethod
    def _gpu_peak(system: System) -> float | None:
        if system.device is not None and system.device.type == "cuda":
            return torch.cuda.max_memory_allocated(system.device) / 2**20
        return None

    def _record(self, system: System, mode: str, **fields: Any) -> dict[str, Any]:
        rec = {
            "system": system.name, "kind": system.kind, "mode": mode, "label": system.label,
            "dtype": system.dtype, "threads": system.threads,
        }  # fmt: skip
        rec.update(fields)
        gpu = self._gpu_peak(system)
        if gpu is not None:
            rec["gpu_peak_mib"] = gpu
        return rec

    # ------------------------------------------------------------------ per-query series
    def _per_query_series(
        self,
        bank: Any,
        users: list[str],
        Q: np.ndarray,
        qseg: np.ndarray,
        n_warm: int,
        modes: list[str],
        extra: dict[str, Any],
        bar: Any,
        label: str,
        salt: int,
        specific: np.ndarray | None = None,
        hybrid: tuple[Any, list[str]] | None = None,
    ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """Single-query latency of every (system, mode) on pool rows [n_warm, N).

        ``hybrid``: (the bank with texts, a query text per pool row) for the hybrid row.
        Returns (records, route split of the head backend's RF-Mem run).
        """
        s, cfg = self.s, self.s.config
        N = Q.shape[0]
        timed = [(i, i + 1) for i in range(n_warm, N)]
        sample = self._ref_sample(n_warm, N, salt)
        records: list[dict[str, Any]] = []
        kept: dict[tuple[str, str], dict[int, np.ndarray]] = {}
        times_of: dict[tuple[str, str], dict[int, float]] = {}
        split = None
        for system, mode in self._systems(modes):
            bar.set_postfix_str(f"{label} {system.name} {mode}")
            system.prepare(bank, users)
            self._gpu_reset(system)
            if system.kind == "reference":
                if s.warmup:
                    time_reference(system, Q, qseg, range(min(1, n_warm)), mode, cfg, math.inf)  # warm-up
                t, k = time_reference(system, Q, qseg, sample, mode, cfg, s.reference_budget_s)
                st = stats_ms(t)
                rec = self._record(
                    system, mode, **extra, **_lat(st), sampled=True, of_queries=len(timed),
                    sample=[int(i) - n_warm for i in list(k)],
                )  # fmt: skip
                times_of[(system.label, mode)] = dict(zip(k, t))
            else:
                warm = [(i, i + 1) for i in range(n_warm)] * max(1, math.ceil(s.warmup / max(1, n_warm)))
                time_batches(system, Q, qseg, warm[: s.warmup], mode, cfg)
                t, k, facts = time_batches(system, Q, qseg, timed, mode, cfg, keep=sample)
                st = stats_ms(t)
                rec = self._record(system, mode, **extra, **_lat(st), sampled=False)
                times_of[(system.label, mode)] = {i: t[i - n_warm] for i in range(n_warm, N)}
                if mode == "rfmem" and split is None and system.kind == "ours":
                    split = route_summary(facts, None if specific is None else specific[n_warm:])
                    if split is not None:
                        split["backend"] = system.name
            kept[(system.label, mode)] = k
            records.append(rec)
            system.release()
            bar.update(1)
        if hybrid is not None and self.hybrid_backend is not None:
            hbank, qtexts = hybrid
            system = self._hybrid_system()
            bar.set_postfix_str(f"{label} {system.name} hybrid")
            system.prepare(hbank, users)
            self._gpu_reset(system)
            warm = [(i, i + 1) for i in range(n_warm)] * max(1, math.ceil(s.warmup / max(1, n_warm)))
            time_batches(system, Q, qseg, warm[: s.warmup], "hybrid", cfg, texts=qtexts)
            t, k, _ = time_batches(system, Q, qseg, timed, "hybrid", cfg, keep=sample, texts=qtexts)
            st = stats_ms(t)
            rec = self._record(system, "hybrid", **extra, **_lat(st), sampled=False, **self._hybrid_fields(system))
            dense = next((r for r in records if r["kind"] == "ours" and r["label"] == system.label and r["mode"] == "dense"), None)
            if dense is not None:
                rec["dense_p50_ms"] = dense["p50_ms"]
                rec["p50_over_dense_p50"] = rec["p50_ms"] / dense["p50_ms"] if dense["p50_ms"] else None
            rec["differs_from_dense"] = self._differs(k, kept.get((system.label, "dense")))
            rec["check_rows"] = self._check_rows(k, n_warm)
            records.append(rec)
            system.release()
            bar.update(1)
        self._annotate(records, kept, times_of)
        return records, split

    def _annotate(
        self,
        records: list[dict[str, Any]],
        kept: dict[tuple[str, str], dict[int, np.ndarray]],
        times_of: dict[tuple[str, str], dict[int, float]] | None = None,
    ) -> None:
        """Add ``agree_reference`` (and the mean over the reference's sample) to records."""
        for rec in records:
            if rec["kind"] == "reference":
                continue
            ref = kept.get(("reference", rec["mode"]))
            if ref is None:
                continue
            rec["agree_reference"] = agreement(kept.get((rec["label"], rec["mode"]), {}), ref)
            if times_of is not None and (rec["label"], rec["mode"]) in times_of:
                mine = times_of[(rec["label"], rec["mode"])]
                common = [i for i in ref if i in mine]
                if common:
                    rec["mean_ms_on_reference_sample"] = 1e3 * float(np.mean([mine[i] for i in common]))

    # ------------------------------------------------------------------ batch series
    def _batch_series(
        self,
        bank: Any,
        users: list[str],
        Q: np.ndarray,
        qseg: np.ndarray,
        n_warm: int,
        batch_sizes: list[int],
        modes: list[str],
        extra: dict[str, Any],
        bar: Any,
        label: str,
        salt: int,
        specific: np.ndarray | None = None,
        segment_rows: int | None = None,
        dtypes: list[str] | None = None,
        hybrid: tuple[Any, list[str]] | None = None,
    ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """Throughput of every (system variant, mode, batch size) on the pool after ``n_warm`` rows.

        ``segment_rows``: rows of the one segment every query hits (the shared bank),
        which enables the memory guard :meth:`_too_big`. ``dtypes``: bank dtypes our
        backends run on (default float32 only). Each of ours and faiss runs once per
        thread count of the settings. ``hybrid``: (the bank with texts, a query text per
        pool row): the hybrid system runs too, once per thread count.
        """
        s, cfg = self.s, self.s.config
        plan = {bs: max(1, math.ceil(s.min_queries / bs)) for bs in batch_sizes}
        big = max(batch_sizes)
        big_hi = n_warm + plan[big] * big
        sample = self._ref_sample(n_warm, big_hi, salt)
        records: list[dict[str, Any]] = []
        kept: dict[tuple[str, str], dict[int, np.ndarray]] = {}
        split = None
        for system, mode in self._systems(modes, variants=True, dtypes=dtypes):
            sys_bank = self._bank_for(bank, system)
            system.prepare(sys_bank, users, qseg)
            self.scan_nbytes[(id(bank), system.dtype)] = int(sys_bank.snapshot().scan_nbytes)
            self._gpu_reset(system)
            if system.kind == "reference":
                bar.set_postfix_str(f"{label} reference {mode}")
                if s.warmup:
                    time_reference(system, Q, qseg, range(min(1, n_warm)), mode, cfg, math.inf)
                t, k = time_reference(system, Q, qseg, sample, mode, cfg, s.reference_budget_s)
                st = stats_ms(t)
                records.append(
                    self._record(
                        system, mode, **extra, batch_size=1, per_query_loop=True, qps=1e3 / st["mean"],
                        ms_per_query=st["mean"], **_lat(st), sampled=True,
                        of_queries=plan[big] * big,
                    )
                )  # fmt: skip
                kept[(system.label, mode)] = k
                bar.update(1)
                system.release()
                continue
            warm_rows = max(1, min(8, n_warm))
            time_batches(system, Q, qseg, [(0, warm_rows)] * s.warmup, mode, cfg)
            for bs in batch_sizes:
                bar.set_postfix_str(f"{label} {system.label} {mode} batch {bs}")
                why = self._too_big(system, mode, bs, segment_rows) if segment_rows else None
                if why:
                    records.append(self._record(system, mode, **extra, batch_size=bs, skipped=why))
                    self.notes.append(f"{label}: {system.label} {mode} batch {bs} skipped: {why}")
                    bar.update(1)
                    continue
                batches = [(n_warm + j * bs, n_warm + (j + 1) * bs) for j in range(plan[bs])]
                keep = sample if bs == big else None
                t0 = time.perf_counter()
                t, k, facts = time_batches(system, Q, qseg, batches, mode, cfg, keep=keep)
                total = time.perf_counter() - t0
                nq = plan[bs] * bs
                st = stats_ms(t)
                records.append(
                    self._record(
                        system, mode, **extra, batch_size=bs, qps=nq / sum(t), ms_per_query=1e3 * sum(t) / nq,
                        batch_p50_ms=st["p50"], batch_p99_ms=st["p99"], n_batches=plan[bs], n_queries=nq,
                        wall_s=total, sampled=False,
                    )
                )  # fmt: skip
                if bs == big:
                    kept[(system.label, mode)] = k
                    if mode == "rfmem" and split is None and system.kind == "ours":
                        sp = None if specific is None else specific[n_warm : n_warm + nq]
                        split = route_summary(facts, sp)
                        if split is not None:
                            split["backend"] = system.name
                            split["batch_size"] = bs
                bar.update(1)
            system.release()
        if hybrid is not None and self.hybrid_backend is not None:
            hbank, qtexts = hybrid
            for t in list(s.thread_counts or [None]):
                system = self._hybrid_system(threads=t)
                system.prepare(hbank, users, qseg)
                self._gpu_reset(system)
                warm_rows = max(1, min(8, n_warm))
                time_batches(system, Q, qseg, [(0, warm_rows)] * s.warmup, "hybrid", cfg, texts=qtexts)
                for bs in batch_sizes:
                    bar.set_postfix_str(f"{label} {system.label} hybrid batch {bs}")
                    batches = [(n_warm + j * bs, n_warm + (j + 1) * bs) for j in range(plan[bs])]
                    keep = sample if bs == big else None
                    t0 = time.perf_counter()
                    tt, k, _ = time_batches(system, Q, qseg, batches, "hybrid", cfg, keep=keep, texts=qtexts)
                    total = time.perf_counter() - t0
                    nq = plan[bs] * bs
                    st = stats_ms(tt)
                    rec = self._record(
                        system, "hybrid", **extra, batch_size=bs, qps=nq / sum(tt), ms_per_query=1e3 * sum(tt) / nq,
                        batch_p50_ms=st["p50"], batch_p99_ms=st["p99"], n_batches=plan[bs], n_queries=nq,
                        wall_s=total, sampled=False, **self._hybrid_fields(system),
                    )  # fmt: skip
                    dense = next((r for r in records if r["kind"] == "ours" and r["label"] == system.label
                                  and r["mode"] == "dense" and r.get("batch_size") == bs), None)  # fmt: skip
                    if dense is not None and dense.get("qps"):
                        rec["dense_qps"] = dense["qps"]
                        rec["qps_over_dense_qps"] = rec["qps"] / dense["qps"]
                    if bs == big:
                        rec["differs_from_dense"] = self._differs(k, kept.get((system.label, "dense")))
                        rec["check_rows"] = self._check_rows(k, n_warm)
                    records.append(rec)
                    bar.update(1)
                system.release()
        self._annotate([r for r in records if r.get("batch_size") == big or r.get("per_query_loop")], kept)
        self._twins.clear()
        return records, split

    def _too_big(self, system: System, mode: str, bs: int, n: int) -> str | None:
        """Memory guard of the shared bank: None, or why a cell must not run.

        The torch backend scores a batch against one segment with a plain matmul, i.e.
        it materialises a float32 [rows, n] score matrix (rows = the batch, times
        ``beam_width * fanout`` live branches in recollection rounds), and about three
        times that at its peak (measured: 21 GiB RSS for RF-Mem at batch 1,024 on 10^6
        vectors). Such a cell is skipped when that estimate exceeds 80 % of the memory
        available on its device, rather than pushing the machine into swap or the
        OOM killer.
        """
        if system.kind != "ours" or system.name != "torch":
            return None
        cfg = self.s.config
        rows = bs * (1 if mode == "dense" else cfg.beam_width * cfg.fanout)
        need = 3 * rows * n * 4
        dev = system.device
        if dev is not None and dev.type == "cuda":
            avail = torch.cuda.mem_get_info(dev)[0]
        else:
            from .workloads import memory_available_bytes

            avail = memory_available_bytes()
        if avail is not None and need > 0.8 * avail:
            return (
                f"its [{rows}, {n}] float32 score matrix needs ~{need / 2**30:.0f} GiB at peak, "
                f"{avail / 2**30:.0f} GiB available"
            )
        return None

    def _n_cells_batch(self, modes: list[str], n_bs: int, n_dtypes: int = 1, hybrid: bool = False) -> int:
        nt = len(self.s.thread_counts or [None])
        n = len(self.ours) * len(modes) * n_bs * nt * n_dtypes
        n += n_bs * nt if hybrid else 0
        n += n_bs * nt if (self.faiss_ok and "dense" in modes) else 0
        n += len(modes) if self.reference is not None else 0
        return n

    def _n_cells_latency(self, modes: list[str]) -> int:
        return len(self._systems(modes)) + (1 if self.hybrid_backend is not None else 0)

    def _finish(self, out: dict[str, Any], t0: float) -> dict[str, Any]:
        gc.collect()
        out["wall_s"] = time.perf_counter() - t0
        out["peak_rss_gib"] = peak_rss_bytes() / 2**30
        return out

    # ------------------------------------------------------------------ inputs
    def latency_inputs(self, si: int, tokens: int) -> dict[str, Any]:
        """The seeded inputs of the latency workload's scale ``si`` (``tokens`` tokens).

        Returns:
            {"sb": SyntheticBank, "Q", "qseg", "specific": the query pool (``n_warm``
            warm-up rows first), "n_warm", "texts": SyntheticTexts or None (hybrid off)}.
        """
        s = self.s
        n = chunks_for_tokens(tokens, s.chunk_tokens)
        sb = synthetic_bank(1, n, s.spec, seed=s.seed + 101 * si)
        n_warm = max(1, s.warmup)
        Q, qseg, specific, item, _ = sb.queries(n_warm + s.latency_queries, seed=s.seed + 7 + si, labels=True)
        texts = synthetic_texts(sb, item, s.text_spec, seed=s.seed + 11 + si) if self.hybrid_backend else None
        return {"sb": sb, "Q": Q, "qseg": qseg, "specific": specific, "n_warm": n_warm, "texts": texts}

    def multitenant_inputs(self) -> dict[str, Any]:
        """The seeded inputs of the multi-tenant workload.

        Returns:
            {"sb", "Q", "qseg", "specific", "n_warm", "n_batches", "texts": SyntheticTexts
            or None (hybrid off, or the bank above ``hybrid_max_items`` / the memory
            available: ``"texts_skipped"`` says why)}.

        Raises:
            MemoryError: the bank itself would not fit.
        """
        s = self.s
        nb = max(1, math.ceil(s.min_queries / s.mt_batch))
        n_warm = 8
        pool = nb * s.mt_batch
        vec_bytes = s.users * s.items * s.spec.dim * 4
        rng = np.random.default_rng([s.seed, 0x7E])
        seg = rng.integers(0, s.users, n_warm + pool)
        queried = np.unique(seg[n_warm:]).size
        faiss_bytes = queried * s.items * s.spec.dim * 4 if self.faiss_ok else 0
        check_memory(vec_bytes + max(vec_bytes, faiss_bytes), f"the multi-tenant bank of {s.users} x {s.items} vectors (--users, --items)")
        rb = self._row_bar(s.users * s.items, f"building {s.users} x {s.items}")
        sb = synthetic_bank(s.users, s.items, s.spec, seed=s.seed + 2003, progress=rb.update)
        rb.close()
        Q, qseg, specific, item, _ = sb.queries(n_warm + pool, seed=s.seed + 29, user_index=seg, labels=True)
        out = {"sb": sb, "Q": Q, "qseg": qseg, "specific": specific, "n_warm": n_warm, "n_batches": nb,
               "queried": int(queried), "texts": None, "texts_skipped": None}  # fmt: skip
        if self.hybrid_backend is None:
            return out
        n_items = s.users * s.items
        if n_items > s.hybrid_max_items:
            out["texts_skipped"] = (
                f"{n_items:,} items > --hybrid-max-items {s.hybrid_max_items:,} (a text twin of the bank and its "
                "lexical index; bench/bench_hybrid.py times the lexical channel on a large multi-tenant bank)"
            )
            return out
        try:
            check_memory(2 * vec_bytes + max(vec_bytes, faiss_bytes) + n_items * TEXT_BYTES_PER_ITEM,
                         f"the multi-tenant bank's text twin ({n_items} items)")  # fmt: skip
        except MemoryError as e:
            out["texts_skipped"] = str(e)
            return out
        self.say(f"multitenant: generating {n_items} texts and their lexical index")
        out["texts"] = synthetic_texts(sb, item, s.text_spec, seed=s.seed + 31, users_indexed=seg)
        return out

    # ------------------------------------------------------------------ workloads
    def latency(self) -> dict[str, Any]:
        """One user's memory per token scale, one query per call (p50 / p99 per system and mode)."""
        s = self.s
        t0 = time.perf_counter()
        out: dict[str, Any] = {"chunk_tokens": s.chunk_tokens, "queries": s.latency_queries, "scales": []}
        bar = self._bar(len(s.scales) * self._n_cells_latency(s.modes), "latency")
        for si, tokens in enumerate(s.scales):
            n = chunks_for_tokens(tokens, s.chunk_tokens)
            label = f"{format_tokens(tokens)} tokens"
            bar.set_postfix_str(f"{label}: building {n} chunks")
            inp = self.latency_inputs(si, tokens)
            sb, Q, qseg, specific, n_warm, tx = (inp[k] for k in ("sb", "Q", "qseg", "specific", "n_warm", "texts"))
            extra = {"tokens": tokens, "scale": format_tokens(tokens), "chunks": n}
            recs, split = self._per_query_series(
                sb.bank, sb.users, Q, qseg, n_warm, s.modes, extra, bar, label, si, specific,
                hybrid=None if tx is None else (tx.bank, tx.queries),
            )  # fmt: skip
            part = {"tokens": tokens, "scale": format_tokens(tokens), "chunks": n, "bank_mib": sb.nbytes / 2**20,
                    "results": recs, "route_split": split}  # fmt: skip
            if tx is not None:
                part.update(text_build_s=tx.build_s, text_tokens=tx.tokens, text_stemmer=tx.stemmer)
            out["scales"].append(part)
            del sb, inp, tx
        if self.hybrid_backend is not None:
            out["texts"] = s.text_spec.to_dict()
        bar.close()
        return self._finish(out, t0)

    def batch(self) -> dict[str, Any]:
        """One shared bank per size, batches of each batch size (queries per second)."""
        s = self.s
        t0 = time.perf_counter()
        out: dict[str, Any] = {"batch_sizes": list(s.batch_sizes), "min_queries": s.min_queries, "sizes": []}
        bar = self._bar(len(s.shared_sizes) * self._n_cells_batch(s.shared_modes, len(s.batch_sizes)), "batch")
        plan = {bs: max(1, math.ceil(s.min_queries / bs)) for bs in s.batch_sizes}
        pool = max(bs * nb for bs, nb in plan.items())
        for si, n in enumerate(s.shared_sizes):
            label = f"shared {format_count(n)}"
            vec_bytes = n * s.spec.dim * 4
            check_memory(2 * vec_bytes, f"the shared bank of {n} vectors (--shared-sizes)")
            clusters = max(s.spec.clusters, n // SHARED_ITEMS_PER_CLUSTER)
            rb = self._row_bar(n, f"building {label}")
            sb = synthetic_bank(1, n, s.spec, seed=s.seed + 1009 + si, clusters=clusters, progress=rb.update)
            rb.close()
            n_warm = 8
            Q, qseg, specific = sb.queries(n_warm + pool, seed=s.seed + 17 + si)
            extra = {"n": n, "size": format_count(n)}
            recs, split = self._batch_series(
                sb.bank, sb.users, Q, qseg, n_warm, s.batch_sizes, s.shared_modes, extra, bar, label, 100 + si, specific,
                segment_rows=n,
            )
            for r in recs:  # arithmetic rate of a dense scan: 2 n d flops per query
                if r["mode"] == "dense" and r.get("qps") and not r.get("per_query_loop"):
                    r["gflops"] = r["qps"] * 2 * n * s.spec.dim / 1e9
            out["sizes"].append(
                {"n": n, "size": format_count(n), "clusters": clusters, "bank_mib": sb.nbytes / 2**20,
                 "build_s": sb.build_s, "results": recs, "route_split": split}
            )  # fmt: skip
            del sb, Q
            gc.collect()
        bar.close()
        return self._finish(out, t0)

    def multitenant(self) -> dict[str, Any]:
        """U users x n items; each query of the batch against a random user's bank."""
        s = self.s
        t0 = time.perf_counter()
        inp = self.multitenant_inputs()
        sb, Q, qseg, specific, n_warm, nb, tx = (inp[k] for k in ("sb", "Q", "qseg", "specific", "n_warm", "n_batches", "texts"))
        queried = inp["queried"]
        if inp["texts_skipped"]:
            self.notes.append(f"multitenant: no hybrid row: {inp['texts_skipped']}")
        bar = self._bar(self._n_cells_batch(s.modes, 1, len(s.dtypes), hybrid=tx is not None), "multitenant")
        extra = {"users": s.users, "items": s.items}
        recs, split = self._batch_series(
            sb.bank, sb.users, Q, qseg, n_warm, [s.mt_batch], s.modes, extra, bar, "multitenant", 200, specific,
            dtypes=s.dtypes, hybrid=None if tx is None else (tx.bank, tx.queries),
        )  # fmt: skip
        bar.close()
        # each dtype's scan copy as its bank holds it (int8: a byte per value and the rows'
        # scales; half precision: 2 bytes per value; float32: the rows)
        scan_bytes = {dt: self.scan_nbytes.get((id(sb.bank), dt)) for dt in s.dtypes}
        for r in recs:  # bytes a dense query's scan reads from its user's bank, per second
            nbytes = scan_bytes.get(r.get("dtype"))
            if r["kind"] == "ours" and r["mode"] == "dense" and r.get("qps") and nbytes:
                r["scan_gb_per_s"] = r["qps"] * nbytes / s.users / 1e9
        out = {
            "users": s.users, "items": s.items, "batch_size": s.mt_batch, "n_batches": nb,
            "queried_users": int(queried), "bank_mib": sb.nbytes / 2**20, "build_s": sb.build_s,
            "dtypes": list(s.dtypes),
            "scan_mib": {dt: v / 2**20 for dt, v in scan_bytes.items() if v},
            "results": recs, "route_split": split,
        }  # fmt: skip
        if tx is not None:
            out.update(texts=s.text_spec.to_dict(), text_build_s=tx.build_s, text_tokens=tx.tokens, text_stemmer=tx.stemmer)
        elif inp["texts_skipped"]:
            out["hybrid_skipped"] = inp["texts_skipped"]
        del sb, Q, inp, tx
        return self._finish(out, t0)

    def personabench(self) -> dict[str, Any]:
        """PersonaBench chunks and questions embedded with MiniLM: per-question latency and a batch run."""
        s = self.s
        t0 = time.perf_counter()
        if s.personabench is None:
            return {"skipped": "no PersonaBench folder (--personabench)"}
        emb = personabench_embeddings(
            s.personabench, noise=s.noise, users_per_community=s.pb_users_per_community,
            encoder=s.encoder, cache_dir=s.cache_dir, say=self.say,
        )  # fmt: skip
        bank = emb.bank
        users = bank.users
        uidx = {u: i for i, u in enumerate(users)}
        qseg_all = np.asarray([uidx[u] for u in emb.users], dtype=np.int64)
        n_warm = min(max(1, s.warmup), emb.Q.shape[0])
        # warm-up rows first (the first questions, repeated), then every question once
        Q = np.concatenate([emb.Q[:n_warm], emb.Q])
        qseg = np.concatenate([qseg_all[:n_warm], qseg_all])
        nq = emb.Q.shape[0]
        hybrid = None
        if self.hybrid_backend is not None and emb.data is not None:
            qt = [q.question for q in emb.data.questions]
            lex = bank.snapshot().lexical
            for u in range(len(users)):  # every user's postings, untimed (an index build)
                lex.postings(u)
            hybrid = (bank, qt[:n_warm] + qt)
        cells = self._n_cells_latency(s.modes) + (len(self.ours) * len(s.modes)) + (1 if hybrid else 0)
        bar = self._bar(cells, "personabench")
        extra = {"questions": nq}
        recs, split = self._per_query_series(
            bank, users, Q, qseg, n_warm, s.modes, extra, bar, "personabench", 300, hybrid=hybrid
        )
        # one whole-batch run of every question per (backend, mode)
        batch_recs = []
        for system in self.ours:
            system.prepare(bank, users)
            for mode in s.modes:
                bar.set_postfix_str(f"personabench {system.name} {mode} batch")
                time_batches(system, Q, qseg, [(0, n_warm)] if s.warmup else [], mode, s.config)
                t, _, _ = time_batches(system, Q, qseg, [(n_warm, n_warm + nq)], mode, s.config)
                batch_recs.append(
                    {"system": system.name, "kind": "ours", "mode": mode, "batch_size": nq,
                     "ms_per_query": 1e3 * t[0] / nq, "qps": nq / t[0]}
                )  # fmt: skip
                bar.update(1)
            system.release()
        if hybrid is not None:
            system = self._hybrid_system()
            system.prepare(bank, users)
            bar.set_postfix_str(f"personabench {system.name} hybrid batch")
            time_batches(system, Q, qseg, [(0, n_warm)] if s.warmup else [], "hybrid", s.config, texts=hybrid[1])
            t, _, _ = time_batches(system, Q, qseg, [(n_warm, n_warm + nq)], "hybrid", s.config, texts=hybrid[1])
            rec = {"system": system.name, "kind": "hybrid", "mode": "hybrid", "batch_size": nq,
                   "ms_per_query": 1e3 * t[0] / nq, "qps": nq / t[0], **self._hybrid_fields(system)}  # fmt: skip
            dense = _find_rec(batch_recs, system=system.name, mode="dense")
            if dense is not None:
                rec["dense_qps"] = dense["qps"]
                rec["qps_over_dense_qps"] = rec["qps"] / dense["qps"]
            batch_recs.append(rec)
            bar.update(1)
            system.release()
        bar.close()
        out = {
            "data": str(s.personabench), "noise": s.noise, "users": emb.n_users, "chunks": emb.n_chunks,
            "questions": nq, "model": emb.model, "embeddings_cached": emb.cached, "cache_file": emb.cache_file,
            "encode_chunks_s": emb.encode_chunks_s, "encode_questions_s": emb.encode_questions_s,
            "encode_ms_per_question": 1e3 * emb.encode_questions_s / max(1, nq),
            "results": recs, "batch": batch_recs, "route_split": split,
        }  # fmt: skip
        del emb, bank
        return self._finish(out, t0)

    def run(self) -> dict[str, Any]:
        """Run the selected workloads in order.

        Returns:
            {workload name: its dict}; a workload that raised MemoryError is recorded
            as ``{"skipped": message}`` and noted.
        """
        out: dict[str, Any] = {}
        for name in WORKLOADS:
            if name not in self.s.workloads:
                continue
            self.say(f"workload {name}")
            try:
                out[name] = getattr(self, name)()
            except MemoryError as e:
                out[name] = {"skipped": str(e)}
                self.notes.append(f"{name} skipped: {e}")
            gc.collect()
        return out


def _find_rec(records: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    return next((r for r in records if all(r.get(k) == v for k, v in match.items())), None)


def _lat(st: dict[str, float]) -> dict[str, Any]:
    return {
        "p50_ms": st.get("p50"),
        "p99_ms": st.get("p99"),
        "mean_ms": st.get("mean"),
        "min_ms": st.get("min"),
        "n_queries": st.get("n", 0),
    }
