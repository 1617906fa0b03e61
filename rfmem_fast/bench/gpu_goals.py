"""The GPU targets (:data:`GOALS`, docs/benchmarks/gpu.md) and the run's figures against
them (:func:`goal_ratios`), and the figures in the layout of :mod:`rfmem_fast.bench.plots`
(:func:`plot_doc`): the report side of :mod:`rfmem_fast.bench.gpu`.
"""
from __future__ import annotations

import math
from typing import Any

#: the GPU targets on an H200 (ratios from one run; docs/benchmarks/gpu.md)
GOALS = {
    "rfmem_p50_ms_at_1M_tokens": {"goal": "< 0.5 ms", "op": "<", "value": 0.5},
    "multitenant_rfmem_qps_1000x4096": {"goal": ">= 200,000 q/s", "op": ">=", "value": 200_000.0},
    "dense_qps_over_faiss_gpu": {"goal": ">= 1.0", "op": ">=", "value": 1.0},
    "batched_kmeans_over_cuml_per_problem": {"goal": ">= 10", "op": ">=", "value": 10.0},
}


def _best(recs: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    rs = [r for r in recs if r.get("qps") and all(r.get(k) == v for k, v in match.items())]
    return max(rs, key=lambda r: r["qps"]) if rs else None


def _meets(name: str, value: float | None) -> bool | None:
    if value is None or not math.isfinite(value):
        return None
    g = GOALS[name]
    return value < g["value"] if g["op"] == "<" else value >= g["value"]


def goal_ratios(workloads: dict[str, Any], ours: list[str]) -> dict[str, Any]:
    """The GPU targets (:data:`GOALS`) against the figures of this run.

    Args:
        workloads: {"latency", "multitenant", "shared", "kmeans"} dicts of :class:`GpuBench`.
        ours: our backend names, the first is the headline one.

    Returns:
        {goal name: {"goal", "value" (headline backend), "meets_goal", "per_backend",
        context...}}; a goal whose workload or comparator did not run has value None and
        says what is pending.
    """
    out: dict[str, Any] = {}
    head = ours[0] if ours else None
    lat = workloads.get("latency") or {}
    if lat.get("scales"):
        sc = next((x for x in lat["scales"] if x["tokens"] == 1024 * 1024), lat["scales"][-1])
        per = {b: (next((r for r in sc["results"] if r["system"] == b and r["mode"] == "rfmem"), {}) or {}).get("p50_ms") for b in ours}
        de = {b: (next((r for r in sc["results"] if r["system"] == b and r["mode"] == "dense"), {}) or {}).get("p50_ms") for b in ours}
        out["rfmem_p50_ms_at_1M_tokens"] = {
            **GOALS["rfmem_p50_ms_at_1M_tokens"], "value": per.get(head), "backend": head, "scale": sc["scale"],
            "meets_goal": _meets("rfmem_p50_ms_at_1M_tokens", per.get(head)), "per_backend": per,
            "dense_p50_ms": de, "rfmem_over_dense": {b: (per[b] / de[b]) if per.get(b) and de.get(b) else None for b in ours},
        }  # fmt: skip
    mt = workloads.get("multitenant") or {}
    bank = next((bk for bk in mt.get("banks", []) if bk.get("users") == 1000 and bk.get("items") == 4096 and bk.get("dtype") == "float32" and "results" in bk), None)
    if bank is None and mt.get("banks"):
        bank = next((bk for bk in mt["banks"] if "results" in bk), None)
    if bank is not None:
        recs = bank["results"]
        per = {b: (_best(recs, system=b, mode="rfmem") or {}).get("qps") for b in ours}
        best = _best(recs, system=head, mode="rfmem") or {}
        out["multitenant_rfmem_qps_1000x4096"] = {
            **GOALS["multitenant_rfmem_qps_1000x4096"], "value": per.get(head), "backend": head,
            "bank": f"{bank['users']} x {bank['items']} {bank['dtype']}", "batch_size": best.get("batch_size"),
            "meets_goal": _meets("multitenant_rfmem_qps_1000x4096", per.get(head)), "per_backend": per,
        }  # fmt: skip
        fa = next((r for r in recs if r.get("kind") == "faiss" and r.get("system") in ("faiss-gpu", "faiss-cpu") and r.get("qps")), None)
        if fa is not None:
            per_r = {}
            for b in ours:
                r = next((r for r in recs if r["system"] == b and r["mode"] == "dense" and r.get("batch_size") == fa["batch_size"] and r.get("qps")), None)
                per_r[b] = r["qps"] / fa["qps"] if r else None
            out["dense_qps_over_faiss_gpu"] = {
                **GOALS["dense_qps_over_faiss_gpu"], "value": per_r.get(head), "backend": head, "comparator": fa.get("label"),
                "batch_size": fa["batch_size"], "faiss_qps": fa["qps"], "meets_goal": _meets("dense_qps_over_faiss_gpu", per_r.get(head)),
                "per_backend": per_r, "where": f"multi-tenant {bank['users']} x {bank['items']}, one index per user, looped",
            }  # fmt: skip
        else:
            out["dense_qps_over_faiss_gpu"] = {**GOALS["dense_qps_over_faiss_gpu"], "value": None, "meets_goal": None,
                                               "pending": "faiss-gpu was not importable or did not run"}  # fmt: skip
    km = workloads.get("kmeans") or {}
    if km.get("problems"):
        entry = max(km["problems"], key=lambda e: e["m"])
        recs = entry["results"]
        mine = next((r for r in recs if r.get("system") == head and r.get("total_s")), None)
        cu = next((r for r in recs if r.get("kind") == "cuml" and r.get("total_s")), None)
        stand = next((r for r in recs if r.get("kind") == "per_problem" and r.get("total_s")), None)
        val = cu["total_s"] / mine["total_s"] if (cu and mine) else None
        out["batched_kmeans_over_cuml_per_problem"] = {
            **GOALS["batched_kmeans_over_cuml_per_problem"], "value": val, "backend": head, "problems": entry["m"],
            "meets_goal": _meets("batched_kmeans_over_cuml_per_problem", val),
            "over_torch_per_problem": stand["total_s"] / mine["total_s"] if (stand and mine) else None,
            **({} if cu else {"pending": "cuML was not importable or did not run"}),
        }  # fmt: skip
    return out


def plot_doc(doc: dict[str, Any]) -> dict[str, Any]:
    """The run's figures in the layout of :mod:`rfmem_fast.bench.plots` (latency, shared, multi-tenant)."""
    w = doc.get("workloads") or {}
    out_w: dict[str, Any] = {}
    lat = w.get("latency")
    if isinstance(lat, dict) and lat.get("scales"):
        out_w["latency"] = lat
    sh = w.get("shared")
    if isinstance(sh, dict) and sh.get("sizes"):
        out_w["batch"] = {"batch_sizes": sh["batch_sizes"], "sizes": sh["sizes"]}
    mt = w.get("multitenant")
    if isinstance(mt, dict):
        bank = next((b for b in mt.get("banks", []) if b.get("results")), None)
        if bank is not None:
            big = max((r.get("batch_size") or 0) for r in bank["results"])
            recs = [r for r in bank["results"] if r.get("qps") and (r.get("kind") == "faiss" or r.get("batch_size") == big)]
            if recs:
                out_w["multitenant"] = {"users": bank["users"], "items": bank["items"], "batch_size": big, "results": recs}
    return {"workloads": out_w, "machine": doc.get("machine", {}), "versions": doc.get("versions", {})}
