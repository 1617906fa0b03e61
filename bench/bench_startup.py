"""Time to first answer of the three ways to run a memory, each in a fresh process.

* ``memory``: ``python -c`` that imports rfmem_fast, opens ``Memory(DIR)`` (its default
  encoder: torch float32, loaded on first use) and searches it once, then once more;
* ``serve``: ``python -m rfmem_fast.cli serve --path DIR --no-auth`` (its defaults: the
  ``auto`` encoder rule); the first 200 from ``GET /health`` (polled every 20 ms with
  httpx; any answer other than 200 before it is recorded: the server must not accept
  before its memory is ready) and the first ``POST /v1/users/{user}/search`` (text);
* ``mcp``: ``python -m rfmem_fast.cli mcp --transport stdio --user USER --data-dir DIR``
  started by the official ``mcp`` SDK's ``stdio_client``: ``initialize`` answered, the
  first ``tools/list``, and the first ``search_memories`` answered (the tool waits for
  the encoder's load).

Every ``*_s`` figure is seconds from the moment the process is spawned (wall clock, so
the interpreter's own start, the imports and, unless ``OMP_WAIT_POLICY`` is set, the
servers' one re-execution with ``OMP_WAIT_POLICY=PASSIVE`` are inside); each ``*_cpu_s``
beside it is the CPU time the process had used by then (user + system, all threads, from
/proc: the re-execution keeps the count), which a loaded machine changes far less than
the wall clock. The memory
directory (``--items`` short texts of one user, written once with the default encoder)
is copied afresh for every run. The kinds run one after the other, ``--repeats`` rounds
interleaved (a change of the machine's load hits them alike); the JSON holds every run,
the medians, the machine (CPU model, cores), the versions, the exact command, the
checkout run (``--code``: another checkout's ``rfmem_fast``, e.g. an older
commit; its git commit is recorded) and the load average before / after each run.

    python bench/bench_startup.py                                   # ~2-4 min on 2 cores
    python bench/bench_startup.py --code /path/to/old/checkout --out bench/results/local/startup-old.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("memory", "serve", "mcp")
USER = "alice"
QUERY = "Where did I move in 2021?"

#: the child of the ``memory`` kind: wall-clock times (time.time()) after each stage, as JSON
MEMORY_CHILD = """
import json, sys, time
from rfmem_fast import Memory
t_import = time.time()
mem = Memory(sys.argv[1])
t_open = time.time()
hits = mem.search(sys.argv[2], sys.argv[3], k=5)
t_first, cpu_first = time.time(), time.process_time()
mem.search(sys.argv[2] + " again", sys.argv[3], k=5)
t_second = time.time()
info = mem.encoder_info()
mem.close()
print(json.dumps({"import": t_import, "open": t_open, "first_search": t_first, "second_search": t_second,
                  "first_search_cpu": cpu_first, "hits": len(hits), "encoder": info}))
"""


def _texts(n: int) -> list[str]:
    """``n`` short, distinct first-person facts (seeded)."""
    import random

    rng = random.Random(0)
    places = ["Lyon", "Oslo", "Kyoto", "Porto", "Quito", "Accra", "Hanoi", "Perth"]
    things = ["the cello", "chess", "climbing", "pottery", "the violin", "tennis", "baking", "Go"]
    people = ["Ana", "Ben", "Chloe", "Dev", "Eli", "Fay", "Gus", "Hana"]
    out = ["I moved to Lyon in 2021."]
    while len(out) < n:
        out.append(rng.choice([
            f"I visited {rng.choice(places)} in {rng.randint(1990, 2025)}.",
            f"I started {rng.choice(things)} when I was {rng.randint(5, 60)}.",
            f"My friend {rng.choice(people)} lives in {rng.choice(places)} ({len(out)}).",
        ]))
    return out


def build_memory(code: Path, dest: Path, items: int) -> None:
    """A Memory directory holding ``items`` texts of USER, written by ``code``'s rfmem_fast."""
    script = ("import sys; from rfmem_fast import Memory\n"
              "m = Memory(sys.argv[1]); m.add(sys.argv[3:], sys.argv[2]); m.close()")
    subprocess.run([sys.executable, "-c", script, str(dest), USER, *_texts(items)], check=True,
                   env=_env(code, {}), cwd=code, stdout=subprocess.DEVNULL)


def _env(code: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "PYTHONPATH")}
    env.update(PYTHONPATH=str(code), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **extra)
    return env


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_memory(code: Path, path: Path, extra_env: dict[str, str]) -> dict[str, Any]:
    t0 = time.time()
    out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(path), QUERY, USER], capture_output=True,
                         text=True, env=_env(code, extra_env), cwd=code, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"memory child failed: {out.stderr[-2000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return {"import_s": got["import"] - t0, "open_s": got["open"] - t0, "first_search_s": got["first_search"] - t0,
            "first_search_cpu_s": got["first_search_cpu"],
            "second_search_ms": 1e3 * (got["second_search"] - got["first_search"]), "hits": got["hits"],
            "encoder": got["encoder"]}


def run_serve(code: Path, path: Path, extra_env: dict[str, str]) -> dict[str, Any]:
    import httpx

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "rfmem_fast.cli", "serve", "--path", str(path), "--no-auth", "--port", str(port),
           "--log-level", "warning"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=_env(code, extra_env), cwd=code, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    early: list[int] = []  # answers other than 200 before the first 200
    try:
        with httpx.Client(timeout=30.0) as client:
            health = None
            while health is None:
                if proc.poll() is not None:
                    raise RuntimeError(f"rfmem serve exited: {proc.stderr.read().decode()[-2000:]}")
                if time.time() - t0 > 600:
                    raise RuntimeError("rfmem serve did not answer /health in 600 s")
                try:
                    r = client.get(f"{base}/health")
                except httpx.TransportError:
                    time.sleep(0.02)
                    continue
                if r.status_code == 200:
                    health = r.json()
                else:
                    early.append(r.status_code)
            t_health, cpu_health = time.time(), proc_cpu_s(proc.pid)
            r = client.post(f"{base}/v1/users/{USER}/search", json={"query": QUERY, "k": 5})
            t_search, cpu_search = time.time(), proc_cpu_s(proc.pid)
            r.raise_for_status()
            hits = len(r.json()["hits"])
            t1 = time.time()
            client.post(f"{base}/v1/users/{USER}/search", json={"query": QUERY + " again", "k": 5}).raise_for_status()
            second = time.time() - t1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    return {"health_200_s": t_health - t0, "health_200_cpu_s": cpu_health, "first_search_s": t_search - t0,
            "first_search_cpu_s": cpu_search, "second_search_ms": 1e3 * second,
            "hits": hits, "answers_before_ready": early, "encoder": health["encoder"]}


def run_mcp(code: Path, path: Path, extra_env: dict[str, str]) -> dict[str, Any]:
    import anyio
    from mcp import ClientSession, StdioServerParameters, stdio_client

    params = StdioServerParameters(
        command=sys.executable, cwd=str(code), env=_env(code, extra_env),
        args=["-m", "rfmem_fast.cli", "mcp", "--transport", "stdio", "--user", USER, "--data-dir", str(path)])
    res: dict[str, Any] = {}

    async def session() -> None:
        with anyio.fail_after(600):
            t0 = time.time()
            async with stdio_client(params) as (read, write):
                async with ClientSession(read, write) as s:
                    await s.initialize()
                    res["initialize_s"], res["initialize_cpu_s"] = time.time() - t0, children_cpu_s()
                    await s.list_tools()
                    res["tools_list_s"] = time.time() - t0
                    r = await s.call_tool("search_memories", {"query": QUERY, "k": 5})
                    res["first_search_s"], res["first_search_cpu_s"] = time.time() - t0, children_cpu_s()
                    if r.is_error:
                        raise RuntimeError(f"search_memories failed: {r.content[0].text}")
                    res["hits"] = len(r.structured_content["hits"])
                    t1 = time.time()
                    await s.call_tool("search_memories", {"query": QUERY + " again", "k": 5})
                    res["second_search_ms"] = 1e3 * (time.time() - t1)

    anyio.run(session)
    return res


def proc_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, every thread) process ``pid`` has used, from
    /proc/PID/stat; None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def children_cpu_s() -> float | None:
    """CPU seconds used by this process's live children (the server ``stdio_client``
    started), summed; None without /proc."""
    me, total, seen = str(os.getpid()), 0.0, False
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
        except OSError:
            continue
        if ppid == me:
            cpu = proc_cpu_s(int(pid))
            if cpu is not None:
                total, seen = total + cpu, True
    return total if seen else None


RUNNERS = {"memory": run_memory, "serve": run_serve, "mcp": run_mcp}


def _git_commit(code: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(code), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _versions(code: Path) -> dict[str, Any]:
    script = ("import json, importlib.metadata as m, platform, rfmem_fast, torch, numpy\n"
              "out = {'python': platform.python_version(), 'rfmem_fast': rfmem_fast.__version__,"
              " 'torch': torch.__version__, 'numpy': numpy.__version__}\n"
              "for d in ('sentence-transformers', 'transformers', 'onnxruntime', 'onnx', 'mcp', 'fastapi', 'uvicorn',"
              " 'httpx'):\n"
              "    try: out[d] = m.version(d)\n"
              "    except m.PackageNotFoundError: out[d] = None\n"
              "print(json.dumps(out))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(code, {}),
                         cwd=code, check=True)
    return json.loads(out.stdout)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def summarise(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The median of every numeric ``*_s`` / ``*_ms`` figure over ``runs``."""
    keys = [k for k in runs[0] if k.endswith(("_s", "_ms")) and all(isinstance(r.get(k), (int, float)) for r in runs)]
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma list of {KINDS} (default: all)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds (each kind once per round; default 3)")
    ap.add_argument("--items", type=int, default=200, help="texts in the memory (default 200)")
    ap.add_argument("--code", type=Path, default=ROOT,
                    help="the checkout whose rfmem_fast the processes run (default: this one)")
    ap.add_argument("--omp-wait-policy", default=None,
                    help="OMP_WAIT_POLICY of the processes (default: unset, as a user starts them)")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON file (default bench/results/local/startup-<cpu>.json)")
    args = ap.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or any(k not in KINDS for k in kinds):
        ap.error(f"--kinds takes a comma list of {KINDS}, got {args.kinds!r}")
    if args.repeats < 1 or args.items < 1:
        ap.error("--repeats and --items must be >= 1")
    code = args.code.resolve()
    extra = {} if args.omp_wait_policy is None else {"OMP_WAIT_POLICY": args.omp_wait_policy}
    cpu = _cpu_model()
    out = args.out or ROOT / "bench" / "results" / "local" / (
        "startup-" + "".join(c if c.isalnum() else "-" for c in cpu.lower()).strip("-")[:40] + ".json")
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="rfmem-startup-") as tmp:
        seed = Path(tmp) / "seed"
        print(f"building a memory of {args.items} texts with {code}", file=sys.stderr)
        build_memory(code, seed, args.items)
        for r in range(args.repeats):
            for kind in kinds:
                path = Path(tmp) / f"{kind}-{r}"
                shutil.copytree(seed, path)
                before = _loadavg()
                res = RUNNERS[kind](code, path, extra)
                res.update(loadavg_before=before, loadavg_after=_loadavg())
                runs[kind].append(res)
                shutil.rmtree(path, ignore_errors=True)
                print(f"round {r + 1}/{args.repeats} {kind}: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in res.items()
                                  if k.endswith(("_s", "_ms")) and isinstance(v, (int, float))),
                      file=sys.stderr)
    doc = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]) if argv is None
        else " ".join(["python", "bench/bench_startup.py", *argv]),
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform()},
        "versions": _versions(code),
        "code": {"path": str(code), "git_commit": _git_commit(code)},
        "workload": {"items": args.items, "user": USER, "query": QUERY, "repeats": args.repeats,
                     "omp_wait_policy": args.omp_wait_policy or "unset (the servers re-execute once with PASSIVE)"},
        "median": {k: summarise(v) for k, v in runs.items()},
        "runs": runs,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(doc["median"], indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
