"""Load test of ``rfmem serve`` on the PersonaBench memories (issue 9 figures).

What it does, side by side in one run:

1. builds a Memory directory holding the 6 PersonaBench users' 527 chunks (texts, ids,
   MiniLM vectors; embeddings from the ``rfmem bench`` cache when present);
2. for each server configuration (``--configs``): micro-batching ("batched", the
   default server), one search per request with a thread each ("single",
   ``--no-batching``) and with one worker ("serial", ``--max-batch 1``): starts the real
   server (``python -m rfmem_fast.cli serve``, text encoder loaded, hot-query cache OFF
   so that every request is encoded and searched) and drives it with an asyncio client
   (aiohttp by default, ``--client httpx``) at each concurrency (default 1, 8, 64):
   closed loop, each client sends the next random PersonaBench question (text) of its
   user as soon as its previous answer arrives;
3. a repeated-question workload with the cache ON (every question asked ``--repeats``
   times, shuffled) to measure the cache hit rate.

Per cell: requests/s, client latency p50 / p99 / mean (ms), errors, and from the
server's ``/metrics`` the batch sizes and the encoder vs search time (per batched run
and per request). The JSON (``--out``, default ``bench/results/serving-<time>.json``)
holds the machine, load (load average, cores busy with other processes), versions,
the command and every figure; a PNG next to it plots requests/s and p50 / p99 against
concurrency.

    python bench/bench_serving.py                       # ~2-3 min on 2 CPU cores
    python bench/bench_serving.py --concurrency 1,8 --requests 100   # quicker
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rfmem_fast.bench.cli import _cpu_seconds, _loadavg, versions  # noqa: E402
from rfmem_fast.bench.workloads import default_cache_dir, default_personabench_dir, personabench_embeddings  # noqa: E402
from rfmem_fast.evaluate import machine_info  # noqa: E402


def build_memory(data_dir: Path, path: Path, say: Any) -> tuple[list[str], list[str], dict[str, Any]]:
    """Write the PersonaBench users' chunks into a Memory at ``path``; return the questions."""
    from rfmem_fast import Memory
    from rfmem_fast.datasets import load_personabench

    pb = personabench_embeddings(data_dir, cache_dir=default_cache_dir(), say=say)
    data = load_personabench(data_dir, noise=0.0)
    snap = pb.bank.snapshot()
    with Memory(path, encoder=False, dim=snap.vectors.shape[1], batching=False) as mem:
        for u, user in enumerate(data.users):
            a, b = int(snap.offsets[u]), int(snap.offsets[u + 1])
            assert list(snap.item_ids[a:b]) == user.chunk_ids
            mem.add(user.chunk_texts, user.key, ids=user.chunk_ids, vectors=snap.vectors[a:b])
    info = {"users": len(data.users), "chunks": int(snap.num_items), "questions": len(data.questions)}
    return [q.question for q in data.questions], [q.user_key for q in data.questions], info


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(client: Any, base: str) -> dict[str, float]:
    """The server's counters of interest from /metrics (histogram sums / counts, cache)."""
    text = client.get(f"{base}/metrics").text
    out: dict[str, float] = {}
    for name in ("rfmem_batch_size", "rfmem_encode_seconds", "rfmem_search_seconds"):
        for part in ("sum", "count"):
            m = re.search(rf"^{name}_{part} (\S+)$", text, re.M)
            out[f"{name}_{part}"] = float(m.group(1)) if m else 0.0
    for kind in ("hits", "misses"):
        m = re.search(rf'^rfmem_cache_{kind}_total{{cache="results"}} (\S+)$', text, re.M)
        out[f"cache_{kind}"] = float(m.group(1)) if m else 0.0
    return out


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


#: server configurations compared: micro-batching, and two ways of one search per request
CONFIGS = {
    "batched": lambda a: ["--max-batch", str(a.max_batch)],  # micro-batching (the default server)
    "single": lambda a: ["--no-batching"],  # each request encodes + searches in its own thread
    "serial": lambda a: ["--max-batch", "1"],  # one worker, one request per encode + search
}
LABELS = {
    "batched": "micro-batching",
    "single": "one search per request (thread each)",
    "serial": "one search per request (one worker)",
}


class Server:
    """``rfmem serve`` in a subprocess, ready once /health answers.

    Each server gets its own copy of the memory directory (``path``-``name``): a
    directory is open in one process at a time.
    """

    def __init__(self, path: Path, config: str, args: argparse.Namespace, cache_size: int, name: str = "") -> None:
        own = path.with_name(f"{path.name}-{name or config}")
        shutil.copytree(path, own)
        path = own
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "rfmem_fast.cli", "serve", "--path", str(path), "--port", str(self.port),
               "--cache-size", str(cache_size), "--max-wait-ms", str(args.max_wait_ms), "--log-level", "warning"]
        cmd += CONFIGS[config](args)
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def wait_ready(self, timeout: float = 180.0) -> None:
        import httpx

        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{self.base}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def drive(base: str, work: list[tuple[str, str]], concurrency: int, k: int, client: str = "httpx") -> dict[str, Any]:
    """Closed loop: ``concurrency`` clients send ``work`` (question, user) in order.

    ``client``: "httpx" (httpx.AsyncClient) or "aiohttp" (aiohttp.ClientSession; about
    0.2 ms of client CPU per request here against httpx's 3.6 ms, which on a 2-core
    machine the server would otherwise lose to the load generator).
    """
    lat: list[float] = []
    errors: dict[str, int] = {}
    it = iter([(quote(u, safe=""), json.dumps({"query": q, "k": k}).encode()) for q, u in work])
    headers = {"content-type": "application/json"}

    if client == "aiohttp":
        import aiohttp

        async def one(http: Any, u: str, body: bytes) -> str:
            async with http.post(f"/v1/users/{u}/search", data=body, headers=headers) as r:
                await r.read()
                return str(r.status)

        session = aiohttp.ClientSession(base, connector=aiohttp.TCPConnector(limit=concurrency),
                                        timeout=aiohttp.ClientTimeout(total=120))
        transport_errors: tuple = (aiohttp.ClientError, asyncio.TimeoutError)
    else:
        import httpx

        async def one(http: Any, u: str, body: bytes) -> str:
            r = await http.post(f"/v1/users/{u}/search", content=body, headers=headers)
            return str(r.status_code)

        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        session = httpx.AsyncClient(base_url=base, limits=limits, timeout=120.0)
        transport_errors = (httpx.HTTPError,)

    async def worker(http: Any) -> None:
        for u, body in it:
            t0 = time.perf_counter()
            try:
                key = await one(http, u, body)
            except transport_errors as e:
                key = type(e).__name__
            if key == "200":
                lat.append(time.perf_counter() - t0)
            else:
                errors[key] = errors.get(key, 0) + 1

    async with session as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ms = np.array(lat) * 1000.0
    return {
        "requests": len(lat), "errors": errors, "wall_s": wall, "rps": len(lat) / wall if wall > 0 else None,
        "p50_ms": float(np.percentile(ms, 50)) if len(ms) else None,
        "p99_ms": float(np.percentile(ms, 99)) if len(ms) else None,
        "mean_ms": float(ms.mean()) if len(ms) else None,
    }


def run_cell(server: Server, work: list[tuple[str, str]], concurrency: int, k: int, client: str) -> dict[str, Any]:
    """One (server, concurrency) cell with server-side metrics and load around it."""
    import httpx

    with httpx.Client() as c:
        m0 = metrics(c, server.base)
    cpu0, srv0, load0 = _cpu_seconds(), proc_cpu(server.proc.pid), _loadavg()
    res = asyncio.run(drive(server.base, work, concurrency, k, client))
    cpu1, srv1, load1 = _cpu_seconds(), proc_cpu(server.proc.pid), _loadavg()
    with httpx.Client() as c:
        m1 = metrics(c, server.base)
    d = {key: m1[key] - m0[key] for key in m0}
    runs = d["rfmem_batch_size_count"]
    res.update(
        concurrency=concurrency,
        batches=runs,
        mean_batch=d["rfmem_batch_size_sum"] / runs if runs else None,
        encode_ms_per_batch=1000 * d["rfmem_encode_seconds_sum"] / d["rfmem_encode_seconds_count"] if d["rfmem_encode_seconds_count"] else None,
        search_ms_per_batch=1000 * d["rfmem_search_seconds_sum"] / d["rfmem_search_seconds_count"] if d["rfmem_search_seconds_count"] else None,
        encode_ms_per_request=1000 * d["rfmem_encode_seconds_sum"] / max(1, res["requests"]),
        search_ms_per_request=1000 * d["rfmem_search_seconds_sum"] / max(1, res["requests"]),
        cache_hits=d["cache_hits"], cache_misses=d["cache_misses"],
        load_before=load0, load_after=load1,
    )
    if cpu0 and cpu1 and cpu1[0] > cpu0[0]:
        wall = cpu1[0] - cpu0[0]
        busy = (cpu1[1] - cpu0[1]) / wall
        server_cores = (srv1 - srv0) / wall
        client_cores = (cpu1[2] - cpu0[2]) / wall
        res.update(machine_busy_cores=busy, server_cores=server_cores, client_cores=client_cores,
                   other_cores=max(0.0, busy - server_cores - client_cores))
    return res


def plot(doc: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for config, style in zip(CONFIGS, ("o-", "s--", "^:")):
        cells = [c for c in doc["cells"] if c["config"] == config]
        if not cells:
            continue
        xs = [c["concurrency"] for c in cells]
        lab = LABELS[config]
        a.plot(xs, [c["rps"] for c in cells], style, label=lab)
        b.plot(xs, [c["p50_ms"] for c in cells], style, label=f"{lab} p50")
        b.plot(xs, [c["p99_ms"] for c in cells], style, alpha=0.5, label=f"{lab} p99")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    a.set_ylabel("requests / s")
    b.set_ylabel("latency (ms)")
    b.set_yscale("log")
    b.axhline(200, color="grey", lw=0.8, ls=":")
    load = doc["load"]["loadavg_start"]
    fig.suptitle(f"rfmem serve on PersonaBench (text queries, MiniLM on CPU), {doc['machine']['cores']} cores, "
                 f"load avg {load}, client {doc['settings']['client']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="PersonaBench eval_data_v1 folder (default: ../shared/...)")
    p.add_argument("--concurrency", default="1,8,64", help="comma list of concurrent clients")
    p.add_argument("--requests", type=int, default=263, help="requests per cell (at least 8 x concurrency)")
    p.add_argument("--warmup", type=int, default=32, help="untimed requests before each server's cells")
    p.add_argument("--k", type=int, default=10, help="hits per query")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=3, help="times each question is asked in the cache workload")
    p.add_argument("--cache-concurrency", type=int, default=64)
    p.add_argument("--configs", default="batched,single,serial", help=f"comma list of {list(CONFIGS)}")
    p.add_argument("--client", choices=("aiohttp", "httpx"), default=None,
                   help="load generator (default aiohttp when installed: ~0.2 ms CPU per request vs ~3.6 for httpx)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/serving-<time>.json)")
    args = p.parse_args(argv)
    if args.client is None:
        try:
            import aiohttp  # noqa: F401

            args.client = "aiohttp"
        except ImportError:
            args.client = "httpx"
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or "batched" not in configs:
        p.error(f"--configs must include 'batched' and only name {list(CONFIGS)}")
    conc = [int(x) for x in args.concurrency.split(",") if x.strip()]
    data = Path(args.data) if args.data else default_personabench_dir()
    if data is None:
        print("PersonaBench not found: pass --data", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"serving-{time.strftime('%Y%m%d-%H%M%S')}.json"
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    tmp = Path(tempfile.mkdtemp(prefix="rfmem-serving-bench-"))
    doc: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": machine_info(), "versions": versions(),
        "load": {"loadavg_start": _loadavg()},
        "settings": {"concurrency": conc, "requests": args.requests, "warmup": args.warmup, "k": args.k,
                     "max_batch": args.max_batch, "max_wait_ms": args.max_wait_ms, "data": str(data),
                     "configs": {c: LABELS[c] for c in configs}, "client": args.client,
                     "query": "PersonaBench question text, encoded by the server (all-MiniLM-L6-v2, CPU)",
                     "cache": "off for the batching cells; on for the repeated-question cell"},
        "cells": [],
    }
    try:
        import importlib.metadata as md

        for dist in ("fastapi", "uvicorn", "uvloop", "httptools", "httpx", "aiohttp", "prometheus-client", "pydantic"):
            try:
                doc["versions"][dist] = md.version(dist)
            except md.PackageNotFoundError:
                doc["versions"][dist] = None
        questions, users, info = build_memory(data, tmp / "mem", say)
        doc["data"] = info
        work = list(zip(questions, users))
        rng = random.Random(0)
        # every server up at once, cells interleaved per concurrency: a load change on a
        # shared machine then hits the configurations alike
        servers = {config: Server(tmp / "mem", config, args, cache_size=0) for config in configs}
        try:
            for config, srv in servers.items():
                srv.wait_ready()
                doc.setdefault("server_commands", {})[config] = " ".join(srv.cmd)
                asyncio.run(drive(srv.base, work[: args.warmup], min(8, args.warmup), args.k, args.client))
            for c in conc:
                n = max(args.requests, 8 * c)
                cell_work = [work[rng.randrange(len(work))] for _ in range(n)]
                for config, srv in servers.items():
                    say(f"{config} concurrency={c}: {n} requests")
                    res = run_cell(srv, cell_work, c, args.k, args.client)
                    res["config"] = config
                    doc["cells"].append(res)
                    say(f"  {res['rps']:.1f} req/s  p50 {res['p50_ms']:.1f} ms  p99 {res['p99_ms']:.1f} ms  "
                        f"mean batch {res['mean_batch']}")
        finally:
            for srv in servers.values():
                srv.stop()
        # repeated questions, cache on
        srv = Server(tmp / "mem", "batched", args, cache_size=4096, name="cache")
        try:
            srv.wait_ready()
            rep = [w for w in work for _ in range(args.repeats)]
            random.Random(1).shuffle(rep)
            say(f"cache: {len(rep)} requests ({args.repeats} x {len(work)} questions)")
            res = run_cell(srv, rep, args.cache_concurrency, args.k, args.client)
            lookups = res["cache_hits"] + res["cache_misses"]
            res.update(config="batched", repeats=args.repeats,
                       cache_hit_rate=res["cache_hits"] / lookups if lookups else None,
                       cache_hit_rate_ideal=1 - 1 / args.repeats)
            doc["cache_cell"] = res
            say(f"  hit rate {res['cache_hit_rate']:.3f}, {res['rps']:.1f} req/s")
        finally:
            srv.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc["load"]["loadavg_end"] = _loadavg()
    by = {(c["config"], c["concurrency"]): c for c in doc["cells"]}
    ratios: dict[str, dict[str, float]] = {}
    for base_cfg in configs:
        if base_cfg == "batched":
            continue
        for c in conc:
            on, off = by.get(("batched", c)), by.get((base_cfg, c))
            if on and off and off["rps"]:
                ratios.setdefault(base_cfg, {})[str(c)] = on["rps"] / off["rps"]
    doc["rps_ratios_batched_over"] = ratios
    top = by.get(("batched", 64))
    at64 = [r["64"] for r in ratios.values() if "64" in r]
    worst = min(at64) if at64 else None  # against the better one-search-per-request server
    doc["goal"] = {
        "rps_ratio_at_64_vs_best_baseline": worst, "rps_ratio_ge_3": bool(worst and worst >= 3),
        "p99_ms_at_64": top["p99_ms"] if top else None, "p99_lt_200ms": bool(top and top["p99_ms"] < 200),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    png = out.with_suffix(".png")
    plot(doc, png)
    print(f"wrote {out} and {png}")
    print("| server | clients | req/s | p50 ms | p99 ms | mean batch | encode ms/req | search ms/req | errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cl in sorted(doc["cells"], key=lambda c: (configs.index(c["config"]), c["concurrency"])):
        print(f"| {cl['config']} | {cl['concurrency']} | {cl['rps']:.1f} | {cl['p50_ms']:.1f} | "
              f"{cl['p99_ms']:.1f} | {cl['mean_batch'] or 0:.1f} | {cl['encode_ms_per_request']:.2f} | "
              f"{cl['search_ms_per_request']:.2f} | {sum(cl['errors'].values())} |")
    print(f"req/s ratios (batched / baseline): {ratios}; goal: {doc['goal']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
