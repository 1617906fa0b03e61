"""Benchmark report: the headline ratios, the JSON document and the printed tables.

The ratios (:func:`compute_ratios`) are computed only from figures of the same run:

* ``rfmem_p50_over_dense_p50``: RF-Mem p50 / dense p50 latency of the same backend at
  1M tokens (the largest scale run when 1M was not); the paper reports 1.42, the goal
  is <= 1.3.
* ``rfmem_qps_over_faiss_dense_qps``: RF-Mem queries per second of our backend / faiss
  IndexFlatIP dense queries per second on the shared bank at batch 1,024 (the largest
  batch size run otherwise), for the largest shared size; also per size and for the
  multi-tenant batch (faiss: one index per user, queries grouped per user).
* ``rfmem_speedup_vs_reference``: the reference's mean RF-Mem time per query (its
  per-query loop) / ours, on the multi-tenant batch (ours = batch time / batch size;
  the headline) and on single-query latency at the largest scale (ours = mean latency
  over the very queries the reference ran); goal >= 50.
* ``shared_dense_qps_over_faiss_dense_qps``: dense queries per second of our backend /
  faiss IndexFlatIP's on the shared bank at batch 1,024 (the largest batch run), per
  size and thread count; the value is the smallest over the sizes; goal >= 1.0.
  ``rfmem_qps_over_faiss_dense_qps`` carries the goal >= 0.3 the same way.
* ``multitenant_float16_dense_qps_over_float32`` / ``..._rfmem_...``: queries per second
  of our backend on the float16 bank / on the float32 bank, multi-tenant batch, per
  thread count; goals >= 1.6 (dense) and >= 1.4 (RF-Mem).
* ``thread_scaling``: queries per second with the most threads / with the fewest, per
  system variant and mode, for the workloads that ran several thread counts.
* ``route_split``: the fraction of queries RF-Mem sent to the Familiarity path, per
  workload.
* ``hybrid_p50_over_dense_p50``: p50 latency of the hybrid row (the hybrid backend with
  ``RFMemConfig.recommended()``: dense + BM25, given the query texts) / the same
  backend's dense p50, at 1M tokens (the largest scale run otherwise), per scale and on
  PersonaBench; goal <= 1.3 at 1M tokens.
* ``hybrid_qps_over_dense_qps``: queries per second of the hybrid row / the same
  backend's dense ones on the multi-tenant batch (float32 bank), per thread count, and
  on PersonaBench's whole-question batch; goal >= 0.6.

With several thread counts, every ratio but ``thread_scaling`` takes its figures at the
largest count (the headline; per-count values sit under ``per_threads``), and on the
float32 bank.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

PAPER_RFMEM_OVER_DENSE = 1.42
GOAL_RFMEM_OVER_DENSE = 1.3
GOAL_SPEEDUP_VS_REFERENCE = 50.0
GOAL_SHARED_DENSE_OVER_FAISS = 1.0
GOAL_SHARED_RFMEM_OVER_FAISS = 0.3
GOAL_F16_DENSE = 1.6
GOAL_F16_RFMEM = 1.4
GOAL_HYBRID_OVER_DENSE_P50 = 1.3
GOAL_HYBRID_OVER_DENSE_QPS = 0.6
ONE_M_TOKENS = 1024 * 1024
HALF = ("float16", "bfloat16")


def record_label(rec: dict[str, Any]) -> str:
    """A record's system variant as tables and plots name it."""
    if rec["kind"] == "reference":
        return "reference (per-query loop)"
    base = "faiss IndexFlatIP" if rec["kind"] == "faiss" else rec["system"]
    if rec["kind"] == "hybrid":
        base += " recommended() (dense + BM25)"
    dtype, threads = rec.get("dtype", "float32"), rec.get("threads")
    out = base if dtype == "float32" else f"{base} {dtype}"
    if threads is not None:
        out += f" [{threads} thread{'s' if threads != 1 else ''}]"
    return out


def _thread_counts(records: Iterable[dict[str, Any]]) -> list[int | None]:
    ts = sorted({r.get("threads") for r in records if r.get("threads") is not None})
    return ts or [None]


def _headline(records: Sequence[dict[str, Any]], threads: int | None = None) -> list[dict[str, Any]]:
    """The records of the headline variants: float32 banks, ``threads`` (default the
    largest thread count run) for ours and faiss; the reference's records kept."""
    t = _thread_counts(records)[-1] if threads is None else threads
    return [
        r for r in records
        if r["kind"] == "reference" or (r.get("dtype", "float32") == "float32" and r.get("threads") == t)
    ]  # fmt: skip


def _find(records: Iterable[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for r in records:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def _min(values: Iterable[Any]) -> float | None:
    vals = [v for v in values if v is not None]
    return min(vals) if vals else None


def _div(a: Any, b: Any) -> float | None:
    if a is None or b is None or not b or not math.isfinite(a) or not math.isfinite(b):
        return None
    return float(a) / float(b)


def compute_ratios(workloads: dict[str, Any], ours: Sequence[str]) -> dict[str, Any]:
    """The headline ratios of a run (see the module docstring).

    Args:
        workloads: the ``workloads`` dict of the JSON document.
        ours: our backend names in preference order; the first is the headline one.

    Returns:
        {ratio name: {"value": float or None, "backend": str, ... context,
        "per_backend": {name: float or None}}}; a ratio whose workload did not run is
        absent.
    """
    out: dict[str, Any] = {}
    head = ours[0] if ours else None
    lat = workloads.get("latency") or {}
    if lat.get("scales"):
        scales = sorted(lat["scales"], key=lambda s: s["tokens"])
        sc = next((s for s in scales if s["tokens"] == ONE_M_TOKENS), scales[-1])
        per, figs = {}, {}
        for b in ours:
            rf = _find(sc["results"], system=b, mode="rfmem")
            de = _find(sc["results"], system=b, mode="dense")
            if rf and de:
                per[b] = _div(rf["p50_ms"], de["p50_ms"])
                figs[b] = {"rfmem_p50_ms": rf["p50_ms"], "dense_p50_ms": de["p50_ms"]}
        fa = _find(sc["results"], system="faiss", mode="dense")
        val = per.get(head)
        out["rfmem_p50_over_dense_p50"] = {
            "value": val, "backend": head, "scale": sc["scale"], "tokens": sc["tokens"], "chunks": sc["chunks"],
            "at_paper_scale": sc["tokens"] == ONE_M_TOKENS, "paper": PAPER_RFMEM_OVER_DENSE,
            "goal": f"<= {GOAL_RFMEM_OVER_DENSE}", "meets_goal": None if val is None else val <= GOAL_RFMEM_OVER_DENSE,
            "per_backend": per, "figures_ms": figs,
            "rfmem_p50_over_faiss_dense_p50": {b: _div(f["rfmem_p50_ms"], fa["p50_ms"]) for b, f in figs.items()} if fa else None,
        }  # fmt: skip
        ref = _find(sc["results"], kind="reference", mode="rfmem")
        if ref:
            per_s = {}
            for b in ours:
                rf = _find(sc["results"], system=b, mode="rfmem")
                if rf:
                    per_s[b] = _div(ref["mean_ms"], rf.get("mean_ms_on_reference_sample"))
            out["_speedup_single"] = {
                "value": per_s.get(head), "scale": sc["scale"], "reference_mean_ms": ref["mean_ms"],
                "reference_queries": ref["n_queries"], "per_backend": per_s,
            }  # fmt: skip
    bat = workloads.get("batch") or {}
    if bat.get("sizes"):
        big = max(bat["batch_sizes"])
        counts = _thread_counts(r for sz in bat["sizes"] for r in sz["results"])

        def over_faiss(mode: str) -> dict[str, Any]:  # {threads: {size: {backend: ratio}}}
            table: dict[Any, Any] = {}
            for t in counts:
                for sz in bat["sizes"]:
                    recs = _headline(sz["results"], t)
                    fa = _find(recs, system="faiss", mode="dense", batch_size=big)
                    table.setdefault(t, {})[sz["size"]] = {
                        b: _div((_find(recs, system=b, mode=mode, batch_size=big) or {}).get("qps"), (fa or {}).get("qps"))
                        for b in ours
                    }  # fmt: skip
            return table

        rf_tab, de_tab = over_faiss("rfmem"), over_faiss("dense")
        top = counts[-1]
        per_size = rf_tab[top]
        largest = max(bat["sizes"], key=lambda s: s["n"])
        recs = _headline(largest["results"])
        per = per_size[largest["size"]]
        fa = _find(recs, system="faiss", mode="dense", batch_size=big)
        rf = _find(recs, system=head, mode="rfmem", batch_size=big)
        de = _find(recs, system=head, mode="dense", batch_size=big)
        worst_rf = _min([v.get(head) for v in per_size.values()])
        out["rfmem_qps_over_faiss_dense_qps"] = {
            "value": per.get(head), "backend": head, "batch_size": big, "shared_size": largest["size"],
            "n": largest["n"], "threads": top, "rfmem_qps": (rf or {}).get("qps"), "faiss_dense_qps": (fa or {}).get("qps"),
            "dense_qps": (de or {}).get("qps"), "per_backend": per, "per_size": per_size,
            "goal": f">= {GOAL_SHARED_RFMEM_OVER_FAISS:g}", "smallest_over_sizes": worst_rf,
            "meets_goal": None if worst_rf is None else worst_rf >= GOAL_SHARED_RFMEM_OVER_FAISS,
            "per_threads": rf_tab,
            "dense_qps_over_faiss_dense_qps": de_tab[top][largest["size"]],
        }  # fmt: skip
        worst_de = _min([v.get(head) for v in de_tab[top].values()])
        out["shared_dense_qps_over_faiss_dense_qps"] = {
            "value": worst_de, "backend": head, "batch_size": big, "threads": top, "per_size": de_tab[top],
            "goal": f">= {GOAL_SHARED_DENSE_OVER_FAISS:g}",
            "meets_goal": None if worst_de is None else worst_de >= GOAL_SHARED_DENSE_OVER_FAISS,
            "per_threads": de_tab,
            "gflops": {
                sz["size"]: {r["label"]: r.get("gflops") for r in sz["results"] if r.get("batch_size") == big and r.get("gflops")}
                for sz in bat["sizes"]
            },
        }  # fmt: skip
    mt = workloads.get("multitenant") or {}
    if mt.get("results"):
        counts = _thread_counts(mt["results"])
        for mode, goal in (("dense", GOAL_F16_DENSE), ("rfmem", GOAL_F16_RFMEM)):
            tab: dict[Any, dict[str, Any]] = {}
            for dt in [d for d in mt.get("dtypes", []) if d in HALF]:
                for t in counts:
                    for b in ours:
                        half = _find(mt["results"], system=b, mode=mode, dtype=dt, threads=t)
                        full = _find(mt["results"], system=b, mode=mode, dtype="float32", threads=t)
                        tab.setdefault(dt, {}).setdefault(t, {})[b] = _div((half or {}).get("qps"), (full or {}).get("qps"))
            if "float16" in tab:
                val = tab["float16"][counts[-1]].get(head)
                out[f"multitenant_float16_{mode}_qps_over_float32"] = {
                    "value": val, "backend": head, "threads": counts[-1], "batch_size": mt["batch_size"],
                    "goal": f">= {goal:g}", "meets_goal": None if val is None else val >= goal,
                    "per_backend": tab["float16"][counts[-1]], "per_threads": tab["float16"],
                    "per_dtype": tab,
                }  # fmt: skip
        mt_recs = _headline(mt["results"])
        fa = _find(mt_recs, system="faiss", mode="dense")
        per = {b: _div((_find(mt_recs, system=b, mode="rfmem", per_query_loop=None) or {}).get("qps"), (fa or {}).get("qps")) for b in ours}
        out["multitenant_rfmem_qps_over_faiss_dense_qps"] = {
            "value": per.get(head), "backend": head, "batch_size": mt["batch_size"], "users": mt["users"],
            "items": mt["items"], "per_backend": per,
        }  # fmt: skip
        ref = _find(mt["results"], kind="reference", mode="rfmem")
        if ref:
            per_b = {}
            for b in ours:
                rf = _find(mt_recs, system=b, mode="rfmem", per_query_loop=None)
                per_b[b] = _div(ref["ms_per_query"], (rf or {}).get("ms_per_query"))
            out["_speedup_batched"] = {
                "value": per_b.get(head), "batch_size": mt["batch_size"], "reference_mean_ms": ref["ms_per_query"],
                "reference_queries": ref["n_queries"], "per_backend": per_b,
            }  # fmt: skip
    out.update(_hybrid_ratios(workloads))
    single, batched = out.pop("_speedup_single", None), out.pop("_speedup_batched", None)
    if single or batched:
        head_val = (batched or {}).get("value") if batched else (single or {}).get("value")
        out["rfmem_speedup_vs_reference"] = {
            "value": head_val, "backend": head, "headline": "multitenant_batched" if batched else "single_query",
            "goal": f">= {GOAL_SPEEDUP_VS_REFERENCE:g}",
            "meets_goal": None if head_val is None else head_val >= GOAL_SPEEDUP_VS_REFERENCE,
            "multitenant_batched": batched, "single_query": single,
        }  # fmt: skip
    scaling: dict[str, Any] = {}
    for name, parts in (("batch", (workloads.get("batch") or {}).get("sizes") or []), ("multitenant", [mt] if mt.get("results") else [])):
        for part in parts:
            counts = _thread_counts(part["results"])
            if len(counts) < 2:
                continue
            big = max((r.get("batch_size") or 0) for r in part["results"])
            where = f"{name} {part.get('size')}" if part.get("size") else name
            for r in part["results"]:
                if r.get("threads") != counts[-1] or r.get("batch_size") != big or not r.get("qps"):
                    continue
                low = _find(part["results"], system=r["system"], mode=r["mode"], dtype=r.get("dtype"), threads=counts[0], batch_size=big)
                key = f"{record_label(dict(r, threads=None))} {r['mode']}"
                scaling.setdefault(where, {})[key] = _div(r["qps"], (low or {}).get("qps"))
    if scaling:
        out["thread_scaling"] = {"threads": [counts[0], counts[-1]], "qps_ratio": scaling}
    splits: dict[str, Any] = {}
    for name, w in workloads.items():
        if not isinstance(w, dict):
            continue
        if w.get("route_split"):
            splits[name] = w["route_split"]["familiarity_fraction"]
        for key in ("scales", "sizes"):
            for part in w.get(key) or []:
                if part.get("route_split"):
                    splits[f"{name} {part.get('scale') or part.get('size')}"] = part["route_split"]["familiarity_fraction"]
    if splits:
        out["route_split"] = {"familiarity_fraction": splits}
    return out


def _hybrid_ratios(workloads: dict[str, Any]) -> dict[str, Any]:
    """``hybrid_p50_over_dense_p50`` and ``hybrid_qps_over_dense_qps`` (module docstring); absent without hybrid rows."""
    out: dict[str, Any] = {}
    lat = workloads.get("latency") or {}
    mt = workloads.get("multitenant") or {}
    pb = workloads.get("personabench") or {}
    pb_lat = _find(pb.get("results") or [], kind="hybrid")
    pb_bat = _find(pb.get("batch") or [], kind="hybrid")
    scales = sorted(lat.get("scales") or [], key=lambda s: s["tokens"])
    per_scale = {s["scale"]: (_find(s["results"], kind="hybrid") or {}).get("p50_over_dense_p50") for s in scales}
    per_scale = {k: v for k, v in per_scale.items() if v is not None}
    if per_scale or pb_lat:
        sc = next((s for s in scales if s["tokens"] == ONE_M_TOKENS), scales[-1] if scales else None)
        hr = _find(sc["results"], kind="hybrid") if sc else None
        val = (hr or {}).get("p50_over_dense_p50")
        out["hybrid_p50_over_dense_p50"] = {
            "value": val, "backend": (hr or pb_lat or {}).get("system"), "config": "RFMemConfig.recommended()",
            "scale": sc["scale"] if sc else None, "tokens": sc["tokens"] if sc else None,
            "hybrid_p50_ms": (hr or {}).get("p50_ms"), "dense_p50_ms": (hr or {}).get("dense_p50_ms"),
            "per_scale": per_scale, "personabench": (pb_lat or {}).get("p50_over_dense_p50"),
            "goal": f"<= {GOAL_HYBRID_OVER_DENSE_P50:g}",
            "meets_goal": None if val is None or not (sc and sc["tokens"] == ONE_M_TOKENS) else val <= GOAL_HYBRID_OVER_DENSE_P50,
        }  # fmt: skip
    hyb = [r for r in mt.get("results") or [] if r["kind"] == "hybrid" and r.get("qps_over_dense_qps") is not None]
    if hyb or (pb_bat and pb_bat.get("qps_over_dense_qps") is not None):
        counts = _thread_counts(hyb)
        per_t = {t: r["qps_over_dense_qps"] for t in counts for r in hyb if r.get("threads") == t}
        top = _find(hyb, threads=counts[-1]) if hyb else None
        val = (top or {}).get("qps_over_dense_qps")
        out["hybrid_qps_over_dense_qps"] = {
            "value": val, "backend": (top or pb_bat or {}).get("system"), "config": "RFMemConfig.recommended()",
            "threads": counts[-1] if hyb else None, "batch_size": mt.get("batch_size") if hyb else None,
            "users": mt.get("users") if hyb else None, "items": mt.get("items") if hyb else None,
            "hybrid_qps": (top or {}).get("qps"), "dense_qps": (top or {}).get("dense_qps"), "per_threads": per_t,
            "personabench_batch": (pb_bat or {}).get("qps_over_dense_qps"),
            "goal": f">= {GOAL_HYBRID_OVER_DENSE_QPS:g}",
            "meets_goal": None if val is None else val >= GOAL_HYBRID_OVER_DENSE_QPS,
        }  # fmt: skip
    return out


def clean_json(obj: Any) -> Any:
    """A copy of ``obj`` that ``json.dump`` writes as strict JSON (NaN / Inf -> None, numpy -> Python)."""
    import numpy as np

    if isinstance(obj, dict):
        return {str(k): clean_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_json(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        f = float(obj)
        return f if math.isfinite(f) else None
    if isinstance(obj, np.ndarray):
        return clean_json(obj.tolist())
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_json(doc: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write the document atomically (strict JSON, indented); creates the folder.

    Returns:
        the path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(clean_json(doc), f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------- tables


def _f(x: Any, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if not math.isfinite(x):
            return "-"
        if abs(x) >= 1000:
            return f"{x:,.0f}"
        if abs(x) >= 100:
            return f"{x:.1f}"
        return f"{x:.{nd}f}"
    return str(x)


def _row_keys(records: Iterable[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(kind, label, mode) of the table rows: ours, then faiss, then the reference, each in
    the order of the records (variants by label)."""
    seen: list[tuple[str, str, str]] = []
    for r in records:
        key = (r["kind"], r.get("label", r["system"]), r["mode"])
        if key not in seen:
            seen.append(key)
    order = {"ours": 0, "hybrid": 0.5, "faiss": 1, "reference": 2}
    return sorted(seen, key=lambda k: order.get(k[0], 3))


def _by_label(records: Iterable[dict[str, Any]], label: str, **match: Any) -> dict[str, Any] | None:
    return next((r for r in records if r.get("label", r["system"]) == label and all(r.get(k) == v for k, v in match.items())), None)


Table = tuple[str, list[str], list[list[str]], list[str]]  # title, headers, rows, footnotes


def build_tables(doc: dict[str, Any]) -> list[Table]:
    """The report as tables: (title, headers, rows of str, footnotes) per workload and ratios."""
    tables: list[Table] = []
    w = doc.get("workloads", {})
    lat = w.get("latency") or {}
    if lat.get("scales"):
        scales = lat["scales"]
        recs = [r for s in scales for r in s["results"]]
        headers = ["system", "mode"] + [f"{s['scale']} ({s['chunks']} ch) p50 / p99" for s in scales]
        rows, notes = [], []
        for kind, system, mode in _row_keys(recs):
            cells = []
            for s in scales:
                r = _by_label(s["results"], system, mode=mode)
                if r is None:
                    cells.append("-")
                    continue
                c = f"{_f(r['p50_ms'])} / {_f(r['p99_ms'])}"
                if r.get("sampled"):
                    c += f" (n={r['n_queries']})"
                cells.append(c)
            first = next(r for s in scales for r in s["results"] if r.get("label", r["system"]) == system)
            rows.append([record_label(first), mode] + cells)
        notes.append(f"ms per query, one query per call, {lat['queries']} queries per scale (warm-up excluded).")
        if any(r["kind"] == "hybrid" for r in recs):
            notes.append(_hybrid_note(lat.get("texts")))
        if any(r.get("sampled") for r in recs):
            notes.append("reference: a seeded sample of the same queries (n = queries run; --reference-queries / --reference-budget).")
        for s in scales:
            rs = s.get("route_split")
            if rs:
                notes.append(_split_note(f"{s['scale']}", rs))
        tables.append(("Latency: one user's memory, one query at a time", headers, rows, notes))
    bat = w.get("batch") or {}
    for sz in bat.get("sizes") or []:
        bss = bat["batch_sizes"]
        headers = ["system", "mode"] + [f"qps @ batch {b}" for b in bss] + [f"ms/query @ {max(bss)}", f"GFLOP/s @ {max(bss)}"]
        rows, notes = [], []
        for kind, system, mode in _row_keys(sz["results"]):
            if kind == "reference":
                r = _by_label(sz["results"], system, mode=mode)
                rows.append([record_label(r), mode] + [f"{_f(r['qps'])} (loop, n={r['n_queries']})"] + ["-"] * (len(bss) - 1) + [_f(r["ms_per_query"]), "-"])
                continue
            cells = []
            for b in bss:
                r = _by_label(sz["results"], system, mode=mode, batch_size=b)
                cells.append("skipped" if r and r.get("skipped") else _f(r.get("qps"), 1) if r else "-")
            rb = _by_label(sz["results"], system, mode=mode, batch_size=max(bss))
            rows.append([record_label(rb), mode] + cells + [_f((rb or {}).get("ms_per_query")), _f((rb or {}).get("gflops"), 1)])
        notes.append(f"queries per second; each cell runs max(1, ceil({bat['min_queries']} / batch)) batches; GFLOP/s = 2 n d x dense qps.")
        if sz.get("route_split"):
            notes.append(_split_note(f"batch {max(bss)}", sz["route_split"]))
        tables.append((f"Batch throughput: one shared bank of {sz['n']:,} vectors ({sz['bank_mib']:.0f} MiB)", headers, rows, notes))
    if bat.get("sizes") and bat.get("peak_rss_gib"):
        tables[-1][3].append(f"peak RSS of the process after the batch workload: {bat['peak_rss_gib']:.1f} GiB.")
    mt = w.get("multitenant") or {}
    if mt.get("results"):
        headers = ["system", "mode", "qps", "ms/query", "scan GB/s", "agree w/ ref"]
        rows = []
        for kind, system, mode in _row_keys(mt["results"]):
            r = _by_label(mt["results"], system, mode=mode)
            qps = _f(r["qps"], 1) + (f" (loop, n={r['n_queries']})" if r.get("per_query_loop") else "")
            rows.append([record_label(r), mode, qps, _f(r["ms_per_query"]), _f(r.get("scan_gb_per_s"), 1), _f(r.get("agree_reference"), 2)])
        notes = [
            f"{mt['users']} users x {mt['items']} items ({mt['bank_mib']:.0f} MiB), batch {mt['batch_size']} x {mt['n_batches']}, "
            f"{mt['queried_users']} users queried; faiss: one IndexFlatIP per user, queries grouped per user."
        ]
        if mt.get("scan_mib") and len(mt["scan_mib"]) > 1:
            notes.append(
                "banks: " + ", ".join(f"{dt} scan copy {v:.0f} MiB" for dt, v in mt["scan_mib"].items())
                + " (a half-precision bank also keeps the float32 rows, read only to re-score candidates; scan GB/s = "
                "bytes of the queried user's scan copy x dense qps)."
            )
        if any(r["kind"] == "hybrid" for r in mt["results"]):
            notes.append(_hybrid_note(mt.get("texts")) + " Float32 bank only.")
        elif mt.get("hybrid_skipped"):
            notes.append(f"no hybrid row: {mt['hybrid_skipped']}.")
        if mt.get("route_split"):
            notes.append(_split_note("multitenant", mt["route_split"]))
        notes.append(f"bank built in {mt['build_s']:.1f} s; peak RSS of the process so far: {mt['peak_rss_gib']:.1f} GiB.")
        tables.append(("Multi-tenant batch: each query against a random user's bank", headers, rows, notes))
    pb = w.get("personabench") or {}
    if pb.get("results"):
        headers = ["system", "mode", "p50 ms", "p99 ms", "mean ms", f"batch ms/q ({pb['questions']})", "agree w/ ref"]
        rows = []
        for kind, system, mode in _row_keys(pb["results"]):
            r = _by_label(pb["results"], system, mode=mode)
            br = _find(pb.get("batch", []), system=r["system"], mode=mode)
            p50 = _f(r["p50_ms"]) + (f" (n={r['n_queries']})" if r.get("sampled") else "")
            rows.append([record_label(r), mode, p50, _f(r["p99_ms"]), _f(r["mean_ms"]), _f((br or {}).get("ms_per_query")), _f(r.get("agree_reference"), 2)])
        src = "cache" if pb["embeddings_cached"] else "encoded now"
        notes = [
            f"{pb['users']} users, {pb['chunks']} chunks, {pb['questions']} questions (MiniLM, {src}: "
            f"chunks {_f(pb['encode_chunks_s'], 1)} s, {_f(pb['encode_ms_per_question'], 2)} ms per question in a batch)."
        ]
        if any(r["kind"] == "hybrid" for r in pb["results"]):
            notes.append(_hybrid_note(None))
        if pb.get("route_split"):
            notes.append(_split_note("personabench", pb["route_split"]))
        tables.append(("PersonaBench (real MiniLM embeddings): per-question latency", headers, rows, notes))
    for name, wl in w.items():
        if isinstance(wl, dict) and wl.get("skipped"):
            tables.append((f"{name}: skipped", ["reason"], [[wl["skipped"]]], []))
    rt = doc.get("ratios") or {}
    if rt:
        rows = []
        r = rt.get("rfmem_p50_over_dense_p50")
        if r:
            rows.append([f"RF-Mem p50 / dense p50 @ {r['scale']} tokens", _f(r["value"], 2), f"{r['goal']} (paper {r['paper']})", _per(r["per_backend"])])
        r = rt.get("shared_dense_qps_over_faiss_dense_qps")
        if r and "per_threads" in r:  # reports written before thread counts: no such ratio
            for t, sizes in r["per_threads"].items():
                for size, per in sizes.items():
                    rows.append([f"dense qps / faiss dense qps @ batch {r['batch_size']}, {size} shared{_threads_txt(t)}", _f(per.get(r["backend"]), 2), r["goal"], _per(per)])
        r = rt.get("rfmem_qps_over_faiss_dense_qps")
        if r and "per_threads" not in r:  # a report written before thread counts
            rows.append([f"RF-Mem qps / faiss dense qps @ batch {r['batch_size']}, {r.get('shared_size', '')} shared",
                         _f(r["value"], 3), r.get("goal", "-"), _per(r["per_backend"])])  # fmt: skip
        elif r:
            for t, sizes in r["per_threads"].items():
                for size, per in sizes.items():
                    rows.append([f"RF-Mem qps / faiss dense qps @ batch {r['batch_size']}, {size} shared{_threads_txt(t)}", _f(per.get(r["backend"]), 3), r["goal"], _per(per)])
        for mode in ("dense", "rfmem"):
            r = rt.get(f"multitenant_float16_{mode}_qps_over_float32")
            if r and "per_threads" in r:
                for t, per in r["per_threads"].items():
                    name = "dense" if mode == "dense" else "RF-Mem"
                    rows.append([f"float16 / float32 bank, {name} qps, multi-tenant batch {r['batch_size']}{_threads_txt(t)}", _f(per.get(r["backend"]), 2), r["goal"], _per(per)])
        r = rt.get("thread_scaling")
        if r:
            for where, per in r["qps_ratio"].items():
                rows.append([f"qps {r['threads'][1]} threads / {r['threads'][0]} thread(s), {where}", "", "", _per(per)])
        r = rt.get("hybrid_p50_over_dense_p50")
        if r:
            detail = ", ".join(f"{k} {_f(v, 2)}" for k, v in r["per_scale"].items())
            if r.get("personabench") is not None:
                detail += (", " if detail else "") + f"PersonaBench {_f(r['personabench'], 2)}"
            where = f" @ {r['scale']} tokens" if r.get("scale") else ""
            rows.append([f"hybrid p50 / dense p50{where} (recommended(), {r['backend']})", _f(r["value"], 2), r["goal"], detail or "-"])
        r = rt.get("hybrid_qps_over_dense_qps")
        if r:
            detail = ", ".join(f"{_threads_txt(t).lstrip(', ') or 'process threads'} {_f(v, 2)}" for t, v in r["per_threads"].items())
            if r.get("personabench_batch") is not None:
                detail += (", " if detail else "") + f"PersonaBench batch {_f(r['personabench_batch'], 2)}"
            where = f", multi-tenant batch {r['batch_size']}{_threads_txt(r['threads'])}" if r.get("batch_size") else ""
            rows.append([f"hybrid qps / dense qps{where} (recommended(), {r['backend']})", _f(r["value"], 2), r["goal"], detail or "-"])
        r = rt.get("multitenant_rfmem_qps_over_faiss_dense_qps")
        if r:
            rows.append([f"RF-Mem qps / faiss dense qps, multi-tenant batch {r['batch_size']}", _f(r["value"], 3), "-", _per(r["per_backend"])])
        r = rt.get("rfmem_speedup_vs_reference")
        if r:
            for key, lab in (("multitenant_batched", "batched, multi-tenant"), ("single_query", "single query")):
                x = r.get(key)
                if x:
                    extra = f" @ {x['scale']}" if key == "single_query" else f" @ batch {x['batch_size']}"
                    rows.append([f"reference time / ours, RF-Mem ({lab}{extra})", _f(x["value"], 1), r["goal"], _per(x["per_backend"], 1)])
        r = rt.get("route_split")
        if r:
            rows.append(["route split: familiarity fraction", "", "", ", ".join(f"{k}: {v:.2f}" for k, v in r["familiarity_fraction"].items())])
        tables.append((f"Ratios (headline backend: {doc.get('headline_backend')})", ["ratio", "value", "goal", "per backend / detail"], rows, []))
    return tables


def _hybrid_note(texts: dict[str, Any] | None) -> str:
    src = (
        f"seeded synthetic texts ({texts['words']} Zipf words per item, a query = {texts['query_item_words']} words of "
        f"its item + {texts['query_extra_words']} Zipf draws)" if texts else "the real chunk and question texts"
    )  # fmt: skip
    return (
        "hybrid = RFMemConfig.recommended() (cosine + 0.03 x BM25, never recollecting) on the bank with item texts, "
        f"given the query texts: {src}; its ratio to dense is in the Ratios table."
    )


def _threads_txt(t: Any) -> str:
    return "" if t in (None, "None", "null") else f", {t} thread{'s' if str(t) != '1' else ''}"


def _per(d: dict[str, Any] | None, nd: int = 2) -> str:
    if not d:
        return "-"
    return ", ".join(f"{k} {_f(v, nd)}" for k, v in d.items())


def _split_note(where: str, rs: dict[str, Any]) -> str:
    s = (
        f"route split ({where}, {rs.get('backend')}): familiarity {rs['familiarity']} / recollection "
        f"{rs['recollection']} ({100 * rs['familiarity_fraction']:.0f} % familiar), mean rounds "
        f"{rs['mean_rounds_recollection']:.1f}"
    )
    if rs.get("familiarity_fraction_specific") is not None:
        s += (
            f"; familiar among specific queries {100 * rs['familiarity_fraction_specific']:.0f} %, "
            f"among vague {100 * (rs.get('familiarity_fraction_vague') or 0):.0f} %"
        )
    return s


def format_plain(tables: Sequence[Table]) -> str:
    """The tables as fixed-width plain text."""
    out: list[str] = []
    for title, headers, rows, notes in tables:
        widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)] if rows else [len(h) for h in headers]
        out.append(title)
        out.append("  ".join(h.ljust(wd) for h, wd in zip(headers, widths)))
        out.append("  ".join("-" * wd for wd in widths))
        for r in rows:
            out.append("  ".join(str(c).ljust(wd) for c, wd in zip(r, widths)))
        out.extend(f"  {n}" for n in notes)
        out.append("")
    return "\n".join(out)


def format_markdown(tables: Sequence[Table]) -> str:
    """The tables as GitHub markdown (a bold title line, the table, the footnotes as text)."""
    out: list[str] = []
    for title, headers, rows, notes in tables:
        out.append(f"**{title}**")
        out.append("")
        out.append("| " + " | ".join(headers) + " |")
        out.append("|" + "---|" * len(headers))
        for r in rows:
            out.append("| " + " | ".join(str(c).replace("|", "/") for c in r) + " |")
        out.append("")
        for n in notes:
            out.append(f"{n}  ")
        out.append("")
    return "\n".join(out)


def print_tables(tables: Sequence[Table], plain: bool = False, file: Any = None) -> None:
    """Print the tables with rich when available (and ``plain`` is False), else as plain text.

    Args:
        tables: from :func:`build_tables`.
        plain: force plain text.
        file: a text stream (default sys.stdout).
    """
    import sys

    file = file or sys.stdout
    if not plain:
        try:
            from rich.console import Console
            from rich.table import Table as RichTable
        except ImportError:
            plain = True
    if plain:
        print(format_plain(tables), file=file)
        return
    width = None if file.isatty() else 200
    console = Console(file=file, width=width, highlight=False)
    for title, headers, rows, notes in tables:
        t = RichTable(title=title, title_justify="left", caption="\n".join(notes) or None, caption_justify="left")
        for h in headers:
            t.add_column(h, overflow="fold")
        for r in rows:
            t.add_row(*[str(c) for c in r])
        console.print(t)
