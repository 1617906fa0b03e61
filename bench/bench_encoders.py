"""Encoding cost of the offline encoders (MiniLM, MPNet) at the package's default runtime.

For each encoder (``--encoders``, default ``minilm,mpnet``: aliases of
:func:`rfmem_fast.models.resolve_model`, or local sentence-transformers folders) and
each runtime (``--runtimes``, ``backend:dtype`` of :class:`rfmem_fast.encoders.TextEncoder`;
default ``auto:auto``, what ``rfmem serve`` / the HTTP app / ``rfmem mcp`` run, resolved
by :func:`rfmem_fast.encoders.resolve_backend`; add ``torch:float32`` for the default of
the Python ``Memory()``), milliseconds per text of ``TextEncoder.encode`` in three cells:

* ``q1``: PersonaBench questions, one text per call (``--questions`` calls per rep): a
  query encoded alone;
* ``q64``: 64 PersonaBench questions in one call: a full micro-batch of search requests
  (``rfmem serve --max-batch 64``);
* ``c64``: 64 PersonaBench chunks (whole sessions, cut at the model's window) in one
  call: ingestion;

each with 1 thread and with all usable cores (``--threads``, default ``1,all``). The
encoder is built as ``Memory`` builds its default one (``batch_size`` =
:data:`rfmem_fast.serving.encoding.ENCODE_BATCH_SIZE` texts per forward pass,
``long_texts`` at its default), one instance per thread count (an ONNX session's threads
are fixed when it is made). Wall time (``time.perf_counter``) and the process's CPU time
per rep; best and median of ``--reps``; the encoders' cells interleaved rep by rep (their
order alternating from one rep to the next), so a change of the machine's load hits them
alike. Texts/s = 1000 / (wall ms per text).

Before timing, the script waits (``--max-wait``, default 600 s, checking every 60 s)
until the 1-minute load average is at most ``--quiet-load`` (default 1.5); it times
anyway when the wait runs out, and records what it saw.

The JSON (``--out``, default ``bench/results/local/encoders-<time>.json``) holds the CPU
model (``lscpu``), SIMD flags, versions (torch, onnxruntime, onnx, sentence-transformers,
transformers), load average before / after, the exact command, each encoder's model,
parameters, dimension, window and resolved runtime, every rep's figure, the best /
median per cell and the derived texts/s. A table is printed.

    python bench/bench_encoders.py                          # ~3-5 min on 2 cores
    python bench/bench_encoders.py --runtimes auto:auto,torch:float32 --reps 3
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_encoder_backends import cpu_flags  # noqa: E402  (one SIMD flag reader for the encoder scripts)
from rfmem_fast.bench.cli import ENCODER_MODULES, _loadavg, versions  # noqa: E402
from rfmem_fast.bench.workloads import default_personabench_dir  # noqa: E402
from rfmem_fast.evaluate import machine_info  # noqa: E402

#: the timed cells: name -> (texts, texts per call)
CELLS = {"q1": ("questions", 1), "q64": ("questions", 64), "c64": ("chunks", 64)}


def lscpu() -> dict[str, str]:
    """``lscpu``'s "key: value" lines (model name, cores, caches, ...); {} where it is absent."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    info = {}
    for line in out.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() != "Flags":
            info[key.strip()] = value.strip()
    return info


def wait_for_quiet(threshold: float, max_wait: float, step: float = 60.0) -> dict[str, Any]:
    """Sleep in ``step`` s steps until the 1-minute load average is <= ``threshold``,
    at most ``max_wait`` s. Returns what was seen: ``{"loadavg_seen": [...], "waited_s",
    "quiet"}`` (``quiet`` False when the wait ran out or the load cannot be read)."""
    seen, t0 = [], time.perf_counter()
    while True:
        load = _loadavg()
        seen.append(load)
        if load is None:
            return {"loadavg_seen": seen, "waited_s": 0.0, "quiet": False}
        if load[0] <= threshold:
            return {"loadavg_seen": seen, "waited_s": round(time.perf_counter() - t0, 1), "quiet": True}
        if time.perf_counter() - t0 + step > max_wait:
            return {"loadavg_seen": seen, "waited_s": round(time.perf_counter() - t0, 1), "quiet": False}
        print(f"load {load[0]:.2f} > {threshold}: waiting {step:.0f} s", file=sys.stderr, flush=True)
        time.sleep(step)


def param_count(folder: str) -> int | None:
    """Parameters of a sentence-transformers folder, from its ``model.safetensors`` header
    (tensor shapes only: the weights are not read); None without that file."""
    path = Path(folder) / "model.safetensors"
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    total = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        size = 1
        for s in meta["shape"]:
            size *= s
        total += size
    return total


def time_cell(enc: Any, texts: list[str], call: int) -> tuple[float, float]:
    """(wall ms, CPU ms) per text of encoding ``texts`` in calls of ``call`` texts, once."""
    c0, w0 = time.process_time(), time.perf_counter()
    for i in range(0, len(texts), call):
        enc.encode(texts[i:i + call])
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    return 1000 * wall / len(texts), 1000 * cpu / len(texts)


def main(argv: list[str] | None = None) -> int:
    from rfmem_fast.datasets import load_personabench
    from rfmem_fast.encoders import TextEncoder, check_backend
    from rfmem_fast.models import resolve_model
    from rfmem_fast.serving.encoding import ENCODE_BATCH_SIZE, usable_cores

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="PersonaBench eval_data_v1 folder (default: ../shared/...)")
    p.add_argument("--encoders", default="minilm,mpnet", help="comma list of aliases or local model folders")
    p.add_argument("--runtimes", default="auto:auto",
                   help="comma list of backend:dtype (auto:auto = rfmem serve's default; torch:float32 = Memory()'s)")
    p.add_argument("--threads", default="1,all", help="comma list of thread counts ('all' = the usable cores)")
    p.add_argument("--cells", default="q1,q64,c64", help=f"comma list of {list(CELLS)}")
    p.add_argument("--questions", type=int, default=32, help="questions of the q1 cell (one call each)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every cell (best and median kept)")
    p.add_argument("--quiet-load", type=float, default=1.5, help="wait until the 1-minute load is at most this")
    p.add_argument("--max-wait", type=float, default=600.0, help="longest wait for a quiet moment (s; 0: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled questions and chunks")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/local/encoders-<time>.json)")
    args = p.parse_args(argv)

    encoders = [e.strip() for e in args.encoders.split(",") if e.strip()]
    runtimes = []
    for item in args.runtimes.split(","):
        backend, _, dtype = item.strip().partition(":")
        try:
            check_backend(backend, dtype or "auto", "--runtimes backend", "--runtimes dtype")
        except (TypeError, ValueError) as e:
            p.error(str(e))
        runtimes.append((backend, dtype or "auto"))
    cores = usable_cores()
    try:
        threads = sorted({cores if t.strip() == "all" else int(t) for t in args.threads.split(",") if t.strip()})
    except ValueError:
        p.error(f"--threads must be a comma list of ints >= 1 or 'all', got {args.threads!r}")
    if not threads or min(threads) < 1:
        p.error(f"--threads must be a comma list of ints >= 1 or 'all', got {args.threads!r}")
    cells = [c.strip() for c in args.cells.split(",") if c.strip()]
    if not cells or any(c not in CELLS for c in cells):
        p.error(f"--cells must be a comma list of {list(CELLS)}, got {args.cells!r}")
    if args.reps < 1 or args.questions < 1:
        p.error("--reps and --questions must be >= 1")
    data_dir = Path(args.data) if args.data else default_personabench_dir()
    if data_dir is None:
        print("PersonaBench not found: pass --data", file=sys.stderr)
        return 2
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731

    data = load_personabench(data_dir, noise=0.0)
    questions = [q.question for q in data.questions]
    chunks = [t for u in data.users for t in u.chunk_texts]
    rng = random.Random(args.seed)
    texts = {
        "q1": rng.sample(questions, min(args.questions, len(questions))),
        "q64": rng.sample(questions, min(64, len(questions))),
        "c64": rng.sample(chunks, min(64, len(chunks))),
    }

    vers = versions(ENCODER_MODULES)
    cpu = lscpu()
    doc: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": {**machine_info(), "cpu_model": cpu.get("Model name"), "lscpu": cpu, "simd": cpu_flags(),
                    "usable_cores": cores},
        "versions": vers,
        "load": {},
        "settings": {"encoders": encoders, "runtimes": [f"{b}:{d}" for b, d in runtimes], "threads": threads,
                     "cells": {c: {"texts": CELLS[c][0], "per_call": CELLS[c][1], "n": len(texts[c])} for c in cells},
                     "reps": args.reps, "pass": ENCODE_BATCH_SIZE, "seed": args.seed, "data": str(data_dir),
                     "timing": "wall ms per text (perf_counter) and process CPU ms per text, per rep; best and "
                               "median of the reps; encoders interleaved rep by rep, their order alternating"},
        "encoders": {}, "cells": [],
    }

    built: dict[str, Any] = {}  # label -> encoder; label = "name|backend:dtype|threads"
    for name in encoders:
        folder = resolve_model(name)
        for backend, dtype in runtimes:
            for t in threads:
                label = f"{name}|{backend}:{dtype}|{t}"
                t0 = time.perf_counter()
                enc = TextEncoder(folder, batch_size=ENCODE_BATCH_SIZE, show_progress=False, dtype=dtype,
                                  backend=backend, num_threads=t)
                load_s = time.perf_counter() - t0
                for c in cells:  # warm-up: one forward pass of every kind of text
                    enc.encode(texts[c][:min(CELLS[c][1], ENCODE_BATCH_SIZE)])
                built[label] = enc
                say(f"{label}: {enc!r} (loaded in {load_s:.1f} s)")
                doc["encoders"].setdefault(name, {
                    "model_path": folder, "parameters": param_count(folder), "dim": enc.dim,
                    "max_tokens": enc.max_tokens, "runs": {}})
                doc["encoders"][name]["runs"][f"{backend}:{dtype}|{t}"] = {
                    "backend": enc.backend, "dtype": enc.dtype, "long_texts": enc.long_texts,
                    "num_threads": enc.num_threads, "load_s": round(load_s, 2)}
        tok = built[next(k for k in built if k.startswith(name + "|"))]
        doc["encoders"][name]["mean_tokens"] = {
            c: round(statistics.fmean(min(n, tok.max_tokens) for n in tok.count_tokens(texts[c])), 1) for c in cells}

    doc["load"]["before"] = wait_for_quiet(args.quiet_load, args.max_wait)
    doc["load"]["uptime_before"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    say(f"load before: {doc['load']['before']}")
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    labels = list(built)
    t_start = time.perf_counter()
    for rep in range(args.reps):
        for c in cells:
            for t in threads:
                order = [lab for lab in labels if lab.endswith(f"|{t}")]
                if rep % 2:
                    order.reverse()
                for lab in order:
                    runs.setdefault((lab, c), []).append(time_cell(built[lab], texts[c], CELLS[c][1]))
        say(f"rep {rep + 1}/{args.reps} done ({time.perf_counter() - t_start:.0f} s)")
    doc["load"]["after"] = _loadavg()
    doc["load"]["uptime_after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    doc["timed_s"] = round(time.perf_counter() - t_start, 1)

    for (lab, c), reps in runs.items():
        name, runtime, t = lab.split("|")
        wall = [w for w, _ in reps]
        cpu_ms = [x for _, x in reps]
        best, med = min(wall), statistics.median(wall)
        doc["cells"].append({
            "encoder": name, "runtime": runtime, "threads": int(t), "cell": c, "texts": CELLS[c][0],
            "per_call": CELLS[c][1], "wall_ms_per_text": [round(w, 3) for w in wall],
            "cpu_ms_per_text": [round(x, 3) for x in cpu_ms], "best_ms": round(best, 3), "median_ms": round(med, 3),
            "texts_per_s_best": round(1000 / best, 1), "texts_per_s_median": round(1000 / med, 1)})
    # the ceiling of search requests / s each encoder allows (one query text per request,
    # up to 64 in one encode call): the q64 cell on all cores
    doc["serving_ceiling"] = {
        f"{x['encoder']}|{x['runtime']}": {"req_per_s_median": x["texts_per_s_median"], "req_per_s_best": x["texts_per_s_best"],
                                           "from": f"q64 cell, {x['threads']} threads"}
        for x in doc["cells"] if x["cell"] == "q64" and x["threads"] == max(threads)}

    out = Path(args.out) if args.out else ROOT / "bench" / "results" / "local" / f"encoders-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")

    print(f"{doc['machine']['cpu_model']}, {cores} usable cores; load {doc['load']['before']['loadavg_seen'][-1]} "
          f"-> {doc['load']['after']}; wall ms per text, median (best) of {args.reps}")
    head = "| encoder | runtime | cell | " + " | ".join(f"{t} thread{'s' if t > 1 else ''}" for t in threads) + " |"
    print(head + "\n" + "|---" * (3 + len(threads)) + "|")
    by = {(x["encoder"], x["runtime"], x["cell"], x["threads"]): x for x in doc["cells"]}
    for name in encoders:
        for backend, dtype in runtimes:
            rt = f"{backend}:{dtype}"
            run = doc["encoders"][name]["runs"][f"{rt}|{threads[0]}"]
            for c in cells:
                vals = [by[(name, rt, c, t)] for t in threads]
                print(f"| {name} | {rt} -> {run['backend']}:{run['dtype']} | {c} | "
                      + " | ".join(f"{v['median_ms']:.2f} ({v['best_ms']:.2f})" for v in vals) + " |")
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
