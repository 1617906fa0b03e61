"""The GPU benchmark of ``bench/gpu_check.py``: device-generated banks and
device-resident queries, our backends side by side with faiss-gpu and cuML in one run.

Workloads (each a method of :class:`GpuBench`, each returning a JSON-ready dict):

* ``latency``: one user's memory of 32K / 128K / 1M tokens (128 / 512 / 4,096 chunks of
  256 tokens, d = 384), one query per :func:`rfmem_fast.search` call (CUDA tensor in,
  ``output="torch"``), p50 / p99 per backend and mode; faiss-gpu ``GpuIndexFlatIP`` on the
  same bank; the host synchronisations of one call (:func:`rfmem_fast.device.count_host_syncs`).
* ``multitenant``: U users x n items GENERATED ON THE DEVICE (1,000 x 4,096 and
  10,000 x 1,024; float32, and float16 when ``MemoryBank`` takes a ``dtype``), batches of
  queries each against a random user, through :func:`rfmem_fast.search.search_tensors` on a
  :func:`rfmem_fast.device.view_from_tensors` view; faiss-gpu as one ``GpuIndexFlatIP`` per
  user, looped over the users of the batch (and with cuVS when faiss has it).
* ``shared``: one user of 10^6 and 10^7 vectors (device-generated), batches of 1 to 65,536;
  a cell whose time, extrapolated linearly from the previous batch size, exceeds the cell
  budget (10 s) is skipped with that prediction recorded.
* ``kmeans``: many tiny KMeans problems (the recollection rounds' shape: 13 points, 4
  clusters, d = 384): our batched KMeans in one call per backend, against cuML ``KMeans``
  called once per problem, and against our own torch KMeans called once per problem (a
  stand-in that is always there, measuring what batching saves).

Synthetic data follows :mod:`rfmem_fast.bench.workloads` (clustered unit vectors; half of
the queries near an item, half near a centre), drawn with a seeded torch generator on the
device. Every timed call ends with a device synchronisation. :func:`goal_ratios` compares
the figures with the GPU targets (:data:`GOALS`, docs/benchmarks/gpu.md). With ``device="cpu"`` (``gpu_check.py --dry-run``) the
same code runs at tiny sizes, faiss-gpu falls back to faiss-cpu's ``IndexFlatIP`` (labelled
as a stand-in) and absent comparators are skipped with a note.

The parts are split by concept, and the names callers import from here are re-exported:
:mod:`rfmem_fast.bench.gpu_data` (device-generated banks and queries, synchronised
timing), :mod:`rfmem_fast.bench.gpu_compare` (faiss and cuML) and
:mod:`rfmem_fast.bench.gpu_goals` (:data:`GOALS`, :func:`goal_ratios`, :func:`plot_doc`).
This module keeps the run's budget and settings and :class:`GpuBench`, the workloads.
"""
from __future__ import annotations

import gc
import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from ..backends import get_backend
from ..backends.torch_backend import TorchBackend
from ..bank import MemoryBank
from ..config import RFMemConfig
from ..device import count_host_syncs, view_from_tensors
from ..search import search, search_tensors
from .gpu_compare import FaissFlat as FaissFlat
from .gpu_compare import _cuml_kmeans
from .gpu_data import DeviceBank as DeviceBank
from .gpu_data import _normalise  # noqa: F401 (its old place)
from .gpu_data import device_bank as device_bank
from .gpu_data import device_queries as device_queries
from .gpu_data import sync as sync
from .gpu_data import timed as timed
from .gpu_goals import GOALS as GOALS
from .gpu_goals import _best, _meets  # noqa: F401 (their old place)
from .gpu_goals import goal_ratios as goal_ratios
from .gpu_goals import plot_doc as plot_doc
from .systems import RunOutput, route_summary, stats_ms
from .workloads import (
    SHARED_ITEMS_PER_CLUSTER,
    SyntheticSpec,
    chunks_for_tokens,
    format_count,
    format_tokens,
    synthetic_bank,
)


class BudgetExceeded(RuntimeError):
    """The run's time budget is spent (``--budget-s``): what is left is skipped."""


@dataclass
class Deadline:
    """A wall-clock budget shared by every stage of a run.

    Attributes:
        budget_s: seconds allowed from ``start``.
        start: ``time.perf_counter()`` at the start of the run.
    """

    budget_s: float
    start: float = field(default_factory=time.perf_counter)

    def remaining(self) -> float:
        """Seconds left (may be negative)."""
        return self.budget_s - (time.perf_counter() - self.start)

    def elapsed(self) -> float:
        """Seconds since the start."""
        return time.perf_counter() - self.start

    def check(self, what: str, need_s: float = 0.0) -> None:
        """Raise :class:`BudgetExceeded` when fewer than ``need_s`` seconds are left.

        Args:
            what: the work about to start, for the message.
            need_s: seconds it is expected to take (0: only the budget's end counts).
        """
        left = self.remaining()
        if left <= need_s:
            raise BudgetExceeded(f"{what}: budget spent ({left:.0f} s left, {need_s:.0f} s needed)")


@dataclass
class GpuBenchSettings:
    """Sizes and systems of a GPU benchmark run (``bench/gpu_check.py`` resolves them).

    Attributes:
        device: torch device ("cuda", or "cpu" for the dry run).
        backends: our backends, the first being the headline one (e.g. triton, torch, cuda).
        config: the RFMemConfig searched with.
        spec: synthetic data parameters (dim 384 by default).
        seed: seed of every bank and query set.
        warmup: untimed calls before each series.
        scales, chunk_tokens, latency_queries, latency_modes: the latency workload.
        multitenant: (users, items) banks; mt_batches: batch sizes; mt_modes: modes;
            dtypes: "float32" / "float16" (float16 runs only when MemoryBank has a dtype).
        faiss_batch: batch of the looped faiss-gpu comparison (one index per user).
        shared_sizes, batch_sizes, shared_modes: the shared-bank workload.
        kmeans_problems, kmeans_points, kmeans_clusters: the KMeans workload.
        cell_budget_s: a cell predicted to take longer is skipped.
        repeats: timed repetitions of a batch / KMeans call (fewer for the largest batches).
        max_batch: ``max_batch`` of the searches.
        memory_budget: bytes of temporaries per backend call (``Backend.memory_budget``;
            the library default, 256 MiB, would cut a GPU batch into many small rounds);
            None keeps the default.
        workload_backends: optional {workload: backends} overriding ``backends``
            (the dry run keeps the Triton interpreter to few cells).
    """

    device: str = "cuda"
    backends: list[str] = field(default_factory=lambda: ["triton", "torch", "cuda"])
    config: RFMemConfig = field(default_factory=RFMemConfig)
    spec: SyntheticSpec = field(default_factory=SyntheticSpec)
    seed: int = 0
    warmup: int = 3
    scales: list[int] = field(default_factory=lambda: [32 * 1024, 128 * 1024, 1024 * 1024])
    chunk_tokens: int = 256
    latency_queries: int = 50
    latency_modes: list[str] = field(default_factory=lambda: ["dense", "recollection", "rfmem"])
    multitenant: list[tuple[int, int]] = field(default_factory=lambda: [(1000, 4096), (10000, 1024)])
    mt_batches: list[int] = field(default_factory=lambda: [1024, 16384])
    mt_modes: list[str] = field(default_factory=lambda: ["dense", "rfmem"])
    dtypes: list[str] = field(default_factory=lambda: ["float32", "float16"])
    faiss_batch: int = 1024
    shared_sizes: list[int] = field(default_factory=lambda: [10**6, 10**7])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 16, 256, 4096, 65536])
    shared_modes: list[str] = field(default_factory=lambda: ["dense", "rfmem"])
    kmeans_problems: list[int] = field(default_factory=lambda: [1024, 16384])
    kmeans_points: int = 13
    kmeans_clusters: int = 4
    cell_budget_s: float = 10.0
    repeats: int = 2
    max_batch: int = 8192
    memory_budget: int | None = 4 << 30
    workload_backends: dict[str, list[str]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The settings as a JSON-ready dict."""
        out = {k: v for k, v in self.__dict__.items() if k not in ("config", "spec")}
        out["config"] = self.config.to_dict() if hasattr(self.config, "to_dict") else repr(self.config)
        out["spec"] = self.spec.to_dict()
        out["multitenant"] = [list(t) for t in self.multitenant]
        return out


def bank_supports_dtype() -> bool:
    """True when ``MemoryBank(dim, dtype=...)`` exists (half-precision banks)."""
    return "dtype" in inspect.signature(MemoryBank.__init__).parameters


def _err(e: BaseException) -> str:
    """A short description of an exception for the JSON (type and first line)."""
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:500]



class GpuBench:
    """Runs the GPU workloads (see the module docstring).

    Args:
        settings: sizes and systems.
        deadline: the run's shared time budget.
        say: status lines (timestamped by the caller).
        checkpoint: called after each bank / scale (the caller writes its JSON then).
    """

    def __init__(
        self, settings: GpuBenchSettings, deadline: Deadline, say: Callable[[str], None] | None = None,
        checkpoint: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.checkpoint = checkpoint or (lambda: None)
        self.s = settings
        self.dev = torch.device(settings.device)
        self.deadline = deadline
        self.say = say or (lambda m: None)
        self.notes: list[str] = []

    # ------------------------------------------------------------------ helpers
    def _ours(self, workload: str) -> list[Any]:
        out = []
        for name in self.s.workload_backends.get(workload, self.s.backends):
            try:
                be = get_backend(name, str(self.dev))
            except (ValueError, RuntimeError, ImportError) as e:
                self.notes.append(f"{workload}: backend {name} unavailable: {e}")
                continue
            if self.s.memory_budget is not None:  # temporaries per call (the beam driver chunks to it)
                be.memory_budget = int(self.s.memory_budget)
            out.append(be)
        return out

    def _note(self, msg: str) -> None:
        self.notes.append(msg)
        self.say(msg)

    def _faiss(self, use_cuvs: bool = False) -> FaissFlat | None:
        try:
            return FaissFlat(self.dev, use_cuvs=use_cuvs)
        except (ImportError, RuntimeError) as e:
            self._note(f"{'faiss+cuVS' if use_cuvs else 'faiss'} comparator skipped: {e}")
            return None

    def _free(self) -> None:
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()

    def _gpu_peak_mib(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.dev) / 2**20 if self.dev.type == "cuda" else None

    # ------------------------------------------------------------------ latency
    def latency(self, out: dict[str, Any] | None = None) -> dict[str, Any]:
        """Single-query latency per memory scale (see the module docstring).

        Args:
            out: dict filled in place as the work proceeds (what was measured survives a
                :class:`BudgetExceeded` or an error); default a new dict.
        """
        s, dev = self.s, self.dev
        out = {} if out is None else out
        out.update({"chunk_tokens": s.chunk_tokens, "queries": s.latency_queries, "scales": []})
        ours = self._ours("latency")
        fa = self._faiss()
        for si, tokens in enumerate(s.scales):
            self.deadline.check(f"latency {format_tokens(tokens)}")
            n = chunks_for_tokens(tokens, s.chunk_tokens)
            sb = synthetic_bank(1, n, s.spec, seed=s.seed + 101 * si)
            n_warm = max(1, s.warmup)
            Q, _, specific = sb.queries(n_warm + s.latency_queries, seed=s.seed + 7 + si)
            Qd = torch.from_numpy(Q).to(dev)
            users = [sb.users[0]]
            recs: list[dict[str, Any]] = []
            split = None
            for be in ours:
                for mode in s.latency_modes:
                    self.deadline.check(f"latency {format_tokens(tokens)} {be.name} {mode}")
                    try:
                        rec, facts = self._latency_cell(sb, Qd, users, be, mode, n_warm, tokens, n)
                    except BudgetExceeded:
                        raise
                    except Exception as e:  # noqa: BLE001 - a failed cell is recorded, the run goes on
                        rec, facts = {"system": be.name, "kind": "ours", "mode": mode, "tokens": tokens,
                                      "scale": format_tokens(tokens), "chunks": n, "error": _err(e)}, None  # fmt: skip
                        self._note(f"latency {format_tokens(tokens)} {be.name} {mode}: {rec['error']}")
                        self._free()
                    recs.append(rec)
                    if facts is not None and split is None:
                        split = route_summary(facts, specific[n_warm : n_warm + facts.route.shape[0]])
                        if split is not None:
                            split["backend"] = be.name
            if fa is not None:
                self.deadline.check(f"latency {format_tokens(tokens)} {fa.name}")
                try:
                    recs.append(self._latency_faiss(fa, sb, Qd, n_warm, tokens, n))
                except BudgetExceeded:
                    raise
                except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                    recs.append({"system": fa.name, "kind": "faiss", "mode": "dense", "tokens": tokens, "error": _err(e)})
                fa.release()
            out["scales"].append({"tokens": tokens, "scale": format_tokens(tokens), "chunks": n, "results": recs, "route_split": split})
            del sb
            self._free()
            self.checkpoint()
        return out

    def _latency_faiss(self, fa: "FaissFlat", sb: Any, Qd: torch.Tensor, n_warm: int, tokens: int, n: int) -> dict[str, Any]:
        """faiss single-query latency on the one-user bank ``sb``."""
        s, cfg, dev = self.s, self.s.config, self.dev
        X = torch.from_numpy(sb.bank.snapshot().vectors).to(dev)
        off = sb.bank.snapshot().offsets
        fa.build(X, off, [0])
        seg0 = np.zeros(1, np.int64)
        for i in range(n_warm):
            timed(lambda: fa.search(Qd[i : i + 1], seg0, off, cfg.out_k), dev)
        times = [timed(lambda: fa.search(Qd[i : i + 1], seg0, off, cfg.out_k), dev)[0] for i in range(n_warm, n_warm + s.latency_queries)]
        st = stats_ms(times)
        return {
            "system": fa.name, "kind": "faiss", "label": fa.label, "mode": "dense", "tokens": tokens,
            "scale": format_tokens(tokens), "chunks": n, "p50_ms": st["p50"], "p99_ms": st["p99"],
            "mean_ms": st["mean"], "min_ms": st["min"], "n_queries": st["n"],
        }  # fmt: skip

    def _latency_cell(self, sb: Any, Qd: torch.Tensor, users: list, be: Any, mode: str, n_warm: int, tokens: int, n: int):
        """One (backend, mode) latency series: (record, RunOutput of the routes or None)."""
        s, cfg, dev = self.s, self.s.config, self.dev
        call = lambda i: search(sb.bank, Qd[i : i + 1], users, cfg, mode=mode, backend=be, output="torch")  # noqa: E731
        for i in range(n_warm):
            timed(lambda: call(i), dev)
        times, res = [], []
        for i in range(n_warm, n_warm + s.latency_queries):
            dt, r = timed(lambda: call(i), dev)
            times.append(dt)
            res.append(r)
            if self.deadline.remaining() < 0:
                break
        st = stats_ms(times)
        with count_host_syncs(dev) as c:
            call(n_warm)
            sync(dev)
        rec = {
            "system": be.name, "kind": "ours", "mode": mode, "tokens": tokens, "scale": format_tokens(tokens),
            "chunks": n, "p50_ms": st["p50"], "p99_ms": st["p99"], "mean_ms": st["mean"], "min_ms": st["min"],
            "n_queries": st["n"], "host_syncs_per_call": c.count, "sync_count_method": c.method,
        }  # fmt: skip
        self.say(f"latency {format_tokens(tokens)} {be.name} {mode}: p50 {st['p50']:.3f} ms, {c.count} host syncs/call")
        facts = None
        if mode == "rfmem":
            facts = RunOutput(
                rows=np.empty((0, 0), np.int64),
                route=torch.cat([r.route for r in res]).cpu().numpy(),
                rule=torch.cat([r.rule for r in res]).cpu().numpy(),
                rounds=torch.cat([r.rounds for r in res]).cpu().numpy(),
            )
        return rec, facts

    # ------------------------------------------------------------------ batches
    def _run_batches(self, be, view, Q, qseg, mode, bs, n_batches, warm: bool = True) -> tuple[list[float], Any]:
        cfg, dev = self.s.config, self.dev
        run = lambda a: search_tensors(be, view, Q[a : a + bs], qseg[a : a + bs], cfg, mode, max_batch=self.s.max_batch)  # noqa: E731
        if warm:
            timed(lambda: run(0), dev)
        times, last = [], None
        for j in range(n_batches):
            a = (j * bs) % max(1, Q.shape[0] - bs + 1)
            dt, last = timed(lambda: run(a), dev)
            times.append(dt)
            if self.deadline.remaining() < 0:
                break
        return times, last

    def multitenant(self, out: dict[str, Any] | None = None) -> dict[str, Any]:
        """Multi-tenant batches on device-generated banks (see the module docstring; ``out`` as :meth:`latency`)."""
        s, cfg, dev = self.s, self.s.config, self.dev
        out = {} if out is None else out
        out.update({"banks": [], "batches": list(s.mt_batches)})
        ours = self._ours("multitenant")
        for (U, n) in s.multitenant:
            for dt_name in s.dtypes:
                label = f"{U} x {n} {dt_name}"
                if dt_name != "float32" and not bank_supports_dtype():
                    self._note(f"multitenant {label}: skipped, MemoryBank has no dtype argument yet (half-precision banks pending)")
                    out["banks"].append({"users": U, "items": n, "dtype": dt_name, "skipped": "MemoryBank(dim, dtype=...) not available"})
                    continue
                self.deadline.check(f"multitenant {label}")
                entry: dict[str, Any] = {"users": U, "items": n, "dtype": dt_name, "results": []}
                out["banks"].append(entry)
                db = device_bank(U, n, s.spec, s.seed + 2003, dev, dtype=getattr(torch, dt_name))
                view = view_from_tensors(db.X, db.offsets)
                big = max(s.mt_batches)
                Q, qseg, specific = device_queries(db, big + s.faiss_batch, s.spec, s.seed + 29)
                entry.update(gen_s=db.gen_s, bank_mib=db.nbytes / 2**20)
                self.say(f"multitenant {label}: generated {db.nbytes / 2**30:.1f} GiB on {dev} in {db.gen_s:.1f} s")
                kept: dict[tuple[str, str], torch.Tensor] = {}
                for be in ours:
                    for mode in s.mt_modes:
                        for bs in s.mt_batches:
                            self.deadline.check(f"multitenant {label} {be.name} {mode} batch {bs}")
                            rec: dict[str, Any] = {"system": be.name, "kind": "ours", "mode": mode, "batch_size": bs}
                            try:
                                times, last = self._run_batches(be, view, Q, qseg, mode, bs, n_batches=s.repeats if bs <= 4096 else max(1, s.repeats - 1))
                                qps = bs * len(times) / sum(times)
                                rec.update(qps=qps, ms_per_query=1e3 / qps, batch_ms=stats_ms(times), gpu_peak_mib=self._gpu_peak_mib())
                                if bs == s.faiss_batch or (bs == min(s.mt_batches)):
                                    kept[(be.name, mode)] = last.rows[: min(bs, 256)].cpu()
                                if mode == "rfmem" and "route_split" not in entry and last is not None:
                                    facts = RunOutput(np.empty((0, 0), np.int64), last.route.cpu().numpy(), last.rule.cpu().numpy(), last.rounds.cpu().numpy())
                                    entry["route_split"] = route_summary(facts, specific[:bs].cpu().numpy())
                                self.say(f"multitenant {label} {be.name} {mode} batch {bs}: {qps:,.0f} q/s")
                            except BudgetExceeded:
                                raise
                            except Exception as e:  # noqa: BLE001 - a failed cell is recorded, the run goes on
                                rec["error"] = _err(e)
                                self._note(f"multitenant {label} {be.name} {mode} batch {bs}: {rec['error']}")
                                self._free()
                            entry["results"].append(rec)
                for use_cuvs in (False, True):
                    fa = self._faiss(use_cuvs=use_cuvs) if (not use_cuvs or dev.type == "cuda") else None
                    if fa is None:
                        continue
                    bs = s.faiss_batch
                    self.deadline.check(f"multitenant {label} {fa.name}")
                    Qf, sf = Q[:bs], qseg[:bs]
                    sh = sf.cpu().numpy()
                    queried = sorted(set(sh.tolist()))
                    try:
                        build_s = fa.build(db.X, db.offsets, queried)
                        timed(lambda: fa.search(Qf, sh, db.offsets, cfg.out_k), dev)  # warm-up
                        times = []
                        for _ in range(s.repeats):
                            dt, rows = timed(lambda: fa.search(Qf, sh, db.offsets, cfg.out_k), dev)
                            times.append(dt)
                        qps = bs * len(times) / sum(times)
                        rec = {"system": fa.name, "kind": "faiss", "label": fa.label, "mode": "dense", "batch_size": bs,
                               "qps": qps, "ms_per_query": 1e3 / qps, "indexes": len(queried), "build_s": build_s}  # fmt: skip
                        ref = kept.get((ours[0].name, "dense")) if ours else None
                        if ref is not None:
                            m = min(ref.shape[0], rows.shape[0])
                            rec["agree_with_" + ours[0].name] = float((rows[:m].cpu() == ref[:m]).all(dim=1).float().mean())
                        entry["results"].append(rec)
                        self.say(f"multitenant {label} {fa.name} batch {bs}: {qps:,.0f} q/s ({len(queried)} indexes)")
                    except BudgetExceeded:
                        raise
                    except Exception as e:  # noqa: BLE001 - a comparator's failure is recorded, the run goes on
                        entry["results"].append({"system": fa.name, "kind": "faiss", "mode": "dense", "batch_size": bs, "error": _err(e)})
                    fa.release()
                if len(ours) > 1:  # our backends agree with each other on the same queries
                    for mode in s.mt_modes:
                        a = kept.get((ours[0].name, mode))
                        for be in ours[1:]:
                            b = kept.get((be.name, mode))
                            if a is not None and b is not None and a.shape == b.shape:
                                entry.setdefault("agreement", {})[f"{be.name} vs {ours[0].name} {mode}"] = float((a == b).all(dim=1).float().mean())
                del db, view, Q, qseg
                self._free()
                self.checkpoint()
        return out

    def shared(self, out: dict[str, Any] | None = None) -> dict[str, Any]:
        """One shared bank, batches of 1 to 65,536 (see the module docstring; ``out`` as :meth:`latency`)."""
        s, cfg, dev = self.s, self.s.config, self.dev
        out = {} if out is None else out
        out.update({"batch_sizes": list(s.batch_sizes), "sizes": []})
        ours = self._ours("shared")
        for si, n in enumerate(s.shared_sizes):
            self.deadline.check(f"shared {format_count(n)}")
            clusters = max(s.spec.clusters, n // SHARED_ITEMS_PER_CLUSTER)
            db = device_bank(1, n, s.spec, s.seed + 1009 + si, dev, clusters=clusters)
            view = view_from_tensors(db.X, db.offsets)
            big = max(s.batch_sizes)
            Q, qseg, _ = device_queries(db, big, s.spec, s.seed + 17 + si)
            entry: dict[str, Any] = {"n": n, "size": format_count(n), "clusters": clusters, "bank_mib": db.nbytes / 2**20,
                                     "gen_s": db.gen_s, "results": []}  # fmt: skip
            out["sizes"].append(entry)
            self.say(f"shared {format_count(n)}: generated in {db.gen_s:.1f} s")
            systems: list[tuple[Any, str]] = [(be, m) for be in ours for m in s.shared_modes]
            fa = self._faiss()
            if fa is not None:
                fa.build(db.X, db.offsets, [0])
                systems.append((fa, "dense"))
            for sysm, mode in systems:
                prev: tuple[int, float] | None = None
                for bs in s.batch_sizes:
                    name = sysm.name
                    rec: dict[str, Any] = {"system": name, "kind": "faiss" if sysm is fa else "ours", "mode": mode, "batch_size": bs}
                    if sysm is fa:
                        rec["label"] = fa.label
                    pred = None if prev is None else prev[1] * bs / prev[0]
                    if pred is not None and (pred > s.cell_budget_s or pred > self.deadline.remaining()):
                        rec["skipped"] = f"predicted {pred:.1f} s (linear from batch {prev[0]}) > cell budget {s.cell_budget_s:.0f} s or time left"
                        entry["results"].append(rec)
                        continue
                    self.deadline.check(f"shared {format_count(n)} {name} {mode} batch {bs}")
                    try:
                        if sysm is fa:
                            sh = qseg[:bs].cpu().numpy()
                            timed(lambda: fa.search(Q[: min(bs, 64)], sh[: min(bs, 64)], db.offsets, cfg.out_k), dev)
                            dt, _ = timed(lambda: fa.search(Q[:bs], sh, db.offsets, cfg.out_k), dev)
                            times = [dt]
                        else:
                            timed(lambda: search_tensors(sysm, view, Q[: min(bs, 64)], qseg[: min(bs, 64)], cfg, mode), dev)
                            times, _ = self._run_batches(sysm, view, Q, qseg, mode, bs, n_batches=1 if bs >= 4096 else s.repeats, warm=False)
                        qps = bs * len(times) / sum(times)
                        rec.update(qps=qps, ms_per_query=1e3 / qps, batch_s=float(np.mean(times)))
                        prev = (bs, float(np.mean(times)))
                        self.say(f"shared {format_count(n)} {name} {mode} batch {bs}: {qps:,.0f} q/s")
                    except BudgetExceeded:
                        raise
                    except Exception as e:  # noqa: BLE001 - a failed cell is recorded, the run goes on
                        rec["error"] = _err(e)
                        self._note(f"shared {format_count(n)} {name} {mode} batch {bs}: {rec['error']}")
                        self._free()
                        prev = (bs, math.inf)
                    entry["results"].append(rec)
            if fa is not None:
                fa.release()
            del db, view, Q, qseg
            self._free()
            self.checkpoint()
        return out

    # ------------------------------------------------------------------ KMeans
    def kmeans(self, out: dict[str, Any] | None = None) -> dict[str, Any]:
        """Batched KMeans vs one problem per call (cuML; our torch KMeans as a stand-in; ``out`` as :meth:`latency`)."""
        s, cfg, dev = self.s, self.s.config, self.dev
        out = {} if out is None else out
        out.update({"points": s.kmeans_points, "clusters": s.kmeans_clusters, "dim": s.spec.dim, "problems": []})
        ours = self._ours("kmeans")
        try:
            KMeans = _cuml_kmeans()
        except ImportError as e:
            KMeans = None
            self._note(f"cuML comparator skipped: {e}")
        g = torch.Generator(device=dev).manual_seed(s.seed + 77)
        for m in s.kmeans_problems:
            self.deadline.check(f"kmeans {m} problems")
            P, k = s.kmeans_points, s.kmeans_clusters
            V = _normalise(torch.randn(m, P, s.spec.dim, generator=g, device=dev))
            counts = torch.randint(k, P + 1, (m,), generator=g, device=dev)
            clusters = torch.clamp(counts, max=k)
            args = (cfg.kmeans_iters, cfg.kmeans_tol, cfg.kmeans_seed)
            entry: dict[str, Any] = {"m": m, "results": []}
            out["problems"].append(entry)
            labels0 = None
            for be in ours:
                self.deadline.check(f"kmeans {m} {be.name}")
                timed(lambda: be.batched_kmeans(V, counts, clusters, *args), dev)
                times, lab = [], None
                for _ in range(s.repeats):
                    dt, (lab, _c) = timed(lambda: be.batched_kmeans(V, counts, clusters, *args), dev)
                    times.append(dt)
                rec = {"system": be.name, "kind": "ours", "how": "batched, one call", "total_s": float(np.median(times)),
                       "per_problem_us": 1e6 * float(np.median(times)) / m}  # fmt: skip
                if labels0 is None:
                    labels0 = lab.cpu()
                else:
                    rec["labels_agree_with_" + ours[0].name] = float((lab.cpu() == labels0).all(dim=1).float().mean())
                entry["results"].append(rec)
                self.say(f"kmeans {m} {be.name}: {rec['total_s'] * 1e3:.2f} ms batched")
            # one problem per call: our torch KMeans (stand-in, always) and cuML (when installed)
            tb = TorchBackend(dev)
            cap_s = min(3.0, s.cell_budget_s / 2, max(0.5, self.deadline.remaining() / 8))
            per = self._per_problem(lambda i: tb.batched_kmeans(V[i : i + 1], counts[i : i + 1], clusters[i : i + 1], *args), m, cap_s)
            entry["results"].append({"system": "torch-per-problem", "kind": "per_problem", "how": "our torch KMeans, one problem per call",
                                     "per_problem_us": 1e6 * per[0], "total_s": per[0] * m, "sampled": per[1]})  # fmt: skip
            if KMeans is not None:
                Vc = [V[i, : int(c)] for i, c in enumerate(counts[: min(m, 512)].tolist())]

                def cuml_one(i: int) -> Any:
                    km = KMeans(n_clusters=int(clusters[i]), random_state=cfg.kmeans_seed, n_init=1,
                                max_iter=cfg.kmeans_iters, tol=cfg.kmeans_tol, init="k-means++")  # fmt: skip
                    return km.fit(Vc[i % len(Vc)])

                try:
                    per = self._per_problem(cuml_one, m, cap_s)
                    entry["results"].append({"system": "cuml", "kind": "cuml", "how": "cuML KMeans, one problem per call",
                                             "per_problem_us": 1e6 * per[0], "total_s": per[0] * m, "sampled": per[1]})  # fmt: skip
                except BudgetExceeded:
                    raise
                except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                    entry["results"].append({"system": "cuml", "kind": "cuml", "error": _err(e)})
            del V
            self._free()
            self.checkpoint()
        return out

    def _per_problem(self, fn: Callable[[int], Any], m: int, cap_s: float) -> tuple[float, int]:
        """(seconds per problem, problems run): ``fn(i)`` one problem at a time, within ``cap_s``."""
        timed(lambda: fn(0), self.dev)  # warm-up
        t0 = time.perf_counter()
        i = 0
        while i < m and (time.perf_counter() - t0) < cap_s:
            fn(i)
            i += 1
        sync(self.dev)
        return (time.perf_counter() - t0) / max(1, i), i
