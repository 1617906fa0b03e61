"""Scale-out benchmark: a multi-tenant batch through ShardedMemory with 1, 2, 4 shards.

Workload: U users x n items of seeded clustered unit vectors (``rfmem_fast.bench.workloads``,
default 2,000 x 256, d = 384), one batch of B queries (default 4,096), each against a
random user's memory (half near an item, half near a centre, so RF-Mem takes both
paths). In ONE run, on the same bank and batch:

* the single-process ``search`` in this process, with 1 thread and with all threads
  (the baselines);
* ``ShardedMemory`` with each shard count of ``--shards`` on a local Ray cluster (one
  actor per shard, ``--cpus-per-shard`` CPUs and as many torch / OpenMP threads each;
  the cluster gets ``max(shards) * cpus-per-shard`` logical CPUs, so on a machine with
  fewer cores the larger counts oversubscribe it, which the JSON records);

for each mode of ``--modes``: queries per second (best and median of ``--repeats`` timed
batches after one warm-up), the p50 latency of a one-query dense batch (the fixed cost of
a call: for the sharded runs, Ray's task round trip), the fraction of queries whose ids equal the single
process's (must be 1.0), the bytes the driver ships per query (float32 query out, the
pickled per-shard result back) and the driver's gather time per batch.

Usage::

    python bench/bench_distributed.py [--users 2000] [--items 256] [--batch 4096]
        [--shards 1,2,4] [--modes dense,rfmem] [--backend native] [--out FILE]

Writes ``bench/results/local/distributed-<timestamp>.json`` (machine, versions, load before
and during the run, the exact command, every figure) and a PNG beside it (queries per
second against shards, one line per mode, the single-process figures as dashed lines).
"""
from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch / OpenMP start (see README)

import numpy as np
import torch

import rfmem_fast
from rfmem_fast import RFMemConfig, search
from rfmem_fast.bench.cli import _cpu_seconds, _loadavg, _other_cores, versions
from rfmem_fast.bench.report import write_json
from rfmem_fast.bench.workloads import SyntheticSpec, check_memory, synthetic_bank
from rfmem_fast.distributed.gather import gather_results
from rfmem_fast.evaluate import machine_info

ROOT = Path(__file__).resolve().parent


def _csv_ints(text: str) -> list[int]:
    out = [int(x) for x in text.split(",") if x.strip()]
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of ints >= 1, got {text!r}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=2000, help="users U (default 2000)")
    p.add_argument("--items", type=int, default=256, help="items per user n (default 256)")
    p.add_argument("--dim", type=int, default=384, help="dimension d (default 384)")
    p.add_argument("--batch", type=int, default=4096, help="queries per batch B (default 4096)")
    p.add_argument("--shards", type=_csv_ints, default=[1, 2, 4], help="shard counts (default 1,2,4)")
    p.add_argument("--modes", default="dense,rfmem", help="modes (default dense,rfmem)")
    p.add_argument("--backend", default="native" if "native" in rfmem_fast.available_backends() else "torch")
    p.add_argument("--cpus-per-shard", type=int, default=1, help="CPUs (and threads) per shard actor (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed batches per cell after one warm-up (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/local/distributed-<ts>.json)")
    a = p.parse_args(argv)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in a.modes:
        if m not in rfmem_fast.MODES:
            p.error(f"--modes: unknown mode {m!r} (choose from {rfmem_fast.MODES})")
    for name in ("users", "items", "dim", "batch", "cpus_per_shard", "repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return a


def timed(fn, repeats: int) -> tuple[list[float], Any]:
    """One warm-up call, then ``repeats`` timed calls; returns (seconds per call, last output)."""
    out = fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return times, out


def cell(times: list[float], b: int) -> dict[str, float]:
    return {
        "qps_best": b / min(times),
        "qps_median": b / float(np.median(times)),
        "batch_s_best": min(times),
        "batch_s_median": float(np.median(times)),
        "batch_s": times,
    }


def agreement(a, b) -> float:
    return float(np.mean([list(x) == list(y) for x, y in zip(a.ids, b.ids)]))


def shipped_bytes(mem, Q: np.ndarray, users: list, mode: str, config: RFMemConfig, backend: str) -> dict[str, float]:
    """Bytes the driver ships per query: float32 queries out, pickled per-shard results back,
    and the driver's gather time (measured on the parts of one batch)."""
    from rfmem_fast.distributed.sharding import shards_of

    _, owner = shards_of(users, mem.num_shards)
    parts, back = [], 0
    for s in np.unique(owner):
        idx = np.flatnonzero(owner == s)
        res = mem.search(Q[idx], [users[i] for i in idx], config=config, mode=mode, backend=backend)
        back += len(pickle.dumps(res, protocol=5))
        parts.append((idx, res))
    t = time.perf_counter()
    gather_results(len(users), parts)
    gather_s = time.perf_counter() - t
    b = len(users)
    return {"query_bytes_out": Q.shape[1] * 4, "result_bytes_back": back / b, "gather_s_per_batch": gather_s}


def plot(doc: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for i, mode in enumerate(doc["settings"]["modes"]):
        color = f"C{i}"
        xs = [r["shards"] for r in doc["sharded"] if r["mode"] == mode]
        ys = [r["qps_best"] for r in doc["sharded"] if r["mode"] == mode]
        ax.plot(xs, ys, "o-", color=color, label=f"ShardedMemory {mode}")
        for ls, key in ((":", "threads_1"), ("--", "threads_all")):
            base = doc["single_process"][mode][key]
            ax.axhline(base["qps_best"], ls=ls, color=color, lw=1, label=f"one process {mode}, {base['threads']} thread(s)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(doc["settings"]["shards"])
    ax.set_xticklabels([str(s) for s in doc["settings"]["shards"]])
    ax.set_yscale("log")
    ax.set_xlabel("shards (Ray actors)")
    ax.set_ylabel("queries per second (best batch)")
    s = doc["settings"]
    ax.set_title(
        f"{s['users']} users x {s['items']} items, batch {s['batch']}, {s['backend']}\n"
        f"{doc['machine']['cores']} cores, load {doc['load']['loadavg_before']}",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    import ray

    from rfmem_fast.distributed import ShardedMemory

    cpu0 = _cpu_seconds()
    time.sleep(2.0)
    other_before = _other_cores(cpu0, _cpu_seconds())
    load_before = _loadavg()
    n_rows = a.users * a.items
    bank_bytes = n_rows * a.dim * 4
    check_memory(3 * bank_bytes + (1 << 30), f"--users {a.users} --items {a.items} --dim {a.dim} (bank, shard copies)")
    t0 = time.perf_counter()
    syn = synthetic_bank(a.users, a.items, SyntheticSpec(dim=a.dim), seed=a.seed)
    Q, uidx, _ = syn.queries(a.batch, seed=a.seed + 1)
    users = [syn.users[i] for i in uidx]
    config = RFMemConfig()
    print(f"bank: {a.users} users x {a.items} items x d={a.dim} ({bank_bytes / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f} s")

    # single-process baselines
    all_threads = torch.get_num_threads()
    single: dict[str, dict] = {}
    reference: dict[str, Any] = {}
    for mode in a.modes:
        single[mode] = {}
        for key, th in (("threads_1", 1), ("threads_all", all_threads)):
            torch.set_num_threads(th)
            times, res = timed(lambda: search(syn.bank, Q, users, config=config, mode=mode, backend=a.backend), a.repeats)
            single[mode][key] = {"threads": th, **cell(times, a.batch)}
            lat, _ = timed(lambda: search(syn.bank, Q[:1], users[:1], config=config, mode="dense", backend=a.backend), 20)
            single[mode][key]["one_query_dense_ms_p50"] = float(np.median(lat)) * 1e3
            reference[mode] = res
            print(f"one process  {mode:>12} threads={th}: {single[mode][key]['qps_best']:,.0f} q/s")
    torch.set_num_threads(all_threads)

    max_cpus = max(a.shards) * a.cpus_per_shard
    if a.address is None:
        ray.init(num_cpus=max_cpus, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=a.address, log_to_driver=False)
    cpu1 = _cpu_seconds()
    rows = []
    for n in a.shards:
        t = time.perf_counter()
        mem = ShardedMemory.from_bank(
            syn.bank, n, backend=a.backend, num_cpus=a.cpus_per_shard, threads_per_shard=a.cpus_per_shard
        )
        start_s = time.perf_counter() - t
        try:
            for mode in a.modes:
                times, res = timed(lambda: mem.search(Q, users, config=config, mode=mode), a.repeats)
                row = {
                    "shards": n, "mode": mode, **cell(times, a.batch), "start_and_load_s": start_s,
                    "agree_with_single_process": agreement(res, reference[mode]),
                    **shipped_bytes(mem, Q, users, mode, config, a.backend),
                }  # fmt: skip
                lat, _ = timed(lambda: mem.search(Q[:1], users[:1], config=config, mode="dense"), 20)
                row["one_query_dense_ms_p50"] = float(np.median(lat)) * 1e3  # the per-call overhead
                base = single[mode]
                row["vs_one_process_1_thread"] = row["qps_best"] / base["threads_1"]["qps_best"]
                row["vs_one_process_all_threads"] = row["qps_best"] / base["threads_all"]["qps_best"]
                rows.append(row)
                print(
                    f"{n} shard(s)   {mode:>12}: {row['qps_best']:,.0f} q/s  (x{row['vs_one_process_1_thread']:.2f} of 1 thread,"
                    f" x{row['vs_one_process_all_threads']:.2f} of {all_threads}); agree {row['agree_with_single_process']:.3f};"
                    f" {row['result_bytes_back']:.0f} B/query back, gather {row['gather_s_per_batch'] * 1e3:.1f} ms"
                )
        finally:
            mem.close()
    other_during = _other_cores(cpu1, _cpu_seconds())
    ray.shutdown()
    for r in rows:  # scaling against the 1-shard run of the same mode
        one = next((x for x in rows if x["mode"] == r["mode"] and x["shards"] == min(a.shards)), None)
        r["speedup_vs_fewest_shards"] = r["qps_best"] / one["qps_best"] if one else None

    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = a.out or ROOT / "results" / "local" / f"distributed-{stamp}.json"
    doc = {
        "benchmark": "bench_distributed",
        "command": [sys.executable, *sys.argv],
        "machine": machine_info(),
        "versions": {**versions(), "ray": ray.__version__},
        "load": {
            "loadavg_before": load_before,
            "other_processes_cores_before": other_before,
            "loadavg_after": _loadavg(),
            "cores_busy_outside_driver_during_sharded_runs": other_during,
            "note": "during the sharded runs the shard actors are other processes: that figure includes them",
        },
        "settings": {
            "users": a.users, "items": a.items, "dim": a.dim, "batch": a.batch, "shards": a.shards,
            "modes": a.modes, "backend": a.backend, "cpus_per_shard": a.cpus_per_shard,
            "ray_logical_cpus": max_cpus, "repeats": a.repeats, "seed": a.seed, "bank_bytes": bank_bytes,
            "driver_torch_threads": all_threads, "address": a.address,
        },  # fmt: skip
        "single_process": single,
        "sharded": rows,
    }
    write_json(doc, out)
    png = plot(doc, out.with_suffix(".png"))
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
