"""bench/bench_startup.py without the model loads: the JSON it writes (machine, versions,
command, the checkout run, every run with its load averages, the medians), its option
checks, and the CPU accounting of a child process read from /proc. The measured runs
themselves start real servers (minutes): their figures are in docs/benchmarks/serving.md, "Start-up time"."""
from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("bench_startup", ROOT / "bench" / "bench_startup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_startup_writes_every_run_and_the_medians(tmp_path, monkeypatch):
    mod = _load()
    built: list[tuple[Path, int]] = []
    monkeypatch.setattr(mod, "build_memory", lambda code, dest, items: (dest.mkdir(), built.append((code, items))))
    monkeypatch.setattr(mod, "_versions", lambda code: {"rfmem_fast": "x"})
    figures = {"memory": [3.0, 1.0, 2.0], "serve": [5.0, 7.0, 6.0], "mcp": [2.5, 0.5, 1.5]}
    seen: dict[str, list[Path]] = {k: [] for k in figures}

    def runner(kind):
        def run(code, path, env):
            assert path.is_dir() and env == {"OMP_WAIT_POLICY": "PASSIVE"}
            seen[kind].append(path)
            i = len(seen[kind]) - 1
            return {"first_search_s": figures[kind][i], "first_search_cpu_s": None if i == 1 else 1.0,
                    "second_search_ms": 10.0 * (i + 1), "hits": 5}
        return run

    monkeypatch.setattr(mod, "RUNNERS", {k: runner(k) for k in figures})
    out = tmp_path / "s.json"
    assert mod.main(["--repeats", "3", "--items", "7", "--omp-wait-policy", "PASSIVE", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert built == [(ROOT.resolve(), 7)] and all(len(set(v)) == 3 for v in seen.values())  # a fresh copy per run
    assert doc["command"].startswith("python bench/bench_startup.py --repeats 3")
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["cpu"] and doc["versions"] == {"rfmem_fast": "x"}
    assert doc["code"]["path"] == str(ROOT.resolve()) and doc["workload"]["items"] == 7
    for kind, values in figures.items():
        runs = doc["runs"][kind]
        assert [r["first_search_s"] for r in runs] == values
        assert all(len(r["loadavg_before"]) == 3 and len(r["loadavg_after"]) == 3 for r in runs)
        assert doc["median"][kind]["first_search_s"] == statistics.median(values)
        assert doc["median"][kind]["second_search_ms"] == 20.0
        assert "first_search_cpu_s" not in doc["median"][kind]  # not measured in every run: no median
    with pytest.raises(SystemExit):
        mod.main(["--kinds", "memory,http"])


def test_proc_cpu_counts_a_childs_threads_and_survives_exec():
    """A child burns 0.3 s of CPU, re-executes itself (as the servers do for
    OMP_WAIT_POLICY), burns 0.3 s more in a thread: /proc gives >= 0.6 s, by pid and as
    this process's child (execve keeps the count)."""
    mod = _load()
    if mod.proc_cpu_s(1) is None:
        pytest.skip("no /proc")
    spin = ("import time\n"
            "def spin():\n"
            "    t = time.process_time()\n"
            "    while time.process_time() - t < 0.3: pass\n")
    after = spin + ("import sys, threading\n"
                    "th = threading.Thread(target=spin); th.start(); th.join()\n"
                    "print('ready', flush=True); sys.stdin.readline()\n")
    before = spin + f"import os, sys\nspin()\nos.execv(sys.executable, [sys.executable, '-c', {after!r}])\n"
    proc = subprocess.Popen([sys.executable, "-c", before], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert 0.6 <= mod.proc_cpu_s(proc.pid) < 60
        assert mod.children_cpu_s() >= 0.6
    finally:
        proc.stdin.write("\n")
        proc.stdin.close()
        proc.wait(30)
    assert mod.proc_cpu_s(proc.pid) is None  # gone
