"""Encoder backends: torch vs ONNX Runtime MiniLM on PersonaBench.

Side by side in one run, for each option (``--options``, default
``torch:float32,st:bfloat16,torch:bfloat16,onnx:float32,onnx:float32:torch,onnx:int8``; ``backend:dtype[:long_texts]`` of
:class:`rfmem_fast.encoders.TextEncoder`; ``st:<dtype>`` is the torch encoder of commit 51f1a6b,
sentence-transformers' own ``encode``: :class:`StEncode`, the speed targets' baseline):

1. speed: milliseconds per text of ``TextEncoder.encode`` called on B PersonaBench
   questions at a time (``--calls``, default 1, 8, 64), and on B = 64 chunks (longer
   texts: what ingestion encodes); the encoder's pass is 64 texts. CPU time
   (``time.process_time``) of this process, best of ``--reps``, with torch and ONNX
   Runtime on ``--threads`` threads (default 1; the ONNX session takes torch's
   thread count): less sensitive to the other jobs of a shared machine than wall
   time, which is reported too. All encoders are loaded first and the options are
   interleaved repetition by repetition in each cell, so a ratio compares timings
   taken under the same load. Texts per second = 1000 / CPU ms per text (one core);
2. agreement with the first option (the reference, torch float32): cosine of every
   question's and chunk's embedding, min and mean;
3. retrieval: :func:`rfmem_fast.evaluate.run_personabench` (noise 0.0, the paper
   config, items and questions embedded by the option): Recall@10 / NDCG@10 of dense,
   recollection and RF-Mem, and against the reference, per question, the fraction of
   identical RF-Mem routes and of identical RF-Mem top-10 lists;
4. the noise band of those retrieval figures (``--noise-seeds``, default 5): the
   reference embeddings turned by a random direction to the option's own mean cosine
   (questions and chunks apart), retrieval measured again per seed: the Recall@10
   deltas and route agreement that chance alone gives at that cosine. On PersonaBench's
   263 questions they span about +-0.5 points even at 1 - cosine = 1e-5, so a Recall@10
   delta inside that band is not a difference of the encoders.

The JSON (``--out``, default ``bench/results/local/encoder-backends.json``) holds the CPU model
and SIMD flags, versions (torch, onnxruntime, onnx, ...), the load average before and
after, and the exact command; the markdown table and the goal check (>= 2x texts / s
over torch bfloat16 at batch 1 and 64, Recall@10 within 0.2 points, routes identical
on >= 99 % of questions), the quality floor of ``rfmem_fast.encoders.QUALITY_FLOOR``
(cosine and routes; whether an option's retrieval is float32's is judged by
``bench/bench_encoder_judge.py``) per option and what ``backend="auto"`` resolves to here
are printed.

    python bench/bench_encoder_backends.py            # ~2-4 min on 2 cores
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_encoder_precision import cpu_ms_per_text  # noqa: E402  (one timing helper for both scripts)
from rfmem_fast.bench.cli import ENCODER_MODULES, _loadavg, versions  # noqa: E402
from rfmem_fast.bench.workloads import default_personabench_dir  # noqa: E402
from rfmem_fast.evaluate import machine_info  # noqa: E402

SIMD = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "fma")


def cpu_flags() -> list[str]:
    """The SIMD flags of :data:`SIMD` that /proc/cpuinfo lists (empty list elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return [x for x in SIMD if x in have]
    except OSError:
        pass
    return []


class Precomputed:
    """An encoder answering from embeddings already computed (same texts, same vectors),
    falling back to the real encoder: run_personabench then measures retrieval with
    exactly the vectors whose agreement is reported, without encoding twice."""

    def __init__(self, enc: Any, table: dict[str, np.ndarray]) -> None:
        self._enc, self._table, self.dim = enc, table, enc.dim
        self.model_name = f"bench-{enc.backend}-{enc.dtype}"

    def encode(self, texts: list[str]) -> np.ndarray:
        missing = [t for t in texts if t not in self._table]
        if missing:
            for t, v in zip(missing, self._enc.encode(missing)):
                self._table[t] = v
        return np.stack([self._table[t] for t in texts]).astype(np.float32) if texts else np.zeros((0, self.dim), np.float32)


class StEncode:
    """The torch encoder of commit 51f1a6b (the speed targets' baseline):
    sentence-transformers' own ``encode`` of a torch :class:`TextEncoder`'s model, at the
    encoder's precision and threads: its passes are ``batch_size`` texts sorted by
    characters and padded to the longest, where :class:`TextEncoder` cuts passes by
    token count (``rfmem_fast.encoders._passes``). Option ``st:<dtype>``."""

    def __init__(self, enc: Any) -> None:
        self._enc, self.dim, self.dtype, self.backend, self.onnx_file = enc, enc.dim, enc.dtype, "st", None

    def encode(self, texts: list[str]) -> np.ndarray:
        enc = self._enc
        with enc._lock, enc._precision(), enc._threads():
            out = enc._model.encode(list(texts), batch_size=64, show_progress_bar=False,
                                    convert_to_numpy=True, normalize_embeddings=True)
        out = np.ascontiguousarray(out, dtype=np.float32)
        return out / np.linalg.norm(out, axis=1, keepdims=True)


def _turned(x: np.ndarray, cos: float, rng: np.random.Generator) -> np.ndarray:
    """Each unit row of ``x`` turned by the angle arccos(``cos``) towards a random
    orthogonal direction (so its cosine to the original is ``cos``), float32."""
    n = rng.standard_normal(x.shape).astype(np.float64)
    n -= (n * x).sum(1, keepdims=True) * x
    n /= np.linalg.norm(n, axis=1, keepdims=True)
    c = min(1.0, max(-1.0, cos))
    y = x * c + n * np.sqrt(1.0 - c * c)
    return (y / np.linalg.norm(y, axis=1, keepdims=True)).astype(np.float32)


def _retrieval(run_personabench: Any, data_dir: Path, enc: Any, questions: list[str], chunks: list[str],
               q: np.ndarray, x: np.ndarray, ref: dict[str, Any]) -> dict[str, Any]:
    """PersonaBench retrieval with the embeddings ``q`` / ``x`` of ``questions`` / ``chunks``;
    the first call (no ``ref["records"]`` yet) makes its records the reference."""
    table = {**dict(zip(questions, q)), **dict(zip(chunks, x))}
    rep = run_personabench(data_dir, encoder=Precomputed(enc, table), latency=False, cache_dir=None, ks=[10])
    recs = {(r["community"], r["user"], r["q_id"]): r for r in rep.records}
    cell: dict[str, Any] = {
        mode: {"routes": mr.routes, "recall@10": mr.metrics_at[10]["Overall"]["recall"],
               "ndcg@10": mr.metrics_at[10]["Overall"]["ndcg"]}
        for mode, mr in rep.modes.items()
    }
    if "records" not in ref:
        ref["records"], ref["recall"] = recs, cell["rfmem"]["recall@10"]
    same_route = [recs[key]["route"] == r0["route"] for key, r0 in ref["records"].items()]
    same_ids = [list(recs[key]["rfmem_ids"]) == list(r0["rfmem_ids"]) for key, r0 in ref["records"].items()]
    cell["identical_routes"] = float(np.mean(same_route))
    cell["identical_rfmem_top10"] = float(np.mean(same_ids))
    cell["questions"] = len(same_route)
    return cell


def _default_long_texts() -> str:
    """``TextEncoder``'s default ``long_texts`` (read off its signature: one source)."""
    import inspect

    from rfmem_fast.encoders import TextEncoder
    return inspect.signature(TextEncoder).parameters["long_texts"].default


def _label(backend: str, dtype: str, long_texts: str) -> str:
    """An option's name: ``backend:dtype``, with ``:long_texts`` when not TextEncoder's default."""
    return f"{backend}:{dtype}" + ("" if long_texts == _default_long_texts() else f":{long_texts}")


def main(argv: list[str] | None = None) -> int:
    import torch

    from rfmem_fast.datasets import load_personabench
    from rfmem_fast.encoders import QUALITY_FLOOR, TextEncoder, check_backend, int8_dot, resolve_backend
    from rfmem_fast.evaluate import run_personabench

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="PersonaBench eval_data_v1 folder (default: ../shared/...)")
    p.add_argument("--options", default="torch:float32,st:bfloat16,torch:bfloat16,onnx:float32,onnx:float32:torch,onnx:int8",
                   help="comma list of backend:dtype[:long_texts] (backend 'st': sentence-transformers' own encode, "
                        "the encoder of commit 51f1a6b; long_texts: TextEncoder's, its default when omitted); the first is "
                        "the reference")
    p.add_argument("--calls", default="1,8,64", help="texts per encode call")
    p.add_argument("--questions", type=int, default=128, help="questions timed per cell")
    p.add_argument("--reps", type=int, default=3, help="repetitions per cell (the best is kept)")
    p.add_argument("--threads", type=int, default=1, help="torch / ONNX Runtime threads (default 1)")
    p.add_argument("--no-quality", action="store_true", help="skip the PersonaBench retrieval")
    p.add_argument("--noise-seeds", type=int, default=5, help="random perturbations per option for the noise band (0: none)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "local" / "encoder-backends.json"))
    args = p.parse_args(argv)
    options = []
    for item in args.options.split(","):
        backend, _, rest = item.strip().partition(":")
        dtype, _, long_texts = rest.partition(":")
        if backend == "st":  # StEncode: the torch encoder of commit 51f1a6b
            options.append((backend, dtype or "float32", _default_long_texts()))
            continue
        if long_texts not in ("", "auto", "onnx", "torch"):
            p.error(f"--options {item!r}: the third field (long_texts) must be auto, onnx or torch")
        try:
            check_backend(backend, dtype or "float32", "--options backend", "--options dtype")
        except (TypeError, ValueError) as e:
            p.error(str(e))
        options.append((backend, dtype or "float32", long_texts or _default_long_texts()))
    calls = [int(x) for x in args.calls.split(",")]
    data_dir = Path(args.data) if args.data else default_personabench_dir()
    if data_dir is None:
        print("PersonaBench not found: pass --data", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    data = load_personabench(data_dir, noise=0.0)
    questions = [q.question for q in data.questions]
    chunks = [t for u in data.users for t in u.chunk_texts]
    rng = random.Random(0)
    timed = rng.sample(questions, min(args.questions, len(questions)))
    timed_chunks = rng.sample(chunks, min(128, len(chunks)))
    vers = versions(ENCODER_MODULES)
    doc: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": {**machine_info(), "simd": cpu_flags()}, "versions": vers,
        "load": {"loadavg_start": _loadavg()},
        "settings": {"options": [_label(*o) for o in options], "calls": calls, "questions": len(timed),
                     "chunks_timed": len(timed_chunks), "pass": 64, "reps": args.reps, "threads": args.threads,
                     "data": str(data_dir), "noise": 0.0,
                     "timing": "CPU ms per text (process_time), best of reps; wall ms too"},
        "speed": [], "agreement": {}, "quality": {},
    }
    doc["auto"] = {"auto:auto": ":".join(resolve_backend("auto", "auto")), "quality_floor": QUALITY_FLOOR,
                   "int8_dot": int8_dot()}
    encoders: dict[str, Any] = {}
    for backend, dtype, long_texts in options:
        label = _label(backend, dtype, long_texts)
        t0 = time.perf_counter()
        enc = TextEncoder(show_progress=False, dtype=dtype, backend="torch" if backend == "st" else backend,
                          batch_size=64, long_texts=long_texts)
        if backend == "st":
            enc = StEncode(enc)
        load_s = time.perf_counter() - t0
        say(f"{label} (runs as {enc.backend}:{enc.dtype}, long texts in {getattr(enc, 'long_texts', '-')}; "
            f"loaded in {load_s:.1f} s)")
        enc.encode(timed[:16])  # warm-up
        encoders[label] = (enc, load_s)
    for what, texts, cs in (("questions", timed, calls), ("chunks", timed_chunks, [64])):
        for call in cs:
            best = {label: [float("inf"), float("inf")] for label in encoders}
            for _ in range(args.reps):  # interleaved: every option once per repetition
                for label, (enc, _) in encoders.items():
                    cpu, wall = cpu_ms_per_text(enc, texts, call, 1)
                    best[label] = [min(best[label][0], cpu), min(best[label][1], wall)]
            for label, (cpu, wall) in best.items():
                doc["speed"].append({"option": label, "texts": what, "call": call, "cpu_ms_per_text": cpu,
                                     "wall_ms_per_text": wall, "texts_per_s_cpu": 1000 / cpu})
                say(f"  {label:15s} {what:9s} call {call:3d}: {cpu:6.2f} ms CPU / text ({wall:.2f} wall)")
    ref: dict[str, Any] = {}
    rng_noise = np.random.default_rng(0)
    for label, (enc, load_s) in encoders.items():
        q, x = enc.encode(questions), enc.encode(chunks)
        if not ref:
            ref = {"questions": q, "chunks": x, "option": label}
        cos_q, cos_x = (q * ref["questions"]).sum(1), (x * ref["chunks"]).sum(1)
        doc["agreement"][label] = {
            "against": ref["option"], "load_s": load_s, "onnx_file": enc.onnx_file,
            "questions_cos_min": float(cos_q.min()), "questions_cos_mean": float(cos_q.mean()),
            "chunks_cos_min": float(cos_x.min()), "chunks_cos_mean": float(cos_x.mean()),
        }
        if not args.no_quality:
            say(f"  quality on PersonaBench ({label})")
            cell = _retrieval(run_personabench, data_dir, enc, questions, chunks, q, x, ref)
            if label != ref["option"] and args.noise_seeds > 0:
                band = []
                for _ in range(args.noise_seeds):
                    nq = _turned(ref["questions"], float(cos_q.mean()), rng_noise)
                    nx = _turned(ref["chunks"], float(cos_x.mean()), rng_noise)
                    c = _retrieval(run_personabench, data_dir, enc, questions, chunks, nq, nx, ref)
                    band.append({"rfmem_recall10_delta_points": 100 * (c["rfmem"]["recall@10"] - ref["recall"]),
                                 "identical_routes": c["identical_routes"]})
                cell["noise_band"] = {
                    "seeds": args.noise_seeds, "cos_mean_questions": float(cos_q.mean()),
                    "cos_mean_chunks": float(cos_x.mean()),
                    "rfmem_recall10_delta_points_min": min(b["rfmem_recall10_delta_points"] for b in band),
                    "rfmem_recall10_delta_points_max": max(b["rfmem_recall10_delta_points"] for b in band),
                    "identical_routes_min": min(b["identical_routes"] for b in band), "runs": band}
            cos_min = min(float(cos_q.min()), float(cos_x.min()))
            # the floor's cosine and routes; the retrieval is the encoder judge's (bench_encoder_judge.py)
            cell["meets_quality_floor"] = bool(cos_min >= QUALITY_FLOOR["cosine_min"]
                                               and cell["identical_routes"] >= QUALITY_FLOOR["identical_routes"])
            doc["quality"][label] = cell
            say(f"  RF-Mem Recall@10 {cell['rfmem']['recall@10']:.4f}; routes identical {cell['identical_routes']:.4f}"
                + (f"; noise band {cell['noise_band']['rfmem_recall10_delta_points_min']:+.2f}.."
                   f"{cell['noise_band']['rfmem_recall10_delta_points_max']:+.2f} points" if "noise_band" in cell else ""))
    del encoders
    doc["load"]["loadavg_end"] = _loadavg()

    by = {(r["option"], r["texts"], r["call"]): r["cpu_ms_per_text"] for r in doc["speed"]}
    # the speed targets' baseline, commit 51f1a6b's bfloat16 torch encoder: sentence-transformers' encode (st:) where
    # it is among the options, else the torch encoder
    base = "st:bfloat16" if "st:bfloat16" in doc["settings"]["options"] else "torch:bfloat16"
    doc["goals_base"] = base
    goals: dict[str, Any] = {}
    if any(o == base for o in doc["settings"]["options"]):
        ref_label = doc["settings"]["options"][0]
        for label in doc["settings"]["options"]:
            if label == base:
                continue
            sp = {f"questions_call{c}": by[(base, "questions", c)] / by[(label, "questions", c)] for c in calls}
            sp["chunks_call64"] = by[(base, "chunks", 64)] / by[(label, "chunks", 64)]
            g: dict[str, Any] = {"speedup_vs_base": sp}
            if doc["quality"]:
                dr = 100 * (doc["quality"][label]["rfmem"]["recall@10"] - doc["quality"][ref_label]["rfmem"]["recall@10"])
                g["rfmem_recall10_delta_points"] = dr
                g["met"] = bool(sp.get("questions_call1", 0) >= 2 and sp.get("questions_call64", 0) >= 2
                                and abs(dr) <= 0.2 and doc["quality"][label]["identical_routes"] >= 0.99)
            goals[label] = g
    doc["goals"] = goals
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")
    head = " | ".join(f"b{c} ms (texts/s)" for c in calls)
    print(f"| option | {head} | chunks b64 ms | cos min q / chunks | cos mean | RF-Mem R@10 | routes = | top-10 = "
          "| R@10 noise band | floor |")
    print("|---" * (len(calls) + 9) + "|")
    for label in doc["settings"]["options"]:
        cells = " | ".join(f"{by[(label, 'questions', c)]:.2f} ({1000 / by[(label, 'questions', c)]:.0f})" for c in calls)
        a = doc["agreement"][label]
        qd = doc["quality"].get(label)
        nb = qd.get("noise_band") if qd else None
        band = (f"{nb['rfmem_recall10_delta_points_min']:+.2f}..{nb['rfmem_recall10_delta_points_max']:+.2f}"
                if nb else "-")
        qs = (f"{qd['rfmem']['recall@10']:.4f} | {qd['identical_routes']:.4f} | {qd['identical_rfmem_top10']:.4f}"
              f" | {band} | {'yes' if qd['meets_quality_floor'] else 'no'}" if qd else "- | - | - | - | -")
        print(f"| {label} | {cells} | {by[(label, 'chunks', 64)]:.2f} | {a['questions_cos_min']:.5f} / "
              f"{a['chunks_cos_min']:.5f} | {min(a['questions_cos_mean'], a['chunks_cos_mean']):.6f} | {qs} |")
    print(json.dumps({"load": doc["load"], "auto": doc["auto"], "goals": goals}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
