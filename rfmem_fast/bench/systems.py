"""The systems a benchmark runs side by side, and the timing helpers.

* :class:`OursSystem`: :func:`rfmem_fast.search` with one of our backends (native,
  torch, triton, cuda, ...), whole batches at once.
* :class:`FaissSystem`: ``faiss.IndexFlatIP`` dense top-k: one flat index per user (a
  single index for a one-user bank); a batch is searched user by user, each user's
  queries grouped into one ``search`` call.
* :class:`ReferenceSystem`: the reference backend (numpy + scikit-learn) driven the way
  the authors' code runs, one query at a time.
* :class:`HybridSystem`: one of our backends with ``RFMemConfig.recommended()`` (hybrid
  dense + BM25, never recollecting) on a bank with item texts, given the query texts:
  the "hybrid" rows (records with mode ``"hybrid"``, kind ``"hybrid"``).

All systems take the same inputs (float32 unit queries and the users' segment indices)
and return global bank rows (int64 [b, k], -1 padding), so that results can be compared.
Times are wall-clock seconds from :func:`time.perf_counter`; on a CUDA device every
timed call ends with a synchronisation.

Variants: a system may be pinned to a number of CPU threads (``threads``: every call runs
inside :func:`thread_scope`, which sets rfmem_fast's, torch's and faiss's threads and
restores them), and one of ours to a bank dtype (``dtype``: the workload hands it the
bank converted with :meth:`MemoryBank.astype`). Its ``label`` names the variant in
tables, plots and JSON records.
"""
from __future__ import annotations

import resource
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from ..backends import Backend, get_backend
from ..bank import MemoryBank
from ..config import RFMemConfig
from ..search import SearchResult, search


def stats_ms(seconds: Sequence[float]) -> dict[str, float]:
    """Latency summary of per-call times.

    Args:
        seconds: per-call wall times in seconds (at least one).

    Returns:
        {"p50", "p99", "mean", "min", "max"} in milliseconds (float) and "n" (count).
        Percentiles are numpy's linear interpolation.
    """
    a = np.asarray(seconds, dtype=np.float64) * 1e3
    if a.size == 0:
        return {"n": 0}
    return {
        "p50": float(np.percentile(a, 50)),
        "p99": float(np.percentile(a, 99)),
        "mean": float(a.mean()),
        "min": float(a.min()),
        "max": float(a.max()),
        "n": int(a.size),
    }


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far, in bytes (``getrusage`` ru_maxrss)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) if sys.platform == "darwin" else int(r) * 1024


@contextmanager
def thread_scope(n: int | None) -> Iterator[None]:
    """Run a block with ``n`` CPU threads for rfmem_fast's kernels, torch and faiss.

    Sets :func:`rfmem_fast.set_num_threads`, ``torch.set_num_threads`` and faiss's
    OpenMP threads to ``n`` and restores the previous settings on exit; ``None``
    changes nothing.
    """
    if n is None:
        yield
        return
    from ..threads import using_num_threads

    prev_torch = torch.get_num_threads()
    faiss = None
    try:
        import faiss as _faiss

        faiss, prev_faiss = _faiss, _faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(n)
    except ImportError:
        pass
    torch.set_num_threads(n)
    try:
        with using_num_threads(n):
            yield
    finally:
        torch.set_num_threads(prev_torch)
        if faiss is not None:
            faiss.omp_set_num_threads(prev_faiss)


def variant_label(name: str, dtype: str = "float32", threads: int | None = None) -> str:
    """Label of a system variant: ``native``, ``native float16``, ``native [2 threads]``..."""
    out = name if dtype == "float32" else f"{name} {dtype}"
    if threads is not None:
        out += f" [{threads} thread{'s' if threads != 1 else ''}]"
    return out


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class RunOutput:
    """Rows of a batch and, for RF-Mem systems, the routing facts.

    Attributes:
        rows: int64 [b, k] global bank rows, -1 padding.
        route: int64 [b] (0 familiarity, 1 recollection) or None (faiss).
        rule: int64 [b] rule codes (``rfmem_fast.routing.base.RULE_NAMES``) or None.
        rounds: int64 [b] recollection rounds or None.
    """

    rows: np.ndarray
    route: np.ndarray | None = None
    rule: np.ndarray | None = None
    rounds: np.ndarray | None = None


def _from_result(res: SearchResult) -> RunOutput:
    return RunOutput(rows=res.rows, route=res.route, rule=res.rule, rounds=res.rounds)


class System:
    """Base class: a named retrieval system over a prepared bank.

    Attributes:
        name: the system in JSON records (e.g. "native", "faiss", "reference").
        kind: "ours", "faiss" or "reference".
        modes: the modes it can run ("dense" only for faiss).
        per_query: True when the system serves one query per call (the reference).
        device: torch device it computes on (None: not torch-based).
        threads: CPU threads its calls run with (None: the process's setting).
        dtype: the bank dtype it searches ("float32" unless a variant of ours).
    """

    name = "system"
    kind = "ours"
    modes: tuple[str, ...] = ("dense", "recollection", "rfmem")
    per_query = False
    device: torch.device | None = None
    threads: int | None = None
    dtype: str = "float32"

    @property
    def label(self) -> str:
        """The variant's name in tables and plots (:func:`variant_label`)."""
        return variant_label(self.name, self.dtype, self.threads)

    def prepare(self, bank: MemoryBank, users: Sequence[str], qseg: np.ndarray | None = None) -> None:
        """Build what the system needs for ``bank`` (untimed).

        Args:
            bank: the memory bank.
            users: user keys in segment order (``bank.users``).
            qseg: int64 segment indices of the queries that will be run (lets a system
                index only the users that are queried); None: every user.
        """
        self._bank, self._users = bank, list(users)

    def run(
        self, Q: np.ndarray, qseg: np.ndarray, mode: str, config: RFMemConfig, texts: Sequence[str] | None = None
    ) -> RunOutput:
        """Search a batch.

        Args:
            Q: float32 [b, d] unit queries.
            qseg: int64 [b] segment (user) index of each query.
            mode: "dense" | "recollection" | "rfmem".
            config: RFMemConfig.
            texts: optional b query texts (the lexical channel's input; only
                :class:`HybridSystem` uses them).

        Returns:
            RunOutput with rows [b, config.out_k].
        """
        raise NotImplementedError

    def release(self) -> None:
        """Free what :meth:`prepare` built."""
        self._bank = None


class OursSystem(System):
    """:func:`rfmem_fast.search` on one of our backends.

    Args:
        backend: backend name ("native", "torch", "triton", "cuda", ...).
        device: optional torch device for device-capable backends.
        threads: CPU threads per call (None: the process's setting).
        dtype: the bank dtype this variant searches (the workload converts the bank).

    Raises:
        ValueError: unknown backend (from :func:`rfmem_fast.get_backend`).
    """

    kind = "ours"

    def __init__(self, backend: str, device: str | None = None, threads: int | None = None, dtype: str = "float32") -> None:
        self.backend: Backend = get_backend(backend, device)
        self.name = self.backend.name
        self.device = torch.device(self.backend.device)
        self.threads = threads
        self.dtype = dtype

    def run(self, Q, qseg, mode, config, texts=None):
        """See :meth:`System.run` (one :func:`rfmem_fast.search` call for the batch)."""
        users = [self._users[i] for i in qseg]
        qt = None if texts is None else list(texts)
        with thread_scope(self.threads):
            res = search(self._bank, Q, users, config, mode=mode, backend=self.backend, query_texts=qt)
            _sync(self.device)
        return _from_result(res)


class HybridSystem(OursSystem):
    """One of our backends searching with ``RFMemConfig.recommended()`` (hybrid dense + BM25).

    Runs ``search(bank, Q, users, config, mode=search_mode, query_texts=texts)``: the
    workload hands it a bank with item texts (its lexical index built) and the query
    texts; the ``mode`` and ``config`` a workload passes are ignored (its records carry
    mode ``"hybrid"``). ``recommended()`` never recollects, so every query takes the
    Familiarity path: the fused top-k of ``cosine + 0.03 * BM25``.

    Args:
        backend, device, threads: as :class:`OursSystem` (dtype float32).
        config: the config searched with (default ``RFMemConfig.recommended()``).
        search_mode: the ``search`` mode (default "rfmem", as a user calls it).
    """

    kind = "hybrid"
    modes = ("hybrid",)

    def __init__(self, backend: str, device: str | None = None, threads: int | None = None,
                 config: RFMemConfig | None = None, search_mode: str = "rfmem") -> None:  # fmt: skip
        super().__init__(backend, device, threads)
        self.config = config if config is not None else RFMemConfig.recommended()
        self.search_mode = search_mode

    def run(self, Q, qseg, mode, config, texts=None):
        """See :meth:`System.run`: ``self.config`` and ``self.search_mode``, with the query texts."""
        if texts is None:
            raise ValueError("the hybrid system needs the query texts")
        return OursSystem.run(self, Q, qseg, self.search_mode, self.config, texts)


class ReferenceSystem(OursSystem):
    """The reference backend, one query per :func:`rfmem_fast.search` call (authors' style)."""

    kind = "reference"
    per_query = True

    def __init__(self) -> None:
        super().__init__("reference")

    def run(self, Q, qseg, mode, config, texts=None):
        """See :meth:`System.run`: a Python loop over the queries, one search each."""
        tx = (lambda i: None) if texts is None else (lambda i: texts[i : i + 1])  # noqa: E731
        outs = [OursSystem.run(self, Q[i : i + 1], qseg[i : i + 1], mode, config, tx(i)) for i in range(Q.shape[0])]
        cat = lambda f: np.concatenate([getattr(o, f) for o in outs])  # noqa: E731
        return RunOutput(rows=cat("rows"), route=cat("route"), rule=cat("rule"), rounds=cat("rounds"))


class FaissSystem(System):
    """faiss ``IndexFlatIP`` dense top-k, one flat index per (queried) user.

    A batch is searched in a loop over its users, each user's queries grouped into one
    ``index.search`` call; the returned rows are global bank rows (local + offset).
    Index construction happens in :meth:`prepare` and is not timed (``build_s``).

    Args:
        threads: faiss OpenMP threads per call (None: the process's setting).

    Raises:
        ImportError: faiss is not installed (at construction).
    """

    name = "faiss"
    kind = "faiss"
    modes = ("dense",)

    def __init__(self, threads: int | None = None) -> None:
        import faiss  # noqa: F401  (fail early when absent)

        self._faiss = faiss
        self.threads = threads
        self.indexes: dict[int, Any] = {}
        self.build_s = 0.0

    def prepare(self, bank, users, qseg=None):
        """Build one IndexFlatIP per user (only the users in ``qseg`` when given)."""
        super().prepare(bank, users, qseg)
        snap = bank.snapshot()
        self._offsets = snap.offsets
        segs = range(len(users)) if qseg is None else sorted(set(int(s) for s in np.asarray(qseg)))
        t0 = time.perf_counter()
        self.indexes = {}
        for u in segs:
            a, b = int(snap.offsets[u]), int(snap.offsets[u + 1])
            index = self._faiss.IndexFlatIP(bank.dim)
            if b > a:
                index.add(snap.vectors[a:b])
            self.indexes[u] = index
        self.build_s = time.perf_counter() - t0

    def run(self, Q, qseg, mode, config, texts=None):
        """See :meth:`System.run`: dense only (``mode`` must be "dense"; ``texts`` unused)."""
        if mode != "dense":
            raise ValueError(f"faiss runs mode 'dense' only, got {mode!r}")
        with thread_scope(self.threads):
            return self._run(Q, qseg, config.out_k)

    def _run(self, Q: np.ndarray, qseg: np.ndarray, k: int) -> RunOutput:
        rows = np.full((Q.shape[0], k), -1, dtype=np.int64)
        qseg = np.asarray(qseg)
        if Q.shape[0] == 1:  # the single-query path: no grouping work
            u = int(qseg[0])
            _, I = self.indexes[u].search(Q, k)
            rows[0] = np.where(I[0] >= 0, I[0] + self._offsets[u], -1)
            return RunOutput(rows=rows)
        order = np.argsort(qseg, kind="stable")
        sq = qseg[order]
        cuts = np.flatnonzero(np.diff(sq)) + 1
        for grp in np.split(order, cuts):
            u = int(qseg[grp[0]])
            _, I = self.indexes[u].search(Q[grp], k)
            rows[grp] = np.where(I >= 0, I + self._offsets[u], -1)
        return RunOutput(rows=rows)

    def release(self):
        """Drop the indexes."""
        self.indexes = {}
        super().release()


def time_batches(
    system: System,
    Q: np.ndarray,
    qseg: np.ndarray,
    batches: Sequence[tuple[int, int]],
    mode: str,
    config: RFMemConfig,
    keep: np.ndarray | None = None,
    texts: Sequence[str] | None = None,
) -> tuple[list[float], dict[int, np.ndarray], RunOutput | None]:
    """Time ``system.run`` on consecutive slices of a query pool.

    Args:
        system: a prepared system.
        Q: float32 [N, d] query pool; qseg: int64 [N] their segments.
        batches: (start, stop) slices of the pool, run in order, each timed.
        mode, config: as :meth:`System.run`.
        keep: optional pool indices whose output rows are returned (for agreement
            checks).
        texts: optional query texts of the pool (one per row of ``Q``), sliced like it.

    Returns:
        (seconds per batch, {pool index: rows [k]} for ``keep``, the RunOutput of the
        concatenated batches' routing facts (route/rule/rounds of every query run) or
        None for systems without routing).
    """
    times: list[float] = []
    kept: dict[int, np.ndarray] = {}
    keep_set = set(int(i) for i in keep) if keep is not None else set()
    routes, rules, rounds = [], [], []
    for a, b in batches:
        t0 = time.perf_counter()
        out = system.run(Q[a:b], qseg[a:b], mode, config, None if texts is None else texts[a:b])
        times.append(time.perf_counter() - t0)
        for i in range(a, b):
            if i in keep_set:
                kept[i] = out.rows[i - a]
        if out.route is not None:
            routes.append(out.route)
            rules.append(out.rule)
            rounds.append(out.rounds)
    facts = None
    if routes:
        facts = RunOutput(
            rows=np.empty((0, 0), dtype=np.int64),
            route=np.concatenate(routes),
            rule=np.concatenate(rules),
            rounds=np.concatenate(rounds),
        )
    return times, kept, facts


def time_reference(
    system: System,
    Q: np.ndarray,
    qseg: np.ndarray,
    indices: Sequence[int],
    mode: str,
    config: RFMemConfig,
    budget_s: float,
) -> tuple[list[float], dict[int, np.ndarray]]:
    """Time the per-query loop on a sample of the pool, within a time budget.

    Args:
        system: a prepared system (the reference).
        Q, qseg: the query pool.
        indices: pool indices to run, in order (the seeded sample).
        mode, config: as :meth:`System.run`.
        budget_s: stop starting new queries once this many seconds were spent (at
            least one query always runs; ``math.inf``: no budget).

    Returns:
        (seconds per query, {pool index: rows [k]}) for the queries that ran.
    """
    times: list[float] = []
    kept: dict[int, np.ndarray] = {}
    spent = 0.0
    for i in indices:
        if times and spent >= budget_s:
            break
        t0 = time.perf_counter()
        out = system.run(Q[i : i + 1], qseg[i : i + 1], mode, config)
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
        kept[int(i)] = out.rows[0]
    return times, kept


def agreement(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> float | None:
    """Fraction of the common pool indices whose output rows are identical.

    Args:
        a, b: {pool index: rows int64 [k]}.

    Returns:
        float in [0, 1], or None when no index is common.
    """
    common = sorted(set(a) & set(b))
    if not common:
        return None
    return float(np.mean([np.array_equal(a[i], b[i]) for i in common]))


def route_summary(facts: RunOutput | None, specific: np.ndarray | None = None) -> dict[str, Any] | None:
    """The route split of an RF-Mem run.

    Args:
        facts: RunOutput with route / rule / rounds of every query (mode "rfmem").
        specific: optional bool [b] query kind of synthetic queries (True: near an item).

    Returns:
        {"queries", "familiarity", "recollection", "familiarity_fraction", "rules":
        {name: count}, "mean_rounds_recollection", and with ``specific``:
        "familiarity_fraction_specific" / "_vague"}; None without facts.
    """
    from ..routing.base import RULE_NAMES

    if facts is None or facts.route is None or facts.route.size == 0:
        return None
    r = facts.route
    fam = int((r == 0).sum())
    out: dict[str, Any] = {
        "queries": int(r.size),
        "familiarity": fam,
        "recollection": int(r.size - fam),
        "familiarity_fraction": fam / r.size,
        "rules": {RULE_NAMES[k]: int(v) for k, v in zip(*np.unique(facts.rule, return_counts=True))},
        "mean_rounds_recollection": float(facts.rounds[r == 1].mean()) if (r == 1).any() else 0.0,
    }
    if specific is not None and specific.size == r.size:
        for name, m in (("specific", specific), ("vague", ~specific)):
            out[f"familiarity_fraction_{name}"] = float((r[m] == 0).mean()) if m.any() else None
    return out
