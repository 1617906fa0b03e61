"""Load test of ``rfmem serve`` on the PersonaBench memories.

What it does, side by side in one run:

1. builds a Memory directory holding the 6 PersonaBench users' 527 chunks (texts, ids,
   MiniLM vectors; embeddings from the ``rfmem bench`` cache when present);
2. for each encoder precision (``--encoder-dtype``, default "auto", the server's
   default: bfloat16 on a CPU with native bfloat16 matmul, else float32; a comma list
   compares several) and each server configuration (``--configs``): micro-batching
   ("batched", the default server), one search per request with a thread each
   ("single", ``--no-batching``) and with one worker ("serial", ``--max-batch 1``):
   starts the real server (``python -m rfmem_fast.cli serve``, text encoder loaded,
   hot-query cache OFF so that every request is encoded and searched) and drives it
   with an asyncio client (:class:`RawClient` by default: keep-alive HTTP/1.1 on
   uvloop, ~0.05 ms of CPU per request; ``--client aiohttp`` / ``httpx``) at each concurrency
   (default 1, 8, 64): closed loop, each client sends the next random PersonaBench
   question (text) of its user as soon as its previous answer arrives. The servers of
   one precision run at once and their cells are interleaved per concurrency, so a
   change of the machine's load hits them alike;
3. open loop (``--open-loop``, on the micro-batching server): Poisson arrivals at fixed
   offered rates (default 25 / 50 / 75 % of the rate it reached with 64 closed-loop
   clients), latency counted from each request's scheduled send time (no coordinated
   omission): p50 / p99 at a given offered load;
4. a repeated-question workload with the cache ON (every question asked ``--repeats``
   times, shuffled) to measure the cache hit rate.

Per cell: requests/s, client latency p50 / p99 / mean (ms), errors, the server's and
the client's CPU milliseconds per request (both run on the same cores), and from the
server's ``/metrics`` the batch sizes and the encoder vs search time (per batched run
and per request); the encoder's precision comes from the server's ``/health``. The
JSON (``--out``, default ``bench/results/local/serving-<time>.json``) holds the machine,
load (load average, cores busy with other processes), versions, the command and every
figure; a PNG next to it plots requests/s and p50 / p99 against concurrency.

5. ``--compare-pipeline``: the server without the pipeline (``--no-pipeline
   --encoder-workers 1 --switch-interval-ms 5``: one batch encoded, then searched, on
   one thread), the default server (pipelined, ``--encoder-workers auto``) and the
   pipeline with two encoder workers side by side: closed loop at 1 / 8 / 64 clients for ``--seconds`` each,
   open loop at the same offered rates on every server, and (``--profile``, needs
   Linux ``perf``) where the server's CPU goes per request: ``perf record`` on the
   server during each 8- and 64-client cell, samples split by thread role (the event
   loop = HTTP / JSON; encoder threads; the search thread) and by shared object
   (ONNX Runtime / torch / tokenizers = encode, ``_native`` = search kernels, the
   Python interpreter, the kernel).

    python bench/bench_serving.py                       # ~3-4 min on 2 CPU cores
    python bench/bench_serving.py --encoder-dtype auto,float32   # both precisions
    python bench/bench_serving.py --concurrency 1,8 --requests 100 --open-loop none   # quicker
    python bench/bench_serving.py --compare-pipeline    # before / after the pipeline, ~5 min

6. ``--baseline-ref REF`` runs the ``unpipelined`` and ``before`` servers from the code of
   git commit REF (``git archive``; this checkout's compiled native module copied in where
   REF's ``csrc`` is the same, else REF's own built in place, which needs pybind11; the
   memory directory written again by REF's code, so an older store format is read; its
   CLI's flags only: ``before`` = its defaults and ``--max-batch``, ``--no-auth`` only
   where REF has it): the server of REF, exactly, next to this checkout's in one run. Against commit
   51f1a6b (the torch encoder, no pipeline, no fast path; ~3 min)::

    python bench/bench_serving.py --baseline-ref 51f1a6b --configs before,batched --open-loop none \
        --repeats 0 --seconds 12 --rounds 4

   The server of 6fd04da (the ONNX encoder already in) without its pipeline against
   this checkout's, with the int8 encoder for comparison (~8 min):

    python bench/bench_serving.py --compare-pipeline --baseline-ref 6fd04da \
        --configs unpipelined,batched,pipeline-2,int8 --open-loop-configs unpipelined,batched,pipeline-2,int8
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import random
import re
import shutil
import signal
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


def build_memory(data_dir: Path, path: Path, say: Any, dump_rows: bool = False
                 ) -> tuple[list[str], list[str], dict[str, Any]]:
    """Write the PersonaBench users' chunks into a Memory at ``path``; return the questions.
    ``dump_rows``: also write them to ``<path>-rows.json`` (:func:`build_baseline_memory`)."""
    from rfmem_fast import Memory
    from rfmem_fast.datasets import load_personabench

    pb = personabench_embeddings(data_dir, cache_dir=default_cache_dir(), say=say)
    data = load_personabench(data_dir, noise=0.0)
    snap = pb.bank.snapshot()
    rows = []
    with Memory(path, encoder=False, dim=snap.vectors.shape[1], batching=False) as mem:
        for u, user in enumerate(data.users):
            a, b = int(snap.offsets[u]), int(snap.offsets[u + 1])
            assert list(snap.item_ids[a:b]) == user.chunk_ids
            mem.add(user.chunk_texts, user.key, ids=user.chunk_ids, vectors=snap.vectors[a:b])
            if dump_rows:
                rows.append({"user": user.key, "texts": list(user.chunk_texts), "ids": [str(i) for i in user.chunk_ids],
                             "vectors": snap.vectors[a:b].tolist()})
    if dump_rows:
        (path.parent / f"{path.name}-rows.json").write_text(json.dumps(rows))
    info = {"users": len(data.users), "chunks": int(snap.num_items), "questions": len(data.questions)}
    return [q.question for q in data.questions], [q.user_key for q in data.questions], info


#: run in the --baseline-ref tree: the same Memory directory written by that commit's own
#: code (its store format), from the rows build_memory dumped
_BASELINE_MEMORY = """
import json, sys
import numpy as np
from rfmem_fast import Memory
rows = json.load(open(sys.argv[1]))
with Memory(sys.argv[2], encoder=False, dim=len(rows[0]["vectors"][0]), batching=False) as mem:
    for r in rows:
        mem.add(r["texts"], r["user"], ids=r["ids"], vectors=np.asarray(r["vectors"], dtype=np.float32))
"""


def build_baseline_memory(src: Path, path: Path) -> Path:
    """The Memory directory of :func:`build_memory` (at ``path``) written again by the code
    of the --baseline-ref tree ``src`` (whose store format may be older), next to it as
    ``<path>-baseline``; returns that path."""
    out = path.with_name(f"{path.name}-baseline")
    env = {**os.environ, "PYTHONPATH": str(src)}
    subprocess.run([sys.executable, "-c", _BASELINE_MEMORY, str(path.parent / f"{path.name}-rows.json"), str(out)],
                   cwd=src, env=env, check=True, capture_output=True, text=True)
    return out


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
    # micro-batching without the pipeline (one thread encodes, then searches, a batch)
    "unpipelined": lambda a: ["--max-batch", str(a.max_batch), "--no-pipeline", "--encoder-workers", "1",
                              "--switch-interval-ms", "5"]  # and Python's own GIL switch interval, as before
    + ([] if a.baseline_ref else ["--no-fast-path"]),  # (the code of --baseline-ref has no fast path)
    # the server of --baseline-ref as it was (its defaults), for a commit before the pipeline's flags
    "before": lambda a: ["--max-batch", str(a.max_batch)],
    "batched-si5": lambda a: ["--max-batch", str(a.max_batch), "--switch-interval-ms", "5"],
    "pipeline-1": lambda a: ["--max-batch", str(a.max_batch), "--encoder-workers", "1"],
    "pipeline-2": lambda a: ["--max-batch", str(a.max_batch), "--encoder-workers", "2"],
    # the default server with the int8 ONNX encoder named (what "auto" picks on a CPU with int8 dot
    # products: rfmem_fast.encoders.resolve_backend), and with the float32 ONNX encoder forced
    "int8": lambda a: ["--max-batch", str(a.max_batch), "--encoder-dtype", "int8"],
    "float32": lambda a: ["--max-batch", str(a.max_batch), "--encoder-backend", "onnx", "--encoder-dtype", "float32"],
    # the default server with the torch bfloat16 encoder (passes cut by length): the faster
    # one for batches on a CPU with AMX (docs/benchmarks/serving.md, "Encoder runtimes")
    "torch-bf16": lambda a: ["--max-batch", str(a.max_batch), "--encoder-backend", "torch", "--encoder-dtype", "bfloat16"],
    "torch-bf16-2": lambda a: ["--max-batch", str(a.max_batch), "--encoder-backend", "torch", "--encoder-dtype", "bfloat16",
                               "--encoder-workers", "2"],
}
LABELS = {
    "batched": "micro-batching (default server: pipelined, --encoder-workers auto = max(1, cores // 4))",
    "single": "one search per request (thread each)",
    "serial": "one search per request (one worker)",
    "unpipelined": "micro-batching, no pipeline, 1 encoder, 5 ms GIL switch interval (before)",
    "before": "the server of --baseline-ref with its own defaults (micro-batching, --max-batch)",
    "batched-si5": "the default server with Python's 5 ms GIL switch interval",
    "pipeline-1": "micro-batching, pipelined, 1 encoder worker",
    "pipeline-2": "micro-batching, pipelined, 2 encoder workers",
    "int8": "the default server with --encoder-dtype int8 (ONNX int8 encoder: MatMulNBits, texts over 64 tokens in float32)",
    "float32": "the default server with the ONNX float32 encoder forced (--encoder-backend onnx --encoder-dtype float32)",
    "torch-bf16": "the default server with the torch bfloat16 encoder (--encoder-backend torch --encoder-dtype bfloat16)",
    "torch-bf16-2": "the torch bfloat16 encoder, 2 encoder workers of 1 thread each",
}
#: configurations run from the --baseline-ref tree when one is given (the server before)
BASELINE_CONFIGS = ("unpipelined", "before")
#: the configurations of --compare-pipeline: before, the default (pipeline, --encoder-workers auto),
#: the pipeline with two encoder workers (1 vs 2 workers)
COMPARE_PIPELINE = ("unpipelined", "batched", "pipeline-2")


def wait_for_health(proc: subprocess.Popen, base: str, timeout: float) -> dict:
    """The JSON of ``base``/health once the server ``proc`` answers it with 200.

    Raises:
        RuntimeError: the process exited first (its stderr's end quoted) or ``timeout``
            seconds passed.
    """
    import httpx

    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            r = httpx.get(f"{base}/health", timeout=1.0)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not become ready")


class Server:
    """``rfmem serve`` in a subprocess, ready once /health answers.

    Each server gets its own copy of the memory directory (``path``-``name``): a
    directory is open in one process at a time. ``dtype``: its ``--encoder-dtype``.
    """

    def __init__(self, path: Path, config: str, args: argparse.Namespace, cache_size: int, dtype: str,
                 name: str = "") -> None:
        # the server before (--baseline-ref): that commit's code (export_baseline: its own
        # native module where its C++ differs) and its own memory directory (build_baseline_memory)
        src = args.baseline_src if getattr(args, "baseline_src", None) and config in BASELINE_CONFIGS else ROOT
        if src != ROOT:
            path = path.with_name(f"{path.name}-baseline")
        own = path.with_name(f"{path.name}-{name or config}-{dtype}")
        shutil.copytree(path, own)
        path = own
        self.src = src
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "rfmem_fast.cli", "serve", "--path", str(path), "--port", str(self.port),
               "--cache-size", str(cache_size), "--max-wait-ms", str(args.max_wait_ms), "--log-level", "warning",
               "--encoder-dtype", dtype]
        if src == ROOT or _has_flag(src, "--no-auth"):  # a loopback benchmark: no tokens to send
            cmd.append("--no-auth")  # (a server before commit 17c7299 had no auth unless given a key)
        serve_cli = src / "rfmem_fast" / "serving" / "cli.py"
        if serve_cli.is_file() and '"--preset"' in serve_cli.read_text(encoding="utf-8", errors="replace"):
            cmd += ["--preset", "paper"]  # the recorded figures' retrieval (the servers' default before the hybrid one)
        cmd += CONFIGS[config](args)
        self.cmd = cmd
        self.health: dict[str, Any] = {}
        env = {k: v for k, v in os.environ.items() if k != "RFMEM_API_KEY"}  # --no-auth refuses a key
        env["PYTHONPATH"] = os.pathsep.join([str(src), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
        self.proc = subprocess.Popen(cmd, cwd=src, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Wait for /health (kept in ``self.health``: the encoder's precision among others)."""
        self.health = wait_for_health(self.proc, self.base, timeout)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class RawConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection of :class:`RawClient`: sends a prepared
    request, parses the status line and ``Content-Length`` of the answer, nothing more
    (the body is skipped: the server's answers are checked by the tests)."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.lost: BaseException | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is not None:
            status = self._answer()
            if status is not None:
                w, self.waiter = self.waiter, None
                if not w.done():
                    w.set_result(status)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = exc or ConnectionResetError("the server closed the connection")
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(self.lost)

    def _answer(self) -> str | None:
        """The status of the complete answer at the head of the buffer (removed), or None."""
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return None
        head = bytes(self.buf[:end]).lower()
        size, at = 0, head.find(b"\r\ncontent-length:")
        if at >= 0:
            stop = head.find(b"\r\n", at + 17)
            size = int(head[at + 17:stop if stop >= 0 else len(head)])
        if len(self.buf) < end + 4 + size:
            return None
        del self.buf[:end + 4 + size]
        return head[9:12].decode()

    def request(self, raw: bytes) -> asyncio.Future:
        """Send one prepared request; a future of its answer's status (str)."""
        fut = asyncio.get_running_loop().create_future()
        if self.lost is not None:
            fut.set_exception(self.lost)
            return fut
        self.waiter = fut
        self.transport.write(raw)
        return fut


class RawClient:
    """The leanest load generator: keep-alive HTTP/1.1 over asyncio protocols, each
    request's bytes prepared before the cell (``POST /v1/users/{u}/search`` with its
    JSON body), one connection per concurrent request (``limit`` the most kept idle, 0:
    no limit). Run on uvloop where installed (:func:`run_async`). About 0.05 ms of
    client CPU per request here, against aiohttp's ~0.2 and httpx's ~3.6."""

    def __init__(self, base: str, limit: int) -> None:
        host, _, port = base.split("://", 1)[1].partition(":")
        self.host, self.port, self.limit = host, int(port), limit
        self.idle: list[RawConnection] = []
        self.raw: dict[tuple[str, bytes], bytes] = {}

    def prepare(self, u: str, body: bytes) -> bytes:
        """The request bytes of a search of user ``u`` (percent-encoded) with ``body``."""
        key = (u, body)
        raw = self.raw.get(key)
        if raw is None:
            raw = self.raw[key] = (f"POST /v1/users/{u}/search HTTP/1.1\r\nHost: {self.host}\r\n"
                                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                                   ).encode() + body
        return raw

    async def one(self, u: str, body: bytes) -> str:
        """One request: the status of its answer (str). A kept-alive connection the
        server closed meanwhile (uvicorn closes idle ones after 5 s) is not reused, and
        a request that fails on a reused connection is sent once more on a new one."""
        raw = self.prepare(u, body)
        conn = None
        while self.idle and conn is None:
            conn = self.idle.pop()
            if conn.lost is not None:
                conn = None
        for attempt in (0, 1):
            reused = conn is not None
            if conn is None:
                _, conn = await asyncio.get_running_loop().create_connection(RawConnection, self.host, self.port)
            try:
                status = await conn.request(raw)
                break
            except ConnectionError:
                conn.transport.close()
                if not reused or attempt:
                    raise
                conn = None
            except BaseException:
                conn.transport.close()
                raise
        if self.limit == 0 or len(self.idle) < self.limit:
            self.idle.append(conn)
        else:
            conn.transport.close()
        return status

    async def __aenter__(self) -> "RawClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for conn in self.idle:
            conn.transport.close()
        self.idle.clear()


def run_async(coro: Any) -> Any:
    """``asyncio.run(coro)`` on uvloop where installed (a cheaper client loop)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def export_baseline(ref: str, dest: Path) -> dict[str, str]:
    """The source tree of git ``ref`` (``git archive``) in ``dest`` with a compiled native
    module (the tree has the sources only): this checkout's ``rfmem_fast/_native*.so``
    copied in where ``ref``'s ``csrc`` is this checkout's, else its own, built in place
    (``setup.py build_ext --inplace``: needs pybind11): the server before, run as it was.
    Returns {"ref", "commit", "native_module"}.

    Raises:
        RuntimeError: ``ref`` is not a commit of this repository, or its native module
            had to be built and did not build.
    """
    import io
    import tarfile

    got = subprocess.run(["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=ROOT, capture_output=True,
                         text=True)
    if got.returncode != 0:
        raise RuntimeError(f"--baseline-ref {ref!r} is not a commit of {ROOT}: {got.stderr.strip()}")
    commit = got.stdout.strip()
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True).stdout
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    same_cpp = subprocess.run(["git", "diff", "--quiet", commit, "HEAD", "--", "csrc"], cwd=ROOT).returncode == 0
    native = "this checkout's"
    if not same_cpp:  # its Python calls its own kernels: build them (pybind11, ~1-2 min)
        built = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=dest, capture_output=True,
                               text=True, env={**os.environ, "PYTHONPATH": str(dest)})
        if built.returncode != 0 or not list((dest / "rfmem_fast").glob("_native*.so")):
            raise RuntimeError(f"--baseline-ref {ref}: its C++ differs from this checkout's and its native module "
                               f"did not build (pip install pybind11?): {built.stderr.strip()[-800:]}")
        native = "its own, built from its csrc"
    else:
        for so in (ROOT / "rfmem_fast").glob("_native*.so"):
            shutil.copy2(so, dest / "rfmem_fast" / so.name)
    return {"ref": ref, "commit": commit, "native_module": native}


def _has_flag(src: Path, flag: str) -> bool:
    """Whether the CLI of the tree ``src`` defines ``flag`` (its sources mention it)."""
    return any(f'"{flag}"' in f.read_text(encoding="utf-8", errors="replace")
               for f in (src / "rfmem_fast").rglob("*cli*.py"))


def _session(base: str, client: str, limit: int) -> tuple[Any, Any, tuple]:
    """(session, ``one(session, user, body) -> status str``, transport errors) of ``client``.

    ``client``: "raw" (:class:`RawClient`, the default), "aiohttp" (aiohttp.ClientSession;
    about 0.2 ms of client CPU per request here) or "httpx" (httpx.AsyncClient, ~3.6 ms,
    which on a 2-core machine the server would otherwise lose to the load generator).
    ``limit``: the most connections open at once (0: no limit).
    """
    headers = {"content-type": "application/json"}
    if client == "raw":
        raw = RawClient(base, limit)
        return raw, lambda http, u, body: http.one(u, body), (OSError, asyncio.TimeoutError)
    if client == "aiohttp":
        import aiohttp

        async def one(http: Any, u: str, body: bytes) -> str:
            async with http.post(f"/v1/users/{u}/search", data=body, headers=headers) as r:
                await r.read()
                return str(r.status)

        session = aiohttp.ClientSession(base, connector=aiohttp.TCPConnector(limit=limit),
                                        timeout=aiohttp.ClientTimeout(total=120))
        return session, one, (aiohttp.ClientError, asyncio.TimeoutError)
    import httpx

    async def one_httpx(http: Any, u: str, body: bytes) -> str:
        r = await http.post(f"/v1/users/{u}/search", content=body, headers=headers)
        return str(r.status_code)

    limits = httpx.Limits(max_connections=limit or None, max_keepalive_connections=limit or None)
    return httpx.AsyncClient(base_url=base, limits=limits, timeout=120.0), one_httpx, (httpx.HTTPError,)


def _bodies(work: list[tuple[str, str]], k: int) -> list[tuple[str, bytes]]:
    return [(quote(u, safe=""), json.dumps({"query": q, "k": k}).encode()) for q, u in work]


def _latency_summary(lat: list[float], errors: dict[str, int], wall: float) -> dict[str, Any]:
    ms = np.array(lat) * 1000.0
    return {
        "_lat": list(lat),  # the raw latencies (s), for merge_cells; not written to the JSON
        "requests": len(lat), "errors": errors, "wall_s": wall, "rps": len(lat) / wall if wall > 0 else None,
        "p50_ms": float(np.percentile(ms, 50)) if len(ms) else None,
        "p99_ms": float(np.percentile(ms, 99)) if len(ms) else None,
        "mean_ms": float(ms.mean()) if len(ms) else None,
    }


async def drive(base: str, work: list[tuple[str, str]], concurrency: int, k: int, client: str = "raw",
                seconds: float | None = None) -> dict[str, Any]:
    """Closed loop: ``concurrency`` clients send ``work`` (question, user) in order, each
    the next one as soon as its previous answer arrived (client: :func:`_session`);
    with ``seconds``, ``work`` is cycled and no request is sent after that many seconds."""
    lat: list[float] = []
    errors: dict[str, int] = {}
    bodies = _bodies(work, k)
    it = iter(bodies) if seconds is None else itertools.cycle(bodies)
    session, one, transport_errors = _session(base, client, concurrency)
    stop_at = None if seconds is None else time.perf_counter() + seconds

    async def worker(http: Any) -> None:
        for u, body in it:
            t0 = time.perf_counter()
            if stop_at is not None and t0 >= stop_at:
                return
            key = await _ask(one, http, u, body, transport_errors)
            _record(key, time.perf_counter() - t0, lat, errors)

    async with session as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return _latency_summary(lat, errors, wall)


async def _ask(one: Any, http: Any, u: str, body: bytes, transport_errors: tuple) -> str:
    """One request: its HTTP status as a string, or the name of the transport error."""
    try:
        return await one(http, u, body)
    except transport_errors as e:
        return type(e).__name__


def _record(key: str, seconds: float, lat: list[float], errors: dict[str, int]) -> None:
    """Count one answer: its latency when it is a 200, else one more error of its kind."""
    if key == "200":
        lat.append(seconds)
    else:
        errors[key] = errors.get(key, 0) + 1


def poisson_schedule(n: int, rate: float, seed: int) -> np.ndarray:
    """Send times (s from the start, float64 [n], increasing) of ``n`` Poisson arrivals
    at ``rate`` requests / s: cumulative sums of seeded exponential gaps of mean 1 / rate."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))


async def drive_open(base: str, work: list[tuple[str, str]], rate: float, k: int, client: str = "raw",
                     seed: int = 0) -> dict[str, Any]:
    """Open loop: ``work`` sent at Poisson arrival times of ``rate`` requests / s, whatever
    the answers do (no connection limit). A request's latency runs from its SCHEDULED
    send time to its answer, so a client or server that falls behind shows in the
    percentiles (no coordinated omission). ``send_lag_p99_ms``: how late the client
    sent (it measures itself).
    """
    lat: list[float] = []
    lag: list[float] = []
    errors: dict[str, int] = {}
    at = poisson_schedule(len(work), rate, seed)
    session, one, transport_errors = _session(base, client, 0)
    loop = asyncio.get_running_loop()

    async def send(http: Any, t_rel: float, u: str, body: bytes, t0: float) -> None:
        due = t0 + t_rel
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        lag.append(loop.time() - due)
        key = await _ask(one, http, u, body, transport_errors)
        _record(key, loop.time() - due, lat, errors)

    async with session as http:
        t0 = loop.time() + 0.05
        w0 = time.perf_counter()
        await asyncio.gather(*(send(http, t, u, b, t0) for t, (u, b) in zip(at, _bodies(work, k))))
        wall = time.perf_counter() - w0
    out = _latency_summary(lat, errors, wall)
    out.update(offered_rps=rate, send_lag_p99_ms=float(np.percentile(np.array(lag) * 1000, 99)) if lag else None)
    return out


def run_cell(server: Server, work: list[tuple[str, str]], concurrency: int, k: int, client: str,
             rate: float | None = None, seconds: float | None = None, profile: bool = False) -> dict[str, Any]:
    """One (server, concurrency) cell -- or, with ``rate``, one open-loop cell -- with the
    server-side metrics, the CPU of server and client, and the load around it
    (``seconds``: a closed-loop cell of that length; ``profile``: ``perf record`` on
    the server during the cell, :func:`cpu_profile`)."""
    import httpx

    with httpx.Client() as c:
        m0 = metrics(c, server.base)
    perf = start_perf(server.proc.pid) if profile else None
    cpu0, srv0, load0 = _cpu_seconds(), proc_cpu(server.proc.pid), _loadavg()
    if rate is None:
        res = run_async(drive(server.base, work, concurrency, k, client, seconds))
    else:
        res = run_async(drive_open(server.base, work, rate, k, client))
    cpu1, srv1, load1 = _cpu_seconds(), proc_cpu(server.proc.pid), _loadavg()
    if perf is not None:
        res["profile"] = stop_perf(perf, server.proc.pid)
    with httpx.Client() as c:
        m1 = metrics(c, server.base)
    d = {key: m1[key] - m0[key] for key in m0}
    runs = d["rfmem_batch_size_count"]
    done = max(1, res["requests"] + sum(res["errors"].values()))
    res.update(
        concurrency=concurrency,
        encoder_dtype=(server.health.get("encoder") or {}).get("dtype"),
        server_cpu_ms_per_request=1000 * (srv1 - srv0) / done,
        client_cpu_ms_per_request=1000 * (cpu1[2] - cpu0[2]) / done if cpu0 and cpu1 else None,
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
    prof = res.get("profile")
    if prof and prof.get("samples"):  # the shares as CPU ms per request
        per_req = res["server_cpu_ms_per_request"]
        prof["ms_per_request"] = {role: round(share * per_req, 3) for role, share in prof["roles"].items()}
        prof["ms_per_request_by_kind"] = {kind: round(share * per_req, 3) for kind, share in prof["kinds"].items()}
        prof["ms_per_request_split"] = {k: round(share * per_req, 3) for k, share in prof["split"].items()}
    return res


# ---------------------------------------------------------------------- CPU profile (perf)
#: shared objects -> what they do in the server (first match wins; else "other")
DSO_KINDS = (
    ("encode", ("onnxruntime", "libtorch", "libc10", "tokenizers", "libgomp", "libiomp", "mkl", "dnnl")),
    ("search", ("_native",)),
    ("numpy", ("_multiarray", "openblas", "numpy", "_umath")),
    ("python", ("libpython", "python3", "[unknown]")),
    ("json/http", ("orjson", "httptools", "uvloop", "pydantic_core", "_json", "_ssl", "_asyncio")),
    ("kernel", ("[kernel", "[vdso]")),
    ("libc", ("libc.so", "libc-", "libm.so", "libpthread", "ld-linux", "libstdc++")),
)


def _kind(dso: str) -> str:
    for kind, marks in DSO_KINDS:
        if any(m in dso for m in marks):
            return kind
    return "other"


def start_perf(pid: int) -> Any:
    """``perf record`` (cpu-clock at 499 Hz, every thread) of ``pid`` into a temporary
    file; None when perf is missing or refused."""
    if shutil.which("perf") is None:
        return None
    out = tempfile.NamedTemporaryFile(prefix="rfmem-perf-", suffix=".data", delete=False).name
    proc = subprocess.Popen(["perf", "record", "-F", "499", "-e", "cpu-clock", "-p", str(pid), "-o", out, "-q"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(0.3)  # perf attaches to every thread
    if proc.poll() is not None:
        return None
    return proc, out


def stop_perf(perf: Any, pid: int) -> dict[str, Any]:
    """Stop :func:`start_perf`'s recording and summarise it (:func:`cpu_profile`)."""
    proc, out = perf
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    try:
        rep = subprocess.run(["perf", "report", "-i", out, "--stdio", "--no-children", "--sort", "pid,dso",
                              "-F", "sample,pid,dso", "-q"], capture_output=True, text=True, timeout=120).stdout
    finally:
        os.unlink(out)
    return cpu_profile(rep, pid)


def cpu_profile(report: str, pid: int) -> dict[str, Any]:
    """Where the server's CPU went, from ``perf report --sort pid,dso -F sample,pid,dso`` (perf's "pid" is the thread).

    Each thread gets a role: the process's main thread (tid == pid) is the event loop
    (HTTP parsing, FastAPI, pydantic, JSON, the asyncio hand-off to the batcher); any
    other thread is "encode" when most of its samples are in encoder libraries (ONNX
    Runtime, torch, tokenizers: the encoder workers and their intra-op threads), else
    "search" (the search thread, and the native kernels' own threads); without the
    pipeline the one batch thread does both and counts as "encode".

    "split" answers "encode vs search vs HTTP/JSON" the same way with and without the
    pipeline: "http/json" = every sample of the event loop thread; outside it,
    "encoder libs" (ONNX Runtime / torch / tokenizers), "search kernels" (``_native``
    and numpy), "python" (the interpreter: the batcher, the encode stage's Python
    around the runtime, the search stage's routing, collapsing and hit building) and
    "os" (kernel, libc, other).

    Returns the fraction of samples per role ("roles"), per kind of shared object
    ("kinds", :data:`DSO_KINDS`), per (role, kind) ("role_kinds"), "split", the
    busiest threads and the sample count.
    """
    per: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in report.splitlines():
        m = re.match(r"\s*(\d+)\s+(\d+):\S*\s+(.+?)\s*$", line)
        if m:
            per[int(m.group(2))][_kind(m.group(3))] += int(m.group(1))
    total = sum(sum(c.values()) for c in per.values())
    if not total:
        return {"samples": 0}
    roles: collections.Counter = collections.Counter()
    kinds: collections.Counter = collections.Counter()
    both: collections.Counter = collections.Counter()
    split: collections.Counter = collections.Counter()
    threads = []
    for tid, c in per.items():
        n = sum(c.values())
        role = "event loop" if tid == pid else "encode" if c["encode"] >= c["search"] + c["numpy"] else "search"
        roles[role] += n
        kinds.update(c)
        for kind, v in c.items():
            both[f"{role}/{kind}"] += v
            split[SPLIT_OF.get(kind, "os") if role != "event loop" else "http/json"] += v
        threads.append({"tid": tid, "role": role, "share": n / total, "top": c.most_common(3)})
    frac = lambda c: {k: round(v / total, 4) for k, v in c.most_common()}  # noqa: E731
    return {"samples": total, "roles": frac(roles), "kinds": frac(kinds), "role_kinds": frac(both),
            "split": {k: round(split[k] / total, 4) for k in SPLIT}, "threads": sorted(threads, key=lambda t: -t["share"])[:12]}


#: the columns of the profile's "split" (:func:`cpu_profile`) and the DSO kinds in each
SPLIT = ("http/json", "encoder libs", "search kernels", "python", "os")
SPLIT_OF = {"encode": "encoder libs", "search": "search kernels", "numpy": "search kernels", "python": "python",
            "json/http": "python"}


def plot(doc: dict[str, Any], png: Path) -> None:
    """requests/s and p50 / p99 against concurrency, one line per (server, precision)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = iter(("o-", "s--", "^:", "o-.", "s-", "^--"))
    for dtype in doc["settings"]["encoder_dtypes"]:
        for config in CONFIGS:
            cells = [c for c in doc["cells"] if c["config"] == config and c["dtype_asked"] == dtype]
            if not cells:
                continue
            style = next(styles, "x-")
            xs = [c["concurrency"] for c in cells]
            lab = f"{LABELS[config]} [{cells[0]['encoder_dtype']}]"
            a.plot(xs, [c["rps"] for c in cells], style, label=lab)
            b.plot(xs, [c["p50_ms"] for c in cells], style, label=f"{lab} p50")
            b.plot(xs, [c["p99_ms"] for c in cells], style, alpha=0.45, label=f"{lab} p99")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients (closed loop)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
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


def merge_cells(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell from the slices of a cell run in ``--rounds`` interleaved rounds: counts
    summed, requests/s over the summed wall time, percentiles over every latency,
    per-request figures weighted by requests, core figures by wall time; the profile
    of the slice that had one."""
    if len(parts) == 1:
        return parts[0]
    lat = [x for c in parts for x in c["_lat"]]
    errors: dict[str, int] = {}
    for c in parts:
        for k, v in c["errors"].items():
            errors[k] = errors.get(k, 0) + v
    out = dict(parts[0])
    out.update(_latency_summary(lat, errors, sum(c["wall_s"] for c in parts)))
    done = [max(1, c["requests"] + sum(c["errors"].values())) for c in parts]
    walls = [c["wall_s"] for c in parts]

    def avg(key: str, weights: list[float]) -> Any:
        vals = [(c.get(key), w) for c, w in zip(parts, weights) if c.get(key) is not None]
        return sum(v * w for v, w in vals) / sum(w for _, w in vals) if vals else None

    for key in ("server_cpu_ms_per_request", "client_cpu_ms_per_request", "encode_ms_per_request",
                "search_ms_per_request"):
        out[key] = avg(key, done)
    for key in ("machine_busy_cores", "server_cores", "client_cores", "other_cores"):
        out[key] = avg(key, walls)
    out["batches"] = sum(c["batches"] or 0 for c in parts)
    out["mean_batch"] = avg("mean_batch", [c["batches"] or 0 for c in parts])
    for key in ("encode_ms_per_batch", "search_ms_per_batch"):
        out[key] = avg(key, [c["batches"] or 0 for c in parts])
    for key in ("cache_hits", "cache_misses"):
        out[key] = sum(c[key] for c in parts)
    out["load_before"], out["load_after"] = parts[0]["load_before"], parts[-1]["load_after"]
    out["rounds"] = len(parts)
    out["rps_per_round"] = [c["rps"] for c in parts]
    prof = next((c["profile"] for c in parts if c.get("profile")), None)
    out.pop("profile", None)
    if prof is not None:
        out["profile"] = prof
    return out


def _say_cell(say: Any, res: dict[str, Any]) -> None:
    say(f"  {res['rps']:.1f} req/s  p50 {res['p50_ms']:.1f} ms  p99 {res['p99_ms']:.1f} ms  "
        f"mean batch {res['mean_batch'] or 0:.1f}  server CPU {res['server_cpu_ms_per_request']:.2f} ms/req  "
        f"errors {sum(res['errors'].values())}")


def run_dtype(dtype: str, configs: list[str], conc: list[int], work: list[tuple[str, str]], mem: Path,
              args: argparse.Namespace, doc: dict[str, Any], say: Any) -> None:
    """The closed-loop cells of every server configuration at one encoder precision, then
    the open-loop cells of the micro-batching server (appended to ``doc``)."""
    rng = random.Random(0)  # the same requests for every precision
    # every server up at once, cells interleaved per concurrency: a load change on a
    # shared machine then hits the configurations alike
    servers = {config: Server(mem, config, args, cache_size=0, dtype=dtype) for config in configs}
    try:
        for config, srv in servers.items():
            srv.wait_ready()
            doc["server_commands"][f"{config}/{dtype}"] = " ".join(srv.cmd) + (
                f"  (run in {srv.src}: --baseline-ref {args.baseline_ref})" if srv.src != ROOT else "")
            doc.setdefault("encoders_by_server", {})[f"{config}/{dtype}"] = srv.health.get("encoder")
            if config == "batched":  # the default server's encoder at this --encoder-dtype
                doc["encoders"][dtype] = srv.health.get("encoder")
            run_async(drive(srv.base, work[: args.warmup], min(8, args.warmup), args.k, args.client))
        for c in conc:
            n = max(args.requests, 8 * c)
            cell_work = [work[rng.randrange(len(work))] for _ in range(n)]
            parts: dict[str, list] = {config: [] for config in servers}
            # --rounds: each cell in slices, the servers' slices interleaved (A B C A B C ...)
            # so a change of the machine's load hits every server alike
            slice_s = args.seconds / args.rounds if args.seconds else None
            for r in range(args.rounds):
                for config, srv in servers.items():
                    what = f"{slice_s:g} s" if slice_s else f"{n} requests"
                    say(f"[{dtype}] {config} concurrency={c}: {what} (round {r + 1}/{args.rounds})")
                    part = run_cell(srv, cell_work, c, args.k, args.client, seconds=slice_s,
                                    profile=args.profile and c in args.profile_at and r == args.rounds // 2)
                    _say_cell(say, part)
                    parts[config].append(part)
            for config in servers:
                res = merge_cells(parts[config])
                res.update(config=config, dtype_asked=dtype)
                doc["cells"].append(res)
                if args.rounds > 1:
                    say(f"[{dtype}] {config} concurrency={c}, {args.rounds} rounds:")
                    _say_cell(say, res)
        if args.open_loop == "none":
            return
        top = next((cl for cl in doc["cells"] if cl["config"] == "batched" and cl["dtype_asked"] == dtype
                    and cl["concurrency"] == max(conc)), None)
        if args.open_loop == "auto":
            rates = [round(f * top["rps"]) for f in (0.25, 0.5, 0.75)] if top and top["rps"] else []
        else:
            rates = [float(x) for x in args.open_loop.split(",") if x.strip()]
        for rate in rates:  # the same offered rates (and requests) for every server, interleaved
            n = max(64, int(rate * args.open_loop_seconds))
            cell_work = [work[rng.randrange(len(work))] for _ in range(n)]
            for config in args.open_loop_configs:
                say(f"[{dtype}] {config} open loop at {rate} req/s: {n} requests")
                res = run_cell(servers[config], cell_work, 0, args.k, args.client, rate=rate)
                res.update(config=config, dtype_asked=dtype, mode="open-loop")
                doc["open_loop"].append(res)
                _say_cell(say, res)
    finally:
        for srv in servers.values():
            srv.stop()


def main(argv: list[str] | None = None) -> int:
    from rfmem_fast.encoders import DTYPES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="PersonaBench eval_data_v1 folder (default: ../shared/...)")
    p.add_argument("--concurrency", default="1,8,64", help="comma list of concurrent clients")
    p.add_argument("--requests", type=int, default=263, help="requests per cell (at least 8 x concurrency)")
    p.add_argument("--warmup", type=int, default=32, help="untimed requests before each server's cells")
    p.add_argument("--k", type=int, default=10, help="hits per query")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    p.add_argument("--encoder-dtype", default="auto",
                   help=f"comma list of the servers' --encoder-dtype, each run with every configuration (of {DTYPES}; "
                   "default auto, the server's default)")
    p.add_argument("--open-loop", default="auto",
                   help="offered rates (req/s, comma list) of the open-loop cells on the micro-batching server; "
                   "'auto' (default): 25/50/75%% of its rate at the highest concurrency; 'none': skip")
    p.add_argument("--open-loop-seconds", type=float, default=10.0, help="length of one open-loop cell (s)")
    p.add_argument("--repeats", type=int, default=3, help="times each question is asked in the cache workload (0: skip)")
    p.add_argument("--cache-concurrency", type=int, default=64)
    p.add_argument("--configs", default="batched,single,serial", help=f"comma list of {list(CONFIGS)}")
    p.add_argument("--client", choices=("raw", "aiohttp", "httpx"), default="raw",
                   help="load generator: 'raw' (default: keep-alive HTTP/1.1 on asyncio protocols and uvloop, ~0.05 ms "
                   "CPU per request), 'aiohttp' (~0.2 ms) or 'httpx' (~3.6 ms)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/local/serving-<time>.json)")
    p.add_argument("--seconds", type=float, default=None,
                   help="length of each closed-loop cell in seconds (clients cycle their requests); default: "
                   "--requests requests per cell")
    p.add_argument("--rounds", type=int, default=1,
                   help="run each closed-loop cell as this many slices, the servers' slices interleaved, merged "
                   "after (default 1; on a shared machine more rounds spread a load change over every server)")
    p.add_argument("--open-loop-configs", default="batched",
                   help="comma list of the configurations that get the open-loop cells (default batched)")
    p.add_argument("--profile", action="store_true",
                   help="perf record the server during the closed-loop cells of --profile-at clients: CPU per request "
                   "by thread role (event loop / encode / search) and shared object (needs Linux perf)")
    p.add_argument("--profile-at", default="8,64", help="concurrencies profiled with --profile (default 8,64)")
    p.add_argument("--baseline-ref", default=None,
                   help="git commit (e.g. a hash or a branch) whose code runs the 'unpipelined' server (the server "
                   "before), exported with git archive (this checkout's compiled native module copied in); default: "
                   "this checkout with the old options (--no-pipeline --encoder-workers 1 --switch-interval-ms 5 "
                   "--no-fast-path)")
    p.add_argument("--compare-pipeline", action="store_true",
                   help="the server without / with the pipeline: --configs unpipelined,batched,pipeline-2, open loop on all three, "
                   "--profile, --seconds 12 in --rounds 4, --repeats 0 (explicit flags win), "
                   "out bench/results/local/serving-pipeline-<time>.json")
    args = p.parse_args(argv)
    given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--")}
    if args.compare_pipeline:
        defaults = {"--configs": ("configs", ",".join(COMPARE_PIPELINE)), "--seconds": ("seconds", 12.0),
                    "--repeats": ("repeats", 0), "--open-loop-configs": ("open_loop_configs", ",".join(COMPARE_PIPELINE)),
                    "--profile": ("profile", True), "--rounds": ("rounds", 4)}
        for flag, (dest, value) in defaults.items():
            if flag not in given:
                setattr(args, dest, value)
    if args.seconds is not None and not args.seconds > 0:
        p.error(f"--seconds must be > 0, got {args.seconds}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    try:
        args.profile_at = {int(x) for x in args.profile_at.split(",") if x.strip()}
    except ValueError:
        p.error(f"--profile-at must be a comma list of ints, got {args.profile_at!r}")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or "batched" not in configs:
        p.error(f"--configs must include 'batched' and only name {list(CONFIGS)}")
    args.open_loop_configs = [c.strip() for c in args.open_loop_configs.split(",") if c.strip()]
    if any(c not in configs for c in args.open_loop_configs):
        p.error(f"--open-loop-configs must name configurations of --configs {configs}, got {args.open_loop_configs}")
    dtypes = [d.strip() for d in args.encoder_dtype.split(",") if d.strip()]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        p.error(f"--encoder-dtype must be a comma list of {DTYPES}, got {args.encoder_dtype!r}")
    if args.open_loop not in ("auto", "none"):
        try:
            if any(float(x) <= 0 for x in args.open_loop.split(",") if x.strip()):
                raise ValueError
        except ValueError:
            p.error(f"--open-loop must be 'auto', 'none' or a comma list of rates > 0, got {args.open_loop!r}")
    conc = [int(x) for x in args.concurrency.split(",") if x.strip()]
    data = Path(args.data) if args.data else default_personabench_dir()
    if data is None:
        print("PersonaBench not found: pass --data", file=sys.stderr)
        return 2
    stem = "serving-pipeline" if args.compare_pipeline else "serving"
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / "local" / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    tmp = Path(tempfile.mkdtemp(prefix="rfmem-serving-bench-"))
    doc: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": machine_info(), "versions": versions(),
        "load": {"loadavg_start": _loadavg()},
        "settings": {"concurrency": conc, "requests": args.requests, "warmup": args.warmup, "k": args.k,
                     "max_batch": args.max_batch, "max_wait_ms": args.max_wait_ms, "data": str(data),
                     "configs": {c: LABELS[c] for c in configs}, "client": args.client, "encoder_dtypes": dtypes,
                     "open_loop": args.open_loop, "open_loop_seconds": args.open_loop_seconds,
                     "open_loop_configs": args.open_loop_configs, "seconds_per_closed_cell": args.seconds,
                     "rounds": args.rounds,
                     "profile": sorted(args.profile_at) if args.profile else None,
                     "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                     "query": "PersonaBench question text, encoded by the server (all-MiniLM-L6-v2, CPU)",
                     "cache": "off for the batching cells; on for the repeated-question cell",
                     "cpu": "server_cpu_ms_per_request: the server process; client_cpu_ms_per_request: this "
                            "load generator (same cores)"},
        "server_commands": {}, "encoders": {}, "cells": [], "open_loop": [],
    }
    try:
        import importlib.metadata as md

        for dist in ("fastapi", "uvicorn", "uvloop", "httptools", "httpx", "aiohttp", "prometheus-client", "pydantic",
                     "orjson"):
            try:
                doc["versions"][dist] = md.version(dist)
            except md.PackageNotFoundError:
                doc["versions"][dist] = None
        if args.baseline_ref:
            doc["settings"]["baseline"] = export_baseline(args.baseline_ref, tmp / "baseline-src")
            args.baseline_src = tmp / "baseline-src"
            say(f"baseline: {doc['settings']['baseline']} in {args.baseline_src}")
        questions, users, info = build_memory(data, tmp / "mem", say, dump_rows=bool(args.baseline_ref))
        if args.baseline_ref:
            build_baseline_memory(args.baseline_src, tmp / "mem")
        doc["data"] = info
        work = list(zip(questions, users))
        for dtype in dtypes:
            run_dtype(dtype, configs, conc, work, tmp / "mem", args, doc, say)
        if args.repeats > 0:  # repeated questions, cache on
            srv = Server(tmp / "mem", "batched", args, cache_size=4096, dtype=dtypes[0], name="cache")
            try:
                srv.wait_ready()
                rep = [w for w in work for _ in range(args.repeats)]
                random.Random(1).shuffle(rep)
                say(f"cache: {len(rep)} requests ({args.repeats} x {len(work)} questions)")
                res = run_cell(srv, rep, args.cache_concurrency, args.k, args.client)
                lookups = res["cache_hits"] + res["cache_misses"]
                res.update(config="batched", dtype_asked=dtypes[0], repeats=args.repeats,
                           cache_hit_rate=res["cache_hits"] / lookups if lookups else None,
                           cache_hit_rate_ideal=1 - 1 / args.repeats)
                doc["cache_cell"] = res
                say(f"  hit rate {res['cache_hit_rate']:.3f}, {res['rps']:.1f} req/s")
            finally:
                srv.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc["load"]["loadavg_end"] = _loadavg()
    by = {(c["config"], c["dtype_asked"], c["concurrency"]): c for c in doc["cells"]}
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for dtype in dtypes:
        for base_cfg in configs:
            if base_cfg == "batched":
                continue
            for c in conc:
                on, off = by.get(("batched", dtype, c)), by.get((base_cfg, dtype, c))
                if on and off and off["rps"]:
                    ratios.setdefault(dtype, {}).setdefault(base_cfg, {})[str(c)] = on["rps"] / off["rps"]
    doc["rps_ratios_batched_over"] = ratios  # {dtype: {baseline: {concurrency: ratio}}}, same precision
    goal: dict[str, Any] = {}
    for dtype in dtypes:
        top = by.get(("batched", dtype, 64))
        at64 = [r["64"] for r in ratios.get(dtype, {}).values() if "64" in r]
        worst = min(at64) if at64 else None  # against the better one-search-per-request server
        goal[dtype] = {
            "encoder_dtype": doc["encoders"].get(dtype, {}) and doc["encoders"][dtype].get("dtype"),
            "rps_at_64": top["rps"] if top else None,
            "rps_ratio_at_64_vs_best_baseline": worst, "rps_ratio_ge_3": bool(worst and worst >= 3),
            "p99_ms_at_64": top["p99_ms"] if top else None, "p99_lt_200ms": bool(top and top["p99_ms"] < 200),
        }
    doc["goal"] = goal
    for cl in [*doc["cells"], *doc["open_loop"], *([doc["cache_cell"]] if "cache_cell" in doc else [])]:
        cl.pop("_lat", None)
    if "unpipelined" in configs:  # the default server against the one without the pipeline
        pg: dict[str, Any] = {}
        for dtype in dtypes:
            cells = {c: (by.get(("unpipelined", dtype, c)), by.get(("batched", dtype, c))) for c in conc}
            ratio = {str(c): a["rps"] / b["rps"] for c, (b, a) in cells.items() if a and b and b["rps"]}
            a64, a8 = cells.get(64, (None, None))[1], cells.get(8, (None, None))[1]
            pg[dtype] = {
                "rps_ratio_after_over_before": ratio,
                "p99_ms_before": {str(c): b["p99_ms"] for c, (b, a) in cells.items() if b},
                "p99_ms_after": {str(c): a["p99_ms"] for c, (b, a) in cells.items() if a},
                "rps_ratio_64_ge_2": bool(ratio.get("64", 0) >= 2),
                "p99_64_lt_200ms": bool(a64 and a64["p99_ms"] < 200),
                "p99_8_lt_50ms": bool(a8 and a8["p99_ms"] < 50),
            }
        doc["pipeline_goal"] = pg
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    png = out.with_suffix(".png")
    plot(doc, png)
    print(f"wrote {out} and {png}")
    print("| server | precision | clients | req/s | p50 ms | p99 ms | mean batch | encode ms/req | search ms/req | "
          "server CPU ms/req | client CPU ms/req | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cl in sorted(doc["cells"], key=lambda c: (dtypes.index(c["dtype_asked"]), configs.index(c["config"]),
                                                  c["concurrency"])):
        print(f"| {cl['config']} | {cl['encoder_dtype']} | {cl['concurrency']} | {cl['rps']:.1f} | {cl['p50_ms']:.1f} | "
              f"{cl['p99_ms']:.1f} | {cl['mean_batch'] or 0:.1f} | {cl['encode_ms_per_request']:.2f} | "
              f"{cl['search_ms_per_request']:.2f} | {cl['server_cpu_ms_per_request']:.2f} | "
              f"{cl['client_cpu_ms_per_request'] or 0:.2f} | {sum(cl['errors'].values())} |")
    if doc["open_loop"]:
        print("\n| open loop | precision | offered req/s | served req/s | p50 ms | p99 ms | "
              "mean batch | server CPU ms/req | client send lag p99 ms | errors |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for cl in doc["open_loop"]:
            print(f"| {cl['config']} | {cl['encoder_dtype']} | {cl['offered_rps']:.0f} | {cl['rps']:.1f} | {cl['p50_ms']:.1f} | "
                  f"{cl['p99_ms']:.1f} | {cl['mean_batch'] or 0:.1f} | {cl['server_cpu_ms_per_request']:.2f} | "
                  f"{cl['send_lag_p99_ms']:.1f} | {sum(cl['errors'].values())} |")
    profiled = [cl for cl in doc["cells"] if (cl.get("profile") or {}).get("samples")]
    if profiled:
        print("\n| server CPU ms / request | clients | total | " + " | ".join(SPLIT)
              + " | event loop thread | encode threads | search thread |")
        print("|---|---|---|" + "---|" * (len(SPLIT) + 3))
        for cl in profiled:
            pr = cl["profile"]
            roles, split = pr["ms_per_request"], pr["ms_per_request_split"]
            print(f"| {cl['config']} | {cl['concurrency']} | {cl['server_cpu_ms_per_request']:.2f} | "
                  + " | ".join(f"{split.get(k, 0):.2f}" for k in SPLIT)
                  + f" | {roles.get('event loop', 0):.2f} | {roles.get('encode', 0):.2f} | {roles.get('search', 0):.2f} |")
    print(f"req/s ratios (batched / baseline, same precision): {ratios}")
    if doc.get("pipeline_goal"):
        print(f"pipeline goal (default server / --no-pipeline --encoder-workers 1): {doc['pipeline_goal']}")
    print(f"goal: {goal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
