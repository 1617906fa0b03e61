"""Ingestion throughput: bulk writes vs one item per call, through the facade and over HTTP.

Items are PersonaBench memory chunks (the loader of ``rfmem_fast.datasets.personabench``:
the 527 chunks of the 6 users, ~1,700 characters each, so most are over MiniLM's
256-token window and chunked), repeated to reach the count, spread round-robin over
``--users`` users, each with its own id. Two variants:

* ``text``: the server embeds every text (the encoder's time is reported apart: the
  Memory's ``encode_seconds`` for the facade, ``rfmem_encoder_seconds_total`` from
  ``/metrics`` for HTTP);
* ``vectors``: each item carries its MiniLM vector (from the ``rfmem bench`` embedding
  cache, computed once if absent), so the encoder is out of it and what is measured is
  the write path: validation, the fsynced write-ahead log, the bank, checkpoints.

For each variant and path, one cell per mode: ``single`` (one ``Memory.add`` per item /
one ``POST /v1/users/{u}/memories`` per item) and ``batch-B`` (``Memory.add_many`` /
``POST /v1/memories:batch`` with B items per call, for each B of ``--batches``), all at
``--n-single`` items (the speed-ups compare these: the same items, the same number of
checkpoints), plus each ``batch-B`` at ``--n`` items (sustained bulk ingestion). Every
cell starts from an empty durable Memory directory (fsync on, checkpoints every 64 MiB
of log, as ``rfmem serve``); the HTTP cells run the real server (``python -m
rfmem_fast.cli serve``, uvicorn, no auth, ``--max-body-bytes 64 MiB`` so that 1000
items with vectors fit one request) driven by one sequential httpx client with
keep-alive (bodies serialised by orjson while the clock runs; the client's CPU is
reported). A cell checks at its end that the memory holds exactly its items.

Reported per cell: items, wall seconds, items/s, encoder seconds and share, log records
written, server / client CPU seconds; and per variant and path the speed-up of each
batch size over ``single``. The JSON (``--out``, default
``bench/results/local/ingest-<time>.json``) holds the machine (CPU model, SIMD flags), versions,
the exact command and the load (load average before / after, cores busy with other
processes).

    python bench/bench_ingest.py                                  # 10^5 items per cell: long
    python bench/bench_ingest.py --n 20000 --n-single 2000 --text-n 1000 --text-n-single 200
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_encoder_backends import cpu_flags  # noqa: E402
from bench_serving import free_port, proc_cpu, wait_for_health  # noqa: E402

from rfmem_fast.bench.cli import _cpu_seconds, _loadavg, _other_cores, versions  # noqa: E402
from rfmem_fast.bench.workloads import default_cache_dir, default_personabench_dir, personabench_embeddings  # noqa: E402
from rfmem_fast.evaluate import machine_info  # noqa: E402

MAX_BODY = 64 << 20


def personabench_items(data_dir: Path, n: int, users: int, vectors: bool, say: Any) -> list[dict[str, Any]]:
    """``n`` items: PersonaBench chunk texts (and MiniLM vectors) in file order, repeated,
    item i of user ``user{i % users}`` with id ``item{i}``."""
    from rfmem_fast.datasets import load_personabench

    data = load_personabench(data_dir, noise=0.0)
    texts = [t for u in data.users for t in u.chunk_texts]
    vecs = None
    if vectors:
        pb = personabench_embeddings(data_dir, cache_dir=default_cache_dir(), say=say)
        snap = pb.bank.snapshot()
        assert list(snap.item_ids) == [i for u in data.users for i in u.chunk_ids]
        vecs = np.ascontiguousarray(snap.vectors, dtype=np.float32)
    out = []
    for i in range(n):
        j = i % len(texts)
        it: dict[str, Any] = {"user_id": f"user{i % users}", "id": f"item{i}", "text": texts[j]}
        if vecs is not None:
            it["vector"] = vecs[j]
        out.append(it)
    return out


def chunks(items: list, size: int):
    for a in range(0, len(items), size):
        yield items[a:a + size]


# ---------------------------------------------------------------------- the facade
def facade_cell(items: list[dict], mode: str, batch: int, path: Path, enc: dict[str, str], variant: str) -> dict:
    """Ingest ``items`` into a fresh durable Memory (opened as ``rfmem serve`` opens it)."""
    from rfmem_fast.serving.cli import open_memory

    mem = open_memory(str(path), encoder=enc["encoder"] if variant == "text" else "none",
                      dim=None if variant == "text" else int(items[0]["vector"].shape[0]),
                      encoder_dtype=enc["dtype"], encoder_backend=enc["backend"], batching=False)
    try:
        s0, c0 = mem.stats(), time.process_time()
        t0 = time.perf_counter()
        if mode == "single":
            for it in items:
                v = it.get("vector")
                mem.add([it["text"]], it["user_id"], ids=[it["id"]], vectors=None if v is None else v[None])
        else:
            for part in chunks(items, batch):
                mem.add_many(part)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        s1 = mem.stats()
        assert mem.counts() == (len({it["user_id"] for it in items}), len(items)), mem.counts()
        info = mem.encoder_info()
    finally:
        t1 = time.perf_counter()
        mem.close()
        close_s = time.perf_counter() - t1
    return {"wall_s": wall, "encoder_s": s1["encode_seconds"] - s0["encode_seconds"],
            "encoded_texts": s1["encoded"] - s0["encoded"], "writes": s1["writes"] - s0["writes"],
            "checkpoints": s1["checkpoints"] - s0["checkpoints"], "process_cpu_s": cpu, "close_s": close_s,
            "encoder": info}


# ---------------------------------------------------------------------- HTTP
class Server:
    """``rfmem serve`` on a fresh directory, in a subprocess, ready once /health answers."""

    def __init__(self, path: Path, enc: dict[str, str], variant: str, dim: int) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "rfmem_fast.cli", "serve", "--path", str(path), "--port", str(self.port),
               "--no-auth", "--log-level", "warning", "--max-body-bytes", str(MAX_BODY), "--cache-size", "0"]
        if variant == "text":
            cmd += ["--encoder", enc["encoder"], "--encoder-dtype", enc["dtype"], "--encoder-backend", enc["backend"]]
        else:
            cmd += ["--encoder", "none", "--dim", str(dim)]
        self.cmd = cmd
        env = {k: v for k, v in os.environ.items() if k != "RFMEM_API_KEY"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        self.health: dict[str, Any] = {}

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Wait for /health (kept in ``self.health``)."""
        self.health = wait_for_health(self.proc, self.base, timeout)

    def counter(self, client: Any, name: str) -> float:
        for line in client.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def http_cell(items: list[dict], mode: str, batch: int, path: Path, enc: dict[str, str], variant: str) -> dict:
    """Ingest ``items`` through a fresh ``rfmem serve`` with one sequential httpx client."""
    import httpx
    import orjson

    dim = int(items[0]["vector"].shape[0]) if variant == "vectors" else 0
    srv = Server(path, enc, variant, dim)
    headers = {"content-type": "application/json"}
    opt = orjson.OPT_SERIALIZE_NUMPY  # float32 vectors as their shortest float32 decimal
    try:
        srv.wait_ready()
        with httpx.Client(base_url=srv.base, timeout=600.0) as c:
            e0, w0 = srv.counter(c, "rfmem_encoder_seconds_total"), srv.counter(c, "rfmem_writes_total")
            p0, c0 = proc_cpu(srv.proc.pid), time.process_time()
            t0 = time.perf_counter()
            if mode == "single":
                for it in items:
                    body = {"texts": [it["text"]], "ids": [it["id"]]}
                    if "vector" in it:
                        body["vectors"] = [it["vector"]]
                    r = c.post(f"/v1/users/{it['user_id']}/memories", content=orjson.dumps(body, option=opt),
                               headers=headers)
                    if r.status_code != 201:
                        raise RuntimeError(f"add: {r.status_code} {r.text[:300]}")
            else:
                for part in chunks(items, batch):
                    r = c.post("/v1/memories:batch", content=orjson.dumps({"items": part}, option=opt), headers=headers)
                    if r.status_code != 201:
                        raise RuntimeError(f"batch: {r.status_code} {r.text[:300]}")
            wall = time.perf_counter() - t0
            server_cpu, client_cpu = proc_cpu(srv.proc.pid) - p0, time.process_time() - c0
            enc_s = srv.counter(c, "rfmem_encoder_seconds_total") - e0
            writes = srv.counter(c, "rfmem_writes_total") - w0
            health = c.get("/health").json()
        assert health["items"] == len(items), health
    finally:
        srv.stop()
    return {"wall_s": wall, "encoder_s": enc_s, "writes": writes, "server_cpu_s": server_cpu,
            "client_cpu_s": client_cpu, "encoder": srv.health.get("encoder"), "server_command": srv.cmd}


# ---------------------------------------------------------------------- driver
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="PersonaBench eval_data_v1 folder (default: ../shared/...)")
    p.add_argument("--n", type=int, default=100_000, help="items per batch cell, vectors variant (default 10^5)")
    p.add_argument("--n-single", type=int, default=None, help="items per one-by-one cell, vectors variant (default --n)")
    p.add_argument("--text-n", type=int, default=None, help="items per batch cell, text variant (default --n)")
    p.add_argument("--text-n-single", type=int, default=None,
                   help="items per one-by-one cell, text variant (default --n-single)")
    p.add_argument("--batches", default="256,1000", help="comma list of items per bulk call (default 256,1000)")
    p.add_argument("--users", type=int, default=100, help="users the items are spread over (default 100)")
    p.add_argument("--variants", default="vectors,text", help="comma list of vectors, text")
    p.add_argument("--paths", default="facade,http", help="comma list of facade, http")
    p.add_argument("--encoder", default="default", help="the server's --encoder for the text variant")
    p.add_argument("--encoder-dtype", default="auto", help="the server's --encoder-dtype (default auto)")
    p.add_argument("--encoder-backend", default="auto", help="the server's --encoder-backend (default auto)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/local/ingest-<time>.json)")
    args = p.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",") if x.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    paths = [v.strip() for v in args.paths.split(",") if v.strip()]
    if not batches or min(batches) < 1 or set(variants) - {"vectors", "text"} or set(paths) - {"facade", "http"}:
        p.error("--batches: ints >= 1; --variants: vectors, text; --paths: facade, http")
    n_single = args.n_single or args.n
    sizes = {"vectors": (args.n, n_single), "text": (args.text_n or args.n, args.text_n_single or n_single)}
    data = Path(args.data) if args.data else default_personabench_dir()
    if data is None:
        print("PersonaBench not found: pass --data", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / "local" / f"ingest-{time.strftime('%Y%m%d-%H%M%S')}.json"
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    enc = {"encoder": args.encoder, "dtype": args.encoder_dtype, "backend": args.encoder_backend}
    doc: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": {**machine_info(), "simd": cpu_flags()}, "versions": versions(),
        "load": {"loadavg_start": _loadavg()},
        "settings": {"sizes": {k: {"batch_cells": a, "single_cells": b} for k, (a, b) in sizes.items()},
                     "batches": batches, "users": args.users, "variants": variants, "paths": paths, "data": str(data),
                     "encoder": enc, "items": "PersonaBench chunk texts (noise 0.0, 527 chunks, ~1,700 characters), "
                     "repeated; vectors: their MiniLM embeddings", "durability": "fsync per write, checkpoint every "
                     "64 MiB of log (Memory defaults)", "http": f"rfmem serve --no-auth --max-body-bytes {MAX_BODY} "
                     "--cache-size 0, one sequential httpx client (keep-alive), orjson bodies"},
        "cells": [],
    }
    try:
        import importlib.metadata as md

        for dist in ("fastapi", "uvicorn", "httpx", "pydantic", "orjson", "onnxruntime"):
            try:
                doc["versions"][dist] = md.version(dist)
            except md.PackageNotFoundError:
                doc["versions"][dist] = None
    except ImportError:  # pragma: no cover
        pass
    tmp = Path(tempfile.mkdtemp(prefix="rfmem-ingest-bench-"))
    cpu0 = _cpu_seconds()
    try:
        for variant in variants:
            n_batch, n_one = sizes[variant]
            items = personabench_items(data, max(n_batch, n_one), args.users, variant == "vectors", say)
            for path in paths:
                cell_fn = facade_cell if path == "facade" else http_cell
                plan = [("single", 1, n_one)] + [("batch", b, n_one) for b in batches]  # like for like
                plan += [("batch", b, n_batch) for b in batches if n_batch != n_one]  # sustained, at --n
                for mode, batch, n in plan:
                    name = f"{variant}/{path}/{'single' if mode == 'single' else f'batch-{batch}'}/{n}"
                    say(f"{name}: {n} items ...")
                    d = tmp / name.replace("/", "-")
                    a = _cpu_seconds()
                    res = cell_fn(items[:n], mode, batch, d, enc, variant)
                    b = _cpu_seconds()
                    shutil.rmtree(d, ignore_errors=True)
                    res.update(variant=variant, path=path, mode=mode, batch=batch, items=n,
                               items_per_s=n / res["wall_s"], encoder_share=res["encoder_s"] / res["wall_s"],
                               other_cores_busy=_other_cores(a, b), loadavg=_loadavg())
                    doc["cells"].append(res)
                    say(f"  {res['items_per_s']:.0f} items/s ({res['wall_s']:.1f} s, encoder {res['encoder_s']:.1f} s, "
                        f"{res['writes']:.0f} log records)")
        speedups = {}  # each batch size over one-by-one, at the same number of items
        for c in doc["cells"]:
            one = next((x for x in doc["cells"] if x["variant"] == c["variant"] and x["path"] == c["path"]
                        and x["mode"] == "single" and x["items"] == c["items"]), None)
            if c["mode"] == "batch" and one is not None:
                speedups[f"{c['variant']}/{c['path']}/batch-{c['batch']}"] = c["items_per_s"] / one["items_per_s"]
        doc["speedup_over_single"] = speedups
        doc["load"].update(loadavg_end=_loadavg(), other_cores_busy=_other_cores(cpu0, _cpu_seconds()))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str))
    say(f"wrote {out}")
    for k, v in doc.get("speedup_over_single", {}).items():
        say(f"  {k}: {v:.1f}x the items/s of one-by-one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
