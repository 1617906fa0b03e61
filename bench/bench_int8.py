"""Dense top-k over an int8 scan copy vs the float32 scan vs faiss, one thread, side by side.

Systems (every one returns the top-10 of each query within its user's rows):

* ``native_f32``: ``_native.segmented_topk`` over the float32 rows (the native scan);
* ``native_int8``: the same kernel over the bank's int8 copy (``MemoryBank(dtype="int8")``:
  int8 rows with a scale and two norm bounds per row, int16 queries, exact int32 dots,
  every row that can still be in the top-k re-scored exactly: ids and scores equal
  ``native_f32``'s, which the run checks); where ``_native.int8_byte_queries(384)`` (the
  avx512_vnni kernels), its GEMM units (batches) take byte queries (vpdpbusd), their kept
  rows re-keyed with the int16 queries before the exact finish;
* ``native_int8_int16q`` (with byte queries only): the same with ``set_int8_byte_queries(False)``,
  int16 queries on every path, side by side;
* ``faiss_flat_ip``: faiss ``IndexFlatIP`` (one index per user for the multi-tenant bank),
  when faiss-cpu is installed; else ``numpy_matmul``: ``X @ q`` and ``np.argpartition``
  (BLAS on one thread).

Workloads (unit rows: Gaussian centres plus noise, as ``rfmem bench``; queries near an
item or a centre): ``shared_<rows>``, one segment of each of ``--shared-rows`` (1e5 and
1e6) x 384; ``tenants``, ``--users`` (200) users x ``--per-user`` (4096) rows x 384; each
at batch 1 (single-query calls, a random user each) and ``--batch`` (1024) queries per
call (random users).

Per cell: queries per second (median of ``--repeats`` timed passes of ``--queries``
queries, the cells taken in turns so that a change of load hits each alike; ``qps`` by
the wall clock, ``qps_cpu`` by the process's CPU time, which another process on the same
core does not inflate: every system runs on one thread), the ratios of the int8 copy to
the float32 scan and to faiss, and for the
int8 copy: the re-scored fraction (rows whose int8 upper bound reaches the k-th best lower
bound, from ``_native.int8_bounds`` on a sample of queries: the rows the exact finish
re-scores when its kept list of k + margin holds them, which it reports too: the share of
queries that would rescan), the bytes a query's scan reads (its segment's scan copy plus
the float32 rows it re-scores) and the extra memory per row (d + 12 bytes beside the
float32 rows). The JSON (``--out``, default ``bench/results/local/int8-scan-<time>.json``) holds
the CPU model and flags, the SIMD level and int8 kernels taken (``simd_int8_kernel``:
"avx512_vnni" when level 2 runs vpdpwssd), numpy's and faiss's BLAS (threadpoolctl),
the load average before and after the run and around each bank, versions and the exact
command.

Usage::

    python bench/bench_int8.py [--shared-rows 100000 1000000] [--users 200] [--per-user 4096]
        [--batch 1024] [--queries 64] [--repeats 3] [--out FILE]
    python bench/bench_int8.py --byte-crossover [ROWS ...]   # byte vs int16 queries by segment length
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

K = 10
D = 384


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def workload(rng: np.random.Generator, users: int, per_user: int, d: int) -> np.ndarray:
    """float32 [users * per_user, d] unit rows: per user 8 Gaussian centres plus noise."""
    out = np.empty((users * per_user, d), dtype=np.float32)
    for u in range(users):
        c = rng.normal(size=(8, d))
        lab = rng.integers(0, 8, size=per_user)
        out[u * per_user : (u + 1) * per_user] = _unit(c[lab] + 0.9 * rng.normal(size=(per_user, d)))
    return out


def queries(rng: np.random.Generator, X: np.ndarray, off: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n queries (random users), half near one of the user's items, half random directions."""
    users = rng.integers(0, off.shape[0] - 1, size=n)
    Q = np.empty((n, X.shape[1]), dtype=np.float32)
    for i, u in enumerate(users):
        a, e = int(off[u]), int(off[u + 1])
        base = X[rng.integers(a, e)] if i % 2 == 0 else rng.normal(size=X.shape[1])
        Q[i] = _unit((base + 0.5 * rng.normal(size=X.shape[1]) / np.sqrt(X.shape[1]))[None])[0]
    return Q, users.astype(np.int64)


def cpu_facts() -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
        for line in text.splitlines():
            if line.startswith("model name") and "model" not in info:
                info["model"] = line.split(":", 1)[1].strip()
            if line.startswith("flags") and "flags" not in info:
                flags = set(line.split(":", 1)[1].split())
                info["flags"] = sorted(f for f in flags if f.startswith(("avx", "fma", "f16c", "sse4", "amx")))
                info["avx512_vnni"] = "avx512_vnni" in flags
    except OSError:
        pass
    return info


def build_systems(X: np.ndarray, off: np.ndarray, codes: np.ndarray, meta: np.ndarray, xnorm: float):
    """{name: fn(Q, qseg) -> (scores, rows)} for the bank (X, off)."""
    from rfmem_fast import _native

    def f32(Q, seg):
        return _native.segmented_topk(X, off, Q, seg, K, 1, xnorm)

    def i8(Q, seg):
        return _native.segmented_topk(X, off, Q, seg, K, 1, xnorm, scan=codes, scan_meta=meta, scan_type="int8")

    systems: dict[str, Callable] = {"native_f32": f32, "native_int8": i8}
    if _native.int8_byte_queries(X.shape[1]):  # the same kernel with int16 queries on the GEMM path too

        def i8_int16(Q, seg):
            prev = _native.set_int8_byte_queries(False)
            try:
                return i8(Q, seg)
            finally:
                _native.set_int8_byte_queries(prev)

        systems["native_int8_int16q"] = i8_int16
    try:
        import faiss

        faiss.omp_set_num_threads(1)
        idx = []
        for u in range(off.shape[0] - 1):
            ix = faiss.IndexFlatIP(X.shape[1])
            ix.add(X[off[u] : off[u + 1]])
            idx.append(ix)

        def fx(Q, seg):
            s = np.empty((Q.shape[0], K), np.float32)
            r = np.empty((Q.shape[0], K), np.int64)
            for u in np.unique(seg):
                m = np.flatnonzero(seg == u)
                s[m], rr = idx[u].search(Q[m], K)
                r[m] = rr + off[u]
            return s, r

        systems["faiss_flat_ip"] = fx
    except ImportError:

        def npm(Q, seg):
            r = np.empty((Q.shape[0], K), np.int64)
            for i in range(Q.shape[0]):
                a, e = int(off[seg[i]]), int(off[seg[i] + 1])
                sc = X[a:e] @ Q[i]
                top = np.argpartition(-sc, K)[:K]
                r[i] = a + top[np.argsort(-sc[top])]
            return None, r

        systems["numpy_matmul"] = npm
    return systems


def int8_margin(rows: int) -> int:
    """The native top-k's over-fetch for the int8 copy when the longest segment has
    ``rows`` rows (csrc/cpu/topk.cpp scan_margin): rows / 256 within [64, 128]."""
    return min(128, max(64, rows // 256))


def byte_margin(rows: int) -> int:
    """The over-fetch of a call whose GEMM units take byte queries (csrc/cpu/topk.cpp
    byte_margin): 128, doubled for every tenfold rows past 1e4, within [128, 512]."""
    return min(512, max(128, round(128.0 * 2.0 ** np.log10(max(1.0, rows) / 1e4))))


def rescore_stats(X, off, codes, meta, xnorm, Q, seg) -> dict[str, float]:
    """Mean re-scored rows per query and the share of queries whose undecided rows exceed
    the kept list (k + int8_margin): from the int8 scan's own bounds (``_native.int8_bounds``).
    With byte queries (the GEMM units' form where ``int8_byte_queries``): the rows whose
    byte key reaches the int16 query's L (the kept list must hold them: k + byte_margin)."""
    from rfmem_fast import _native

    bytes_on = _native.int8_byte_queries(X.shape[1])
    longest = int(np.diff(off).max())
    rescored, rescans, rows, kept_b, rescans_b = [], 0, [], [], 0
    for i in range(Q.shape[0]):
        a, e = int(off[seg[i]]), int(off[seg[i] + 1])
        lo, up = _native.int8_bounds(codes[a:e], meta[a:e], Q[i : i + 1], xnorm)
        L = np.sort(lo[0])[-K] if e - a >= K else -np.inf
        m = int(np.count_nonzero(up[0] >= L))
        rescored.append(m)
        rows.append(e - a)
        rescans += m > K + int8_margin(longest)
        if bytes_on:
            _, up_b = _native.int8_bounds(codes[a:e], meta[a:e], Q[i : i + 1], xnorm, path="gemm-bytes")
            mb = int(np.count_nonzero(up_b[0] >= L))
            kept_b.append(mb)
            rescans_b += mb > K + byte_margin(longest)
    out = {"rescored_rows_per_query": float(np.mean(rescored)),
           "rescored_fraction": float(np.sum(rescored) / np.sum(rows)),
           "rescan_share": rescans / Q.shape[0], "sampled_queries": int(Q.shape[0])}  # fmt: skip
    if bytes_on:
        out.update({"byte_keys_reaching_L_per_query": float(np.mean(kept_b)),
                    "byte_keys_reaching_L_max": int(np.max(kept_b)),
                    "byte_rescan_share": rescans_b / Q.shape[0]})  # fmt: skip
    return out


def run_cells(cells: dict[str, tuple[Callable, list]], repeats: int) -> dict[str, tuple[float, float]]:
    """(median wall seconds, median CPU seconds of the process) per pass of each cell, the
    cells taken in turns."""
    times: dict[str, list[tuple[float, float]]] = {n: [] for n in cells}
    for fn, calls in cells.values():  # warm-up
        fn(*calls[0])
    for _ in range(repeats):
        for name, (fn, calls) in cells.items():
            t, c = time.perf_counter(), time.process_time()
            for args in calls:
                fn(*args)
            times[name].append((time.perf_counter() - t, time.process_time() - c))
    return {n: (float(np.median([w for w, _ in v])), float(np.median([c for _, c in v]))) for n, v in times.items()}


def bench_bank(label: str, X, off, args, rng) -> dict[str, Any]:
    from rfmem_fast.precision import int8_scan_copy

    codes, meta = int8_scan_copy(X)
    xnorm = float(meta[:, 2].max())
    systems = build_systems(X, off, codes, meta, xnorm)
    Q, seg = queries(rng, X, off, max(args.batch, args.queries))
    # exactness: the int8 copy's results are the float32 scan's, ids and scores
    want, got = systems["native_f32"](Q[: args.batch], seg[: args.batch]), systems["native_int8"](Q[: args.batch], seg[: args.batch])
    same = bool(np.array_equal(want[1], got[1]) and np.array_equal(want[0], got[0]))
    out: dict[str, Any] = {"rows": int(X.shape[0]), "users": int(off.shape[0] - 1), "d": int(X.shape[1]),
                           "int8_equals_float32": same, "load_avg_before": list(os.getloadavg())}  # fmt: skip
    for batch in (1, args.batch):
        cells = {}
        if batch == 1:
            calls = [(Q[i : i + 1], seg[i : i + 1]) for i in range(args.queries)]
            nq = args.queries
        else:
            calls = [(Q[:batch], seg[:batch])]
            nq = batch
        for name, fn in systems.items():
            cells[name] = (fn, calls)
        secs = run_cells(cells, args.repeats)
        cell: dict[str, Any] = {name: {"qps": nq / w, "qps_cpu": nq / c, "seconds_per_pass": w, "cpu_seconds_per_pass": c}
                                for name, (w, c) in secs.items()}  # fmt: skip
        other = "faiss_flat_ip" if "faiss_flat_ip" in cell else "numpy_matmul"
        for key in ("qps", "qps_cpu"):
            cell[f"int8_over_float32_{key}"] = cell["native_int8"][key] / cell["native_f32"][key]
            cell[f"int8_over_{other}_{key}"] = cell["native_int8"][key] / cell[other][key]
            if "native_int8_int16q" in cell:
                cell[f"int8_over_int16_queries_{key}"] = cell["native_int8"][key] / cell["native_int8_int16q"][key]
        out[f"batch_{batch}"] = cell
    sample = min(args.sample, Q.shape[0])
    st = rescore_stats(X, off, codes, meta, xnorm, Q[:sample], seg[:sample])
    seg_rows = float(np.mean(np.diff(off)[seg[:sample]]))
    d = X.shape[1]
    st.update({
        "scan_bytes_per_query_float32": seg_rows * d * 4,
        "scan_bytes_per_query_int8": seg_rows * (d + 12) + st["rescored_rows_per_query"] * d * 4,
        "extra_bytes_per_row_int8": d + 12,
    })  # fmt: skip
    out["int8"] = st
    out["load_avg_after"] = list(os.getloadavg())
    print(f"{label}: " + json.dumps({k: v for k, v in out.items() if k.startswith(("batch", "load"))}, default=float),
          flush=True)  # fmt: skip
    return out


def byte_crossover(lengths: list[int], batch: int, repeats: int, rng) -> list[dict[str, Any]]:
    """Byte against int16 queries on GEMM units over segments of each length: ``batch``
    queries over max(1, batch // 256) users of ``length`` rows (256 queries a user: the
    GEMM path), byte queries forced on from 0 rows (``set_int8_byte_queries(True, 0)``)
    and off, taken in turns; q/s (best of ``repeats``) and ids checked equal. The data
    behind ``INT8_BYTE_MIN_ROWS`` (csrc/cpu/kernels.h kI8ByteMinRows)."""
    from rfmem_fast import _native
    from rfmem_fast.precision import int8_scan_copy

    rows = []
    for length in lengths:
        users = max(1, batch // 256)
        X = workload(rng, users, length, D)
        off = np.arange(users + 1, dtype=np.int64) * length
        Q, seg = queries(rng, X, off, batch)
        codes, meta = int8_scan_copy(X)
        xn = float(meta[:, 2].max())
        want = _native.segmented_topk(X, off, Q, seg, K, 1, xn)[1]
        best = {True: np.inf, False: np.inf}
        try:
            for _ in range(repeats):
                for on in (True, False):
                    _native.set_int8_byte_queries(on, 0)
                    t = time.perf_counter()
                    got = _native.segmented_topk(X, off, Q, seg, K, 1, xn, scan=codes, scan_meta=meta, scan_type="int8")[1]
                    best[on] = min(best[on], time.perf_counter() - t)
                    if not np.array_equal(got, want):
                        raise AssertionError(f"int8 ids differ from float32 at {length} rows (bytes {on})")
        finally:
            _native.set_int8_byte_queries(True)
        row = {"rows_per_segment": length, "users": users, "queries": batch, "qps_byte_queries": batch / best[True],
               "qps_int16_queries": batch / best[False], "byte_over_int16": best[False] / best[True]}  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared-rows", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--users", type=int, default=200, help="tenants of the multi-tenant bank (0: the shared banks only)")
    ap.add_argument("--per-user", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--queries", type=int, default=64, help="single-query calls per timed pass")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sample", type=int, default=32, help="queries sampled for the re-scored fraction")
    ap.add_argument("--byte-crossover", type=int, nargs="*", default=None, metavar="ROWS",
                    help="only the byte-vs-int16-queries sweep over these segment lengths (GEMM units, 256 queries "
                         "a user; default lengths 512 4096 8192 16384 25000 50000)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.users < 0 or args.per_user < 1:
        ap.error(f"--users must be >= 0 and --per-user >= 1, got {args.users} and {args.per_user}")

    from threadpoolctl import threadpool_info, threadpool_limits

    import rfmem_fast
    from rfmem_fast import _native
    from rfmem_fast.evaluate import machine_info

    load0 = os.getloadavg()
    rng = np.random.default_rng(0)
    doc: dict[str, Any] = {"command": " ".join([sys.executable, *sys.argv]), "machine": machine_info(),
                           "cpu": cpu_facts(), "simd_level": int(_native.simd_level()),
                           "simd_int8_kernel": _native.simd_int8_kernel(),
                           "simd_note": "simd_int8_kernel: the int8 dots in use (csrc/cpu/simd.h): avx512_vnni = "
                                        "vpdpwssd (level 2 with AVX512_VNNI; its GEMM units vpdpbusd with byte "
                                        "queries where int8_byte_queries), avx512bw = vpmaddwd + vpaddd on zmm, "
                                        "avx2 = level 1's, baseline = plain C++",
                           "int8_byte_queries": bool(_native.int8_byte_queries(D)),
                           "versions": {"rfmem_fast": rfmem_fast.__version__, "numpy": np.__version__},
                           "threads": 1, "k": K, "load_avg_before": list(load0)}  # fmt: skip
    try:
        import faiss

        doc["versions"]["faiss"] = faiss.__version__
    except ImportError:
        doc["versions"]["faiss"] = None
    with threadpool_limits(1):
        doc["blas"] = [{k: v for k, v in lib.items() if k in ("user_api", "internal_api", "prefix", "version",
                                                               "num_threads", "threading_layer", "architecture")}
                       for lib in threadpool_info()]  # fmt: skip
        results = {}
        if args.byte_crossover is not None:
            if not _native.int8_byte_queries(D):
                ap.error("--byte-crossover needs the avx512_vnni int8 kernels (byte queries do not apply here)")
            lengths = args.byte_crossover or [512, 4096, 8192, 16384, 25000, 50000]
            results["byte_crossover"] = byte_crossover(lengths, args.batch, args.repeats, rng)
            args.shared_rows, args.users = [], 0
        for rows in args.shared_rows:
            X = workload(rng, 1, rows, D)
            results[f"shared_{rows}"] = bench_bank(f"shared_{rows}", X, np.array([0, X.shape[0]], np.int64), args, rng)
            del X
        if args.users > 0:  # --users 0: the shared banks only
            X = workload(rng, args.users, args.per_user, D)
            results["tenants"] = bench_bank("tenants", X, np.arange(args.users + 1, dtype=np.int64) * args.per_user, args, rng)
    doc["results"] = results
    doc["load_avg_after"] = list(os.getloadavg())
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / "local" / f"int8-scan-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=float))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
