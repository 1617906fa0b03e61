"""Encoder precision: float32 vs bfloat16 MiniLM on PersonaBench.

Side by side in one run, for each precision (``--dtypes``, default float32,bfloat16):

1. CPU milliseconds per question of :meth:`rfmem_fast.encoders.TextEncoder.encode`
   called on micro-batches of B PersonaBench questions (``--calls``, default 1, 8, 32,
   64: what the serving micro-batcher hands the encoder at concurrency 1 .. 64), with
   passes of P length-sorted texts (``--passes``, default 8 and 16; the serving
   encoder uses 8). CPU time (``time.process_time``) of this process, torch on
   ``--threads`` threads (default 1), best of ``--reps``: less sensitive to the other
   jobs of a shared machine than wall time, which is reported too;
2. agreement with float32: cosine of each question's and chunk's embedding;
3. retrieval quality: Recall@k / NDCG@k (k = 5, 10) of dense / recollection / RF-Mem
   and the routes, :func:`rfmem_fast.evaluate.run_personabench` with the encoder at
   that precision (items and questions embedded by it; ``--no-quality`` skips it).

The JSON (``--out``, default ``bench/results/local/encoder-precision.json``) holds the
machine, its CPU features (native bfloat16 or not), versions, load and the command.

    python bench/bench_encoder_precision.py            # ~2-3 min on 2 cores
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

from rfmem_fast.bench.cli import _loadavg, versions  # noqa: E402
from rfmem_fast.bench.workloads import default_personabench_dir  # noqa: E402
from rfmem_fast.evaluate import machine_info  # noqa: E402


def cpu_ms_per_text(encoder: Any, texts: list[str], call: int, reps: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per text of encoding ``texts`` in calls of ``call`` texts, best of ``reps``."""
    best_cpu = best_wall = float("inf")
    for _ in range(reps):
        c0, w0 = time.process_time(), time.perf_counter()
        for i in range(0, len(texts), call):
            encoder.encode(texts[i:i + call])
        best_cpu = min(best_cpu, time.process_time() - c0)
        best_wall = min(best_wall, time.perf_counter() - w0)
    return 1000 * best_cpu / len(texts), 1000 * best_wall / len(texts)


def main(argv: list[str] | None = None) -> int:
    import torch

    from rfmem_fast.datasets import load_personabench
    from rfmem_fast.encoders import DTYPES, TextEncoder, native_bf16, resolve_dtype

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="PersonaBench eval_data_v1 folder (default: ../shared/...)")
    p.add_argument("--dtypes", default="float32,bfloat16", help=f"comma list of {DTYPES}")
    p.add_argument("--calls", default="1,8,32,64", help="texts per encode call (micro-batch sizes)")
    p.add_argument("--passes", default="8,16", help="texts per forward pass (TextEncoder batch_size)")
    p.add_argument("--questions", type=int, default=128, help="questions timed per cell")
    p.add_argument("--reps", type=int, default=2, help="repetitions per cell (the best is kept)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--no-quality", action="store_true", help="skip the PersonaBench retrieval quality")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "local" / "encoder-precision.json"))
    args = p.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        p.error(f"--dtypes must be a comma list of {DTYPES}")
    calls = [int(x) for x in args.calls.split(",")]
    passes = [int(x) for x in args.passes.split(",")]
    data_dir = Path(args.data) if args.data else default_personabench_dir()
    if data_dir is None:
        print("PersonaBench not found: pass --data", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    data = load_personabench(data_dir, noise=0.0)
    questions = [q.question for q in data.questions]
    chunks = [t for u in data.users for t in u.chunk_texts]
    timed = questions[:]
    random.Random(0).shuffle(timed)
    timed = timed[: args.questions]
    caps = dict(torch.cpu.get_capabilities()) if hasattr(torch.cpu, "get_capabilities") else {}
    doc: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": machine_info(), "versions": versions(),
        "cpu_bf16": {"native_bf16": native_bf16("cpu"), "auto_resolves_to": resolve_dtype("auto", "cpu"),
                     **{f: caps.get(f) for f in ("avx512_bf16", "amx_bf16", "amx_fp16", "avx512_fp16", "bf16")}},
        "load": {"loadavg_start": _loadavg()},
        "settings": {"dtypes": dtypes, "calls": calls, "passes": passes, "questions": len(timed),
                     "reps": args.reps, "threads": args.threads, "data": str(data_dir),
                     "timing": "CPU ms per question (process_time), best of reps; wall ms too"},
        "speed": [], "agreement": {}, "quality": {},
    }
    ref: dict[str, np.ndarray] = {}
    for dtype in dtypes:
        encs = {ps: TextEncoder(show_progress=False, dtype=dtype, batch_size=ps) for ps in passes}
        enc = encs[passes[0]]
        say(f"{dtype} (runs as {enc.dtype})")
        for ps, e in encs.items():
            e.encode(timed[:16])  # warm-up
            for call in calls:
                cpu, wall = cpu_ms_per_text(e, timed, call, args.reps)
                doc["speed"].append({"dtype": dtype, "runs_as": e.dtype, "call": call, "pass": ps,
                                     "cpu_ms_per_text": cpu, "wall_ms_per_text": wall})
                say(f"  call {call:3d} pass {ps:3d}: {cpu:6.2f} ms CPU / question ({wall:.2f} wall)")
        q, x = enc.encode(questions), enc.encode(chunks)
        if not ref:
            ref = {"questions": q, "chunks": x, "dtype": dtype}
        cos_q, cos_x = (q * ref["questions"]).sum(1), (x * ref["chunks"]).sum(1)
        doc["agreement"][dtype] = {
            "against": ref["dtype"],
            "questions_cos_min": float(cos_q.min()), "questions_cos_mean": float(cos_q.mean()),
            "chunks_cos_min": float(cos_x.min()), "chunks_cos_mean": float(cos_x.mean()),
        }
        if not args.no_quality:
            from rfmem_fast.evaluate import run_personabench

            say(f"  quality on PersonaBench ({dtype})")
            rep = run_personabench(data_dir, encoder=enc, latency=False, cache_dir=None, ks=[5, 10])
            doc["quality"][dtype] = {
                mode: {"routes": mr.routes,
                       **{f"{m}@{k}": mr.metrics_at[k]["Overall"][m] for k in (5, 10) for m in ("recall", "ndcg")}}
                for mode, mr in rep.modes.items()
            }
        del encs, enc
    doc["load"]["loadavg_end"] = _loadavg()
    by = {(r["dtype"], r["call"], r["pass"]): r["cpu_ms_per_text"] for r in doc["speed"]}
    if len(dtypes) > 1:
        base = dtypes[0]
        doc["cpu_ratio_vs_" + base] = {
            d: {f"call{c}_pass{ps}": by[(base, c, ps)] / by[(d, c, ps)] for c in calls for ps in passes}
            for d in dtypes[1:]
        }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")
    print("| precision | texts per call | pass | CPU ms / question | wall ms / question |")
    print("|---|---|---|---|---|")
    for r in doc["speed"]:
        print(f"| {r['runs_as']} | {r['call']} | {r['pass']} | {r['cpu_ms_per_text']:.2f} | {r['wall_ms_per_text']:.2f} |")
    print(json.dumps({"agreement": doc["agreement"], "quality": doc["quality"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
