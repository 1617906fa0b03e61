"""``rfmem bench``: the benchmark suite's command (registered by :func:`add_parser`).

``rfmem_fast.cli.build_parser`` imports this module when it exists and calls
``add_parser(subparsers)``; the sub-command's ``func`` (:func:`run`) returns the exit
code. ``bench/run_bench.py`` and ``python -m rfmem_fast.bench`` call :func:`main`.

Presets: the default (full) run, ``--quick`` (about 25 s with ``--threads 1`` on 2 CPU
cores, plus about 25 s the first time to embed PersonaBench; README "Benchmarks") and
``--smoke`` (seconds; for tests). A size flag given explicitly overrides its preset.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .._optional import require
from ..backends import BACKEND_NAMES
from .runners import WORKLOADS, Bench, BenchSettings
from .workloads import SyntheticSpec, default_cache_dir, default_personabench_dir, parse_size_list

MODES = ("dense", "recollection", "rfmem")

#: size flags per preset (the flag's dest -> value); explicit flags win.
PRESETS: dict[str, dict[str, Any]] = {
    "full": {
        "scales": "32K,128K,1M", "shared_sizes": "100000,1000000", "batch_sizes": "1,64,1024",
        "users": 1000, "items": 4096, "mt_batch": 1024, "latency_queries": 200, "min_queries": 32,
        "reference_queries": 64, "reference_budget": 10.0, "pb_users": 3, "warmup": 5,
        "dtypes": "float32,float16", "thread_counts": "1,2",
    },
    "quick": {
        "scales": "32K,128K", "shared_sizes": "10000", "batch_sizes": "1,64",
        "users": 50, "items": 512, "mt_batch": 256, "latency_queries": 50, "min_queries": 32,
        "reference_queries": 8, "reference_budget": 2.0, "pb_users": 1, "warmup": 3,
        "dtypes": "float32,float16", "thread_counts": "1,2",
    },
    "smoke": {
        "scales": "8K", "shared_sizes": "2000", "batch_sizes": "1,8",
        "users": 5, "items": 64, "mt_batch": 16, "latency_queries": 8, "min_queries": 8,
        "reference_queries": 2, "reference_budget": 0.5, "pb_users": 1, "warmup": 1, "personabench": "none",
        "dtypes": "float32,float16", "thread_counts": "",
    },
}  # fmt: skip


class BenchError(Exception):
    """A bad flag value (reported as ``rfmem bench: error: ...``, exit code 2)."""


def _csv(text: str) -> list[str]:
    return [t.strip() for t in str(text).split(",") if t.strip()]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``rfmem bench`` on an argparse sub-parsers object.

    Args:
        subparsers: the object returned by ``ArgumentParser.add_subparsers``.

    Returns:
        the ``bench`` parser (its ``func`` default is :func:`run`, returning an int
        exit code).
    """
    p = subparsers.add_parser(
        "bench",
        help="benchmarks: latency at 32K/128K/1M tokens, batch and multi-tenant throughput vs faiss and the reference",
        description=(
            "Run the benchmark workloads side by side (our backends, faiss IndexFlatIP, the reference "
            "backend's per-query loop) and write a JSON report and PNG plots. Sizes default to the full "
            "preset; --quick and --smoke shrink them; explicit size flags override the preset."
        ),
    )
    g = p.add_argument_group("presets")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--quick", action="store_true", help="small sizes, ~25 s with --threads 1 on 2 CPU cores (+~25 s once to embed PersonaBench): " + _preset_text("quick"))
    x.add_argument("--smoke", action="store_true", help="tiny sizes for tests (seconds): " + _preset_text("smoke"))
    g = p.add_argument_group("what to run")
    g.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of " + ", ".join(WORKLOADS) + " (default: all)")
    g.add_argument(
        "--backends", default="all",
        help=f"comma list of {', '.join(n for n in BACKEND_NAMES if n != 'auto')} (default: every available one "
        "except the reference, and triton only on CUDA; the reference always runs as the per-query loop)",
    )  # fmt: skip
    g.add_argument("--device", default=None, help="torch device of device-capable backends (default: CUDA if present)")
    g.add_argument("--modes", default=",".join(MODES), help="modes of the latency, multi-tenant and PersonaBench workloads (default %(default)s)")
    g.add_argument("--shared-modes", default="dense,rfmem", help="modes of the shared-bank batch workload (default %(default)s)")
    g.add_argument("--no-faiss", action="store_true", help="leave out faiss IndexFlatIP")
    g.add_argument("--no-reference", action="store_true", help="leave out the reference backend's per-query loop")
    g.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override an RFMemConfig field")
    g.add_argument("--no-hybrid", action="store_true", help="leave out the hybrid rows (RFMemConfig.recommended(): dense + BM25 over item texts)")
    g.add_argument("--hybrid-backend", default=None, help="backend of the hybrid rows (default: native when among --backends, else the first)")
    g.add_argument(
        "--hybrid-max-items", type=int, default=1 << 20,
        help="the multi-tenant hybrid row runs only on banks of at most this many items (a text twin and its "
        "lexical index, ~1.5 KB and ~0.1 ms per item) (default %(default)s; the full preset's 4M items are left out)",
    )  # fmt: skip
    g = p.add_argument_group("sizes (default: the full preset)")
    g.add_argument("--scales", default=None, help="latency: memory scales in tokens, K=1024, M=1024^2 (full: 32K,128K,1M)")
    g.add_argument("--chunk-tokens", type=int, default=256, help="tokens per memory chunk (chunks = tokens / this) (default %(default)s)")
    g.add_argument("--latency-queries", type=int, default=None, help="latency: timed queries per scale (full: 200)")
    g.add_argument("--shared-sizes", default=None, help="batch: vectors of the shared bank, K=1e3, M=1e6 (full: 100000,1000000)")
    g.add_argument("--batch-sizes", default=None, help="batch: batch sizes (full: 1,64,1024)")
    g.add_argument("--min-queries", type=int, default=None, help="batch: a cell runs max(1, ceil(this / batch)) batches (full: 32)")
    g.add_argument("--users", type=int, default=None, help="multi-tenant: users U (full: 1000)")
    g.add_argument("--items", type=int, default=None, help="multi-tenant: items per user (full: 4096)")
    g.add_argument("--mt-batch", type=int, default=None, help="multi-tenant: queries per batch (full: 1024)")
    g.add_argument("--dtypes", default=None, help="multi-tenant: bank dtypes our backends run on, of float32, float16, bfloat16 (full: float32,float16)")
    g.add_argument(
        "--thread-counts", default=None,
        help="batch and multi-tenant: CPU thread counts, each of ours and faiss runs once per count ('' = only the "
        "process's threads, see --threads) (full: 1,2)",
    )  # fmt: skip
    g.add_argument("--dim", type=int, default=384, help="synthetic vector dimension d (default %(default)s)")
    g.add_argument("--clusters", type=int, default=8, help="synthetic centres per user (the shared bank: max(this, n/512)) (default %(default)s)")
    g.add_argument("--specific-frac", type=float, default=0.5, help="share of synthetic queries drawn near an item (the rest near a centre) (default %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="seed of banks and queries (default %(default)s)")
    g.add_argument("--warmup", type=int, default=None, help="warm-up calls per system and mode, excluded (full: 5)")
    g.add_argument("--reference-queries", type=int, default=None, help="reference: at most this many sampled queries per cell (full: 64)")
    g.add_argument("--reference-budget", type=float, default=None, help="reference: at most this many seconds per cell, >= 1 query (full: 10)")
    g = p.add_argument_group("PersonaBench (real MiniLM embeddings)")
    g.add_argument("--personabench", default=None, metavar="DIR", help="folder holding synthetic_data/, or 'none' (default: ../shared/data/personabench/eval_data_v1 next to the checkout, if present)")
    g.add_argument("--pb-users", type=int, default=None, help="PersonaBench users per community (full: 3, the reference's 6 users)")
    g.add_argument("--noise", type=float, default=0.0, help="PersonaBench noise level (default %(default)s)")
    g.add_argument("--cache-dir", default=None, help=f"embedding cache folder (default {default_cache_dir()})")
    g.add_argument("--no-cache", action="store_true", help="always encode PersonaBench afresh")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="JSON file (default ./bench/results/local/bench-<timestamp>.json, under the current directory)")
    g.add_argument("--no-plots", action="store_true", help="do not write the PNG plots")
    g.add_argument("--plain", action="store_true", help="plain-text tables instead of rich")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g.add_argument("--threads", type=int, default=None, help="CPU threads of torch / our kernels / faiss (default: as configured); "
                   "without --thread-counts, every cell runs at this count only")
    p.set_defaults(func=run)
    return p


def _preset_text(name: str) -> str:
    v = PRESETS[name]
    return (
        f"scales {v['scales']}, shared {v['shared_sizes']}, batches {v['batch_sizes']}, "
        f"multi-tenant {v['users']} x {v['items']} batch {v['mt_batch']}"
    )


def _default_out() -> Path:
    """``bench/results/local/bench-<timestamp>.json`` under the current directory (in a
    checkout, the git-ignored folder beside the committed results; elsewhere, created there)."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path.cwd() / "bench" / "results" / "local" / f"bench-{stamp}.json"


def _positive(name: str, v: int | float) -> None:
    if v is None or v < 1:
        raise BenchError(f"{name} must be >= 1, got {v}")


def resolve(args: argparse.Namespace) -> tuple[BenchSettings, dict[str, Any], list[str]]:
    """Turn parsed flags into :class:`BenchSettings`.

    Returns:
        (settings, the resolved flag values for the JSON, notes).

    Raises:
        BenchError: a bad flag value (unknown backend / mode / workload, bad size).
    """
    from .. import available_backends
    from .._cliargs import config_from_sets as _config_from_sets
    import torch

    preset = "smoke" if args.smoke else "quick" if args.quick else "full"
    vals = dict(PRESETS[preset])
    for k in list(vals):
        if getattr(args, k, None) is not None:
            vals[k] = getattr(args, k)
    if getattr(args, "threads", None) is not None and getattr(args, "thread_counts", None) is None:
        vals["thread_counts"] = str(args.threads)  # --threads N: every cell at N threads, not the preset's counts
    notes: list[str] = []
    try:
        scales = parse_size_list(vals["scales"], binary=True)
        shared = parse_size_list(vals["shared_sizes"], binary=False)
        bss = parse_size_list(vals["batch_sizes"], binary=False)
    except ValueError as e:
        raise BenchError(str(e)) from None
    for name in ("users", "items", "mt_batch", "latency_queries", "min_queries", "reference_queries", "pb_users"):
        _positive("--" + name.replace("_", "-"), vals[name])
    from ..precision import BANK_DTYPES

    dtypes = _csv(vals["dtypes"])
    if not dtypes or any(d not in BANK_DTYPES for d in dtypes):
        raise BenchError(f"--dtypes must be a comma list of {','.join(BANK_DTYPES)}, got {vals['dtypes']!r}")
    if "float32" not in dtypes:
        dtypes.insert(0, "float32")  # the ratios compare with the float32 bank
    try:
        counts = [int(t) for t in _csv(vals["thread_counts"])]
    except ValueError:
        raise BenchError(f"--thread-counts must be a comma list of ints >= 1, got {vals['thread_counts']!r}") from None
    if any(t < 1 for t in counts):
        raise BenchError(f"--thread-counts must be a comma list of ints >= 1, got {vals['thread_counts']!r}")
    thread_counts = sorted(set(counts)) or None
    _positive("--chunk-tokens", args.chunk_tokens)
    _positive("--dim", args.dim)
    _positive("--clusters", args.clusters)
    if vals["warmup"] < 0:
        raise BenchError(f"--warmup must be >= 0, got {vals['warmup']}")
    if not vals["reference_budget"] > 0:
        raise BenchError(f"--reference-budget must be > 0, got {vals['reference_budget']}")
    if not 0.0 <= args.specific_frac <= 1.0:
        raise BenchError(f"--specific-frac must be in [0, 1], got {args.specific_frac}")
    workloads = _csv(args.workloads)
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or not workloads:
        raise BenchError(f"--workloads must be a comma list of {','.join(WORKLOADS)}, got {args.workloads!r}")
    modes, shared_modes = _csv(args.modes), _csv(args.shared_modes)
    for flag, ms in (("--modes", modes), ("--shared-modes", shared_modes)):
        if not ms or any(m not in MODES for m in ms):
            raise BenchError(f"{flag} must be a comma list of {','.join(MODES)}, got {','.join(ms)!r}")
    avail = available_backends()
    if args.backends == "all":
        backends = [b for b in avail if b != "reference"]
        if "triton" in backends and not torch.cuda.is_available():
            backends.remove("triton")
            notes.append("triton runs in Triton's CPU interpreter here (TRITON_INTERPRET=1): left out; name it in --backends to run it")
    else:
        backends = _csv(args.backends)
        unknown = [b for b in backends if b not in avail]
        if unknown:
            names = ", ".join(n for n in BACKEND_NAMES if n != "auto")
            raise BenchError(f"--backends: {unknown} not available here (backend names: {names}); available: {avail}")
        if "reference" in backends:
            backends.remove("reference")
            notes.append("the reference backend always runs as the per-query loop (--no-reference leaves it out)")
    if not backends:
        raise BenchError("no backend of ours to run (--backends)")
    if args.personabench is None:
        pb = vals.get("personabench")
        pb_dir = None if pb == "none" else default_personabench_dir()
        if pb != "none" and pb_dir is None and "personabench" in workloads:
            notes.append("PersonaBench folder not found (../shared/data/personabench/eval_data_v1): personabench skipped")
    elif args.personabench.lower() == "none":
        pb_dir = None
    else:
        pb_dir = Path(args.personabench)
        if not pb_dir.is_dir():
            raise BenchError(f"--personabench: no such folder {args.personabench!r}")
    if "personabench" not in workloads:
        pb_dir = None
    cache = None if args.no_cache else Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    hybrid_backend = None
    if not args.no_hybrid:
        hybrid_backend = args.hybrid_backend or ("native" if "native" in backends else backends[0])
        if hybrid_backend not in avail:
            raise BenchError(f"--hybrid-backend: {hybrid_backend!r} not available here; available: {avail}")
    _positive("--hybrid-max-items", args.hybrid_max_items)
    config = _config_from_sets(args.set)
    spec = SyntheticSpec(dim=args.dim, clusters=args.clusters, specific_frac=args.specific_frac)
    st = BenchSettings(
        config=config, backends=backends, device=args.device, faiss=not args.no_faiss,
        reference=not args.no_reference, workloads=workloads, modes=modes, shared_modes=shared_modes,
        spec=spec, seed=args.seed, warmup=vals["warmup"], scales=scales, chunk_tokens=args.chunk_tokens,
        latency_queries=vals["latency_queries"], shared_sizes=shared, batch_sizes=bss,
        min_queries=vals["min_queries"], users=vals["users"], items=vals["items"], mt_batch=vals["mt_batch"],
        dtypes=list(dict.fromkeys(dtypes)), thread_counts=thread_counts,
        reference_queries=vals["reference_queries"], reference_budget_s=float(vals["reference_budget"]),
        personabench=pb_dir, pb_users_per_community=vals["pb_users"], noise=args.noise, cache_dir=cache,
        hybrid=not args.no_hybrid, hybrid_backend=hybrid_backend, hybrid_max_items=args.hybrid_max_items,
    )  # fmt: skip
    resolved = {
        "preset": preset, "workloads": workloads, "backends": backends, "device": args.device,
        "faiss": st.faiss, "reference": st.reference, "modes": modes, "shared_modes": shared_modes,
        "scales_tokens": scales, "chunk_tokens": args.chunk_tokens, "latency_queries": st.latency_queries,
        "shared_sizes": shared, "batch_sizes": bss, "min_queries": st.min_queries, "users": st.users,
        "items": st.items, "mt_batch": st.mt_batch, "dtypes": st.dtypes, "thread_counts": st.thread_counts,
        "warmup": st.warmup, "seed": st.seed,
        "reference_queries": st.reference_queries, "reference_budget_s": st.reference_budget_s,
        "personabench": str(pb_dir) if pb_dir else None, "pb_users_per_community": st.pb_users_per_community,
        "noise": st.noise, "synthetic": spec.to_dict(),
        "hybrid": {"backend": hybrid_backend, "config": "RFMemConfig.recommended()", "max_items": st.hybrid_max_items,
                   "texts": st.text_spec.to_dict()} if hybrid_backend else None,
    }  # fmt: skip
    return st, resolved, notes


#: the modules whose versions the encoder benchmarks record (:func:`versions`)
ENCODER_MODULES = ("onnxruntime", "onnx", "sentence_transformers", "transformers")


def versions(modules: tuple[str, ...] = ()) -> dict[str, str | None]:
    """Versions of python, torch, numpy, faiss, scikit-learn, rfmem_fast (None when absent),
    and of each importable module named in ``modules`` (its ``__version__``; None when it
    does not import), e.g. the encoder benches' ``ENCODER_MODULES``."""
    import numpy
    import torch

    from .. import __version__

    out: dict[str, str | None] = {
        "python": platform.python_version(), "rfmem_fast": __version__, "torch": torch.__version__,
        "numpy": numpy.__version__,
    }  # fmt: skip
    try:
        import faiss

        out["faiss"] = faiss.__version__
    except ImportError:
        out["faiss"] = None
    for dist in ("scikit-learn", "sentence-transformers", "triton"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    for mod in modules:
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = None
    return out


def _threads(n: int | None) -> dict[str, int | None]:
    import torch

    faiss_threads = None
    try:
        import faiss

        if n is not None:
            faiss.omp_set_num_threads(n)
        faiss_threads = faiss.omp_get_max_threads()
    except ImportError:
        pass
    if n is not None:
        torch.set_num_threads(n)
    return {"torch": torch.get_num_threads(), "faiss": faiss_threads, "requested": n}


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):  # pragma: no cover - not on every platform
        return None


def _cpu_seconds() -> tuple[float, float, float] | None:
    """(wall, CPU seconds of the whole machine, CPU seconds of this process) now, or None."""
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()
        vals = [int(x) for x in parts[1:]]
        busy = sum(vals[:8]) - vals[3] - vals[4]  # all but idle and iowait (guest is inside user)
        own = os.times()
        return time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), own.user + own.system
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _other_cores(a: tuple[float, float, float] | None, b: tuple[float, float, float] | None) -> float | None:
    """Mean number of cores busy with other processes between two :func:`_cpu_seconds` samples."""
    if a is None or b is None or b[0] <= a[0]:
        return None
    return max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / (b[0] - a[0]))


def _require_extras(args: argparse.Namespace) -> None:
    """Check, before any work, the optional packages this run needs (extra ``bench``).

    matplotlib for the plots (unless ``--no-plots``), tqdm for the progress bars
    (unless ``--no-progress``). faiss and rich are optional even here: without faiss the
    faiss baseline is left out (a note says so), without rich the tables are plain.

    Raises:
        ImportError: a needed package is missing; the message names the extra and the
            flag that does without it.
    """
    if not args.no_plots:
        require("matplotlib", "bench", "rfmem bench's plots (or pass --no-plots)")
    if not args.no_progress:
        require("tqdm", "bench", "rfmem bench's progress bars (or pass --no-progress)")


def run(args: argparse.Namespace) -> int:
    """Run ``rfmem bench`` from parsed flags: workloads, tables, JSON, plots.

    Returns:
        0 on success, 2 on a bad flag value or a missing optional package (the
        message names the extra to install).
    """
    t0 = time.perf_counter()
    try:
        settings, resolved, notes = resolve(args)
        _require_extras(args)
    except (BenchError, ImportError) as e:
        print(f"rfmem bench: error: {e}", file=sys.stderr)
        return 2
    from ..evaluate import machine_info
    from .plots import write_plots
    from .report import build_tables, compute_ratios, print_tables, write_json

    threads = _threads(args.threads)
    say = (lambda s: print(s, file=sys.stderr)) if not args.no_progress else (lambda s: None)
    out_path = Path(args.out) if args.out else _default_out()
    started = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    load_start = _loadavg()
    cpu_start = _cpu_seconds()
    bench = Bench(settings, progress=not args.no_progress, say=say)
    workloads = bench.run()
    load_end = _loadavg()
    others = _other_cores(cpu_start, _cpu_seconds())
    notes = notes + bench.notes
    cores = os.cpu_count() or 1
    if others is not None and others > 0.25 * cores:
        what = (
            "multi-threaded kernels lose whole time slices to other processes, so these timings are inflated; "
            "rerun on a quiet machine (or compare with --threads 1)"
            if (threads["torch"] or 1) > 1
            else "single-threaded timings still share the cores, so they may be inflated"
        )
        notes.append(f"the machine was busy (other processes used {others:.1f} of {cores} cores on average): {what}")
    if settings.reference:
        notes.append(
            f"reference = the reference backend (numpy + scikit-learn) searched one query at a time, on a seeded "
            f"sample of at most {settings.reference_queries} queries and {settings.reference_budget_s:g} s per cell"
        )
    machine = machine_info()
    machine["threads"] = threads
    machine["load_average"] = {"start": load_start, "end": load_end}
    machine["other_processes_cores"] = others
    doc: dict[str, Any] = {
        "schema": "rfmem_fast.bench/1",
        "started": started,
        "command": list(sys.argv),
        "command_line": " ".join(sys.argv),
        "cwd": os.getcwd(),
        "machine": machine,
        "versions": versions(),
        "settings": resolved,
        "config": settings.config.to_dict(),
        "headline_backend": settings.backends[0],
        "workloads": workloads,
    }
    doc["ratios"] = compute_ratios(workloads, settings.backends)
    doc["notes"] = notes
    doc["wall_s"] = time.perf_counter() - t0
    write_json(doc, out_path)
    plots: list[Path] = []
    if not args.no_plots:
        plots = write_plots(doc, out_path)
        doc["plots"] = [str(p) for p in plots]
        write_json(doc, out_path)
    print_tables(build_tables(doc), plain=args.plain)
    for n in notes:
        print(f"note: {n}")
    print(f"wrote {out_path}" + "".join(f"\nwrote {p}" for p in plots))
    print(f"total {doc['wall_s']:.1f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``bench/run_bench.py`` / ``python -m rfmem_fast.bench``: ``rfmem bench`` with ``argv``.

    Args:
        argv: the bench flags (default ``sys.argv[1:]``).

    Returns:
        the exit code.
    """
    parser = argparse.ArgumentParser(prog="rfmem")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
