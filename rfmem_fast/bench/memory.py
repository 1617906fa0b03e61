"""Peak-memory measurement of one search in a fresh process.

:func:`measure` runs ``python -m rfmem_fast.bench.memory`` in a subprocess: it builds a
seeded workload and then, for each backend asked for, warms the path up on a few
queries, resets the process's peak RSS (``/proc/self/clear_refs`` 5, Linux), runs ONE
``search`` and reports the growth of ``VmHWM`` over the RSS before the call (the call's
peak working set), the wall time and a spot check of the results against the exact
top-k. Used by ``bench/bench_memory.py``
(the large sizes) and ``tests/test_memory_budget.py`` (small budgets).

Scenarios (d = 32 unless given):

* ``long_user``: one user with ``items`` items, ``queries`` queries, mode dense;
* ``many_users``: ``users`` users sharing ``items`` items, mode dense;
* ``recollection``: one user, mode recollection.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

SCENARIOS = ("long_user", "many_users", "recollection")


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def _peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _backend(spec: str, budget: int | None) -> Any:
    """``native``, ``reference`` or ``torch[:strategy]`` with the given memory budget."""
    from ..backends.base import DEFAULT_MEMORY_BUDGET

    budget = DEFAULT_MEMORY_BUDGET if budget is None else budget
    name, _, strategy = spec.partition(":")
    if name == "native":
        from ..backends.native import NativeBackend

        return NativeBackend(num_threads=1, memory_budget=budget)
    if name == "reference":
        from ..backends.reference import ReferenceBackend

        return ReferenceBackend(memory_budget=budget)
    if name == "torch":
        from ..backends.torch_backend import TorchBackend

        return TorchBackend("cpu", memory_budget=budget, topk_strategy=strategy or "auto")
    raise ValueError(f"backend must be native, reference or torch[:auto|per_user|gather], got {spec!r}")


def _child(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from .. import MemoryBank, RFMemConfig, search

    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    n, d, b = args.items, args.dim, args.queries
    X = rng.normal(size=(n, d)).astype(np.float32)
    if args.scenario == "many_users":
        bank = MemoryBank.from_arrays(X, np.linspace(0, n, args.users + 1).astype(np.int64))
        seg = rng.integers(0, args.users, size=b)
    else:
        bank = MemoryBank.from_arrays(X, [0, n])
        seg = np.zeros(b, dtype=np.int64)
    keys = bank.snapshot().users
    names = [keys[s] for s in seg]
    Q = rng.normal(size=(b, d)).astype(np.float32)
    mode = "recollection" if args.scenario == "recollection" else "dense"
    cfg = RFMemConfig()
    out = []
    for spec in args.backend.split(","):
        be = _backend(spec, args.budget)
        search(bank, Q[:4], names[:4], cfg, mode=mode, backend=be)  # warm-up: imports, caches
        r0 = _rss()
        Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from the current RSS
        t = time.perf_counter()
        res = search(bank, Q, names, cfg, mode=mode, backend=be)
        seconds = time.perf_counter() - t
        growth = _peak() - r0
        ok = True
        if mode == "dense":  # spot check against the exact top-k (float64 scores, rounded once)
            snap = bank.snapshot()
            for i in rng.integers(0, b, size=5):
                a, e = snap.offsets[seg[i]], snap.offsets[seg[i] + 1]
                q = (Q[i] / np.linalg.norm(Q[i].astype(np.float64))).astype(np.float32)
                s = (snap.vectors[a:e].astype(np.float64) @ q.astype(np.float64)).astype(np.float32)
                ok &= res.rows[i].tolist() == (np.argsort(-s, kind="stable")[: cfg.out_k] + a).tolist()
        else:
            ok = bool((res.rows >= 0).any())
        del res
        out.append({"backend": spec, "growth_bytes": int(growth), "seconds": seconds, "correct": bool(ok),
                    "budget_bytes": be.memory_budget})  # fmt: skip
    return out


def measure(
    scenario: str,
    backends: list[str],
    *,
    items: int,
    queries: int,
    dim: int = 32,
    users: int = 1,
    budget: int | None = None,
    seed: int = 0,
    timeout: float = 3600,
) -> list[dict[str, Any]]:
    """Peak RSS growth of one ``search`` per backend, in one fresh process (module docstring).

    Args:
        scenario: one of :data:`SCENARIOS`.
        backends: each "native", "reference", "torch", "torch:per_user" or "torch:gather".
        items: bank rows (all users together); queries: batch size; dim: d.
        users: users of the "many_users" scenario.
        budget: the backend's ``memory_budget`` in bytes (None: the default).
        seed: data seed.
        timeout: seconds before the child is killed.

    Returns:
        one dict per backend: backend, growth_bytes, seconds, correct, budget_bytes and
        the sizes.

    Raises:
        ValueError: unknown scenario.
        RuntimeError: the child failed (its stderr in the message).
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {SCENARIOS}, got {scenario!r}")
    cmd = [sys.executable, "-m", "rfmem_fast.bench.memory", scenario, ",".join(backends), "--items", str(items),
           "--queries", str(queries), "--dim", str(dim), "--users", str(users), "--seed", str(seed)]  # fmt: skip
    if budget is not None:
        cmd += ["--budget", str(budget)]
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"memory child {scenario}/{backends} failed: {proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in out:
        r.update(scenario=scenario, items=items, queries=queries, dim=dim, users=users)
    return out


def main(argv: list[str] | None = None) -> int:
    """The child process: measure one search and print one JSON line."""
    p = argparse.ArgumentParser(description="peak RSS growth of one search (child of measure())")
    p.add_argument("scenario", choices=SCENARIOS)
    p.add_argument("backend", help="comma-separated backends")
    p.add_argument("--items", type=int, required=True)
    p.add_argument("--queries", type=int, required=True)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--users", type=int, default=1)
    p.add_argument("--budget", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    print(json.dumps(_child(p.parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
