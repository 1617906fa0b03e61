#!/usr/bin/env python3
"""One command for a lent GPU: environment, CUDA build, GPU tests, GPU benchmark.

    python bench/gpu_check.py --out DIR [--budget-s 420] [--pb-pack FILE]
    python bench/gpu_check.py --out DIR --dry-run         # the same code path on the CPU (CI)
    python bench/gpu_check.py --prepare .gpu_carry         # on the CPU machine, before a GPU run

Stages, in order (each in try/except: a failure is recorded and the next stage runs):

1. ``env``: GPU name, driver, CUDA, torch / triton / faiss / cuML / cuVS / cupy versions,
   which optional comparators were found, ``nvidia-smi`` output;
2. ``build``: ``RFMEM_CUDA=ON python setup.py build_ext --inplace`` (C++ CPU kernels and
   csrc/cuda) and the torch extension of the ``cuda`` backend (compiled for this GPU's
   architecture only); the dry run skips it (CI compiles csrc/cuda in
   tests/test_cuda_build.py);
3. ``gpu_tests``: ``pytest -m gpu tests`` (PersonaBench golden parity of the triton, cuda
   and torch-on-CUDA backends, random property cases, device-resident batches and their
   host-sync budget), with the PersonaBench pack of ``--prepare`` when the shared data
   is not beside the checkout;
4. ``bench_latency``, ``bench_multitenant``, ``bench_kmeans``, ``bench_shared``: the
   workloads of :mod:`rfmem_fast.bench.gpu`;
5. ``cuda_suite``: tests/test_triton.py and tests/test_device_resident.py on the GPU
   (compiled Triton kernels), if time is left;
6. ``report``: the goals (:func:`rfmem_fast.bench.gpu.goal_ratios`), PNG plots and a
   markdown summary.

The JSON (``DIR/gpu-check.json``: machine, versions, command, settings, every figure,
the goals, notes, per-stage status and seconds) is rewritten after every stage and after
every bank of the benchmark, so a run killed at any point keeps what it measured.
``--budget-s`` (default 420) bounds the whole run: a stage or cell that would start
after it is skipped and recorded as such; the JSON is still written. Progress lines carry
the elapsed time.
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # a bare checkout (no install): the package next to this script
    sys.path.insert(0, str(ROOT))

#: default PersonaBench pack location (``--prepare`` writes it; ``--pb-pack`` overrides)
DEFAULT_PACK = ROOT / ".gpu_carry" / "personabench_pack.npz"
JSON_NAME = "gpu-check.json"
STAGES = ("env", "build", "gpu_tests", "bench_latency", "bench_multitenant", "bench_kmeans", "bench_shared", "cuda_suite", "report")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpu_check.py",
        description="Environment report, CUDA build, GPU tests and the GPU benchmark of rfmem_fast, in one run.",
    )
    p.add_argument("--out", type=Path, help="folder for gpu-check.json, plots and logs (created)")
    p.add_argument("--budget-s", type=float, default=420.0, help="time budget of the whole run in seconds (default 420)")
    p.add_argument("--dry-run", action="store_true", help="the same code path on the CPU at tiny sizes (CI)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma list of stages to run (default all: {','.join(STAGES)})")
    p.add_argument("--pb-pack", type=Path, default=None, help=f"PersonaBench pack for the golden tests (default {DEFAULT_PACK} when present)")
    p.add_argument("--prepare", type=Path, metavar="DIR", help="write the PersonaBench pack into DIR (run on the CPU machine) and exit")
    p.add_argument("--shared", type=Path, default=None, help="the shared folder (data/, golden/) for --prepare (default ../shared or $RFMEM_SHARED)")
    return p


class Run:
    """State of one gpu_check run: the document, the deadline, the log."""

    def __init__(self, args: argparse.Namespace) -> None:
        from rfmem_fast.bench.gpu import Deadline

        self.args = args
        self.out: Path = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.json_path = self.out / JSON_NAME
        # files that need not come back (junit XML, short checks): the device tool returns at
        # most 8 files from the output folder, kept for the JSON, the summary, 2 plots, 4 logs
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.deadline = Deadline(float(args.budget_s))
        self.doc: dict[str, Any] = {
            "kind": "rfmem_fast gpu_check",
            "dry_run": bool(args.dry_run),
            "command": [sys.executable, *sys.argv],
            "command_line": " ".join(shlex.quote(a) for a in sys.argv),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "budget_s": args.budget_s,
            "status": "running",
            "stages": {},
            "workloads": {},
            "notes": [],
        }

    # ------------------------------------------------------------------ output
    def say(self, msg: str) -> None:
        """A progress line with the elapsed time."""
        print(f"[{time.strftime('%H:%M:%S')} +{self.deadline.elapsed():6.1f}s] {msg}", flush=True)

    def write(self) -> None:
        """Rewrite the JSON document (atomic)."""
        from rfmem_fast.bench.report import write_json

        self.doc["elapsed_s"] = self.deadline.elapsed()
        write_json(self.doc, self.json_path)

    def stage(self, name: str, fn: Callable[[dict[str, Any]], Any], min_s: float = 1.0) -> None:
        """Run a stage: skipped when fewer than ``min_s`` seconds are left; errors recorded."""
        from rfmem_fast.bench.gpu import BudgetExceeded

        rec: dict[str, Any] = {"status": "running"}
        self.doc["stages"][name] = rec
        left = self.deadline.remaining()
        if left < min_s:
            rec.update(status="skipped", reason=f"budget: {left:.0f} s left, stage needs ~{min_s:.0f} s")
            self.say(f"stage {name}: skipped ({rec['reason']})")
            self.write()
            return
        self.say(f"stage {name}: start ({left:.0f} s of budget left)")
        t0 = time.perf_counter()
        try:
            fn(rec)
            rec["status"] = rec.get("status") if rec.get("status") not in ("running", None) else "ok"
        except BudgetExceeded as e:
            rec.update(status="budget", reason=str(e))
            self.doc["notes"].append(f"{name}: {e}")
        except Exception as e:  # noqa: BLE001 - every stage is isolated; the run goes on
            rec.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
            self.say(f"stage {name}: ERROR {type(e).__name__}: {e}")
        rec["seconds"] = time.perf_counter() - t0
        self.say(f"stage {name}: {rec['status']} in {rec['seconds']:.1f} s")
        self.write()

    def _env(self, env: dict[str, str] | None) -> dict[str, str]:
        full = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        full.update(env or {})
        return full

    def _log_path(self, log_name: str) -> Path:
        """DIR/log_name, or a temporary file for a name starting with "tmp/" (not returned)."""
        return self.tmp / log_name[4:] if log_name.startswith("tmp/") else self.out / log_name

    def spawn(self, cmd: list[str], log_name: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, float]:
        """Start a command in the background, its output into DIR/log_name; see :meth:`finish`."""
        self.say(f"$ {' '.join(shlex.quote(c) for c in cmd)}  (background)")
        log = open(self._log_path(log_name), "w", encoding="utf-8")  # noqa: SIM115 - closed by finish()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=self._env(env), stdout=log, stderr=subprocess.STDOUT, text=True)
        proc._log = log  # type: ignore[attr-defined]
        proc._log_name = log_name  # type: ignore[attr-defined]
        return proc, time.perf_counter()

    def finish(self, started: tuple[subprocess.Popen, float], cap_s: float) -> dict[str, Any]:
        """Wait for a :meth:`spawn` ed command: at most min(cap_s from its start, time left); then killed."""
        proc, t0 = started
        timeout = max(5.0, min(cap_s - (time.perf_counter() - t0), self.deadline.remaining()))
        try:
            rc: Any = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = "timeout"
        proc._log.close()  # type: ignore[attr-defined]
        text = self._log_path(proc._log_name).read_text(encoding="utf-8", errors="replace")  # type: ignore[attr-defined]
        return {"cmd": proc.args, "rc": rc, "seconds": time.perf_counter() - t0, "log": proc._log_name, "tail": text[-3000:]}  # type: ignore[attr-defined]

    def subprocess(self, cmd: list[str], log_name: str, cap_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
        """Run a command with a timeout of min(cap_s, time left); its output goes to DIR/log_name."""
        return self.finish(self.spawn(cmd, log_name, env), cap_s)


# --------------------------------------------------------------------------- stages
def _version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _try_import(module: str) -> tuple[Any, str | None]:
    import importlib

    try:
        return importlib.import_module(module), None
    except Exception as e:  # noqa: BLE001 - a broken optional package is reported, not fatal
        return None, f"{type(e).__name__}: {e}"


def stage_env(run: Run, rec: dict[str, Any]) -> None:
    """Machine, GPU, driver, CUDA and library versions; which optional comparators exist."""
    import torch

    from rfmem_fast import __version__
    from rfmem_fast.backends import available
    from rfmem_fast.evaluate import machine_info

    machine = machine_info()
    cuda = torch.cuda.is_available()
    gpu: dict[str, Any] = {"available": cuda}
    if cuda:
        p = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        gpu.update(name=p.name, capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                   total_gib=total / 2**30, free_gib=free / 2**30, torch_cuda=torch.version.cuda)  # fmt: skip
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run([smi], capture_output=True, text=True, timeout=20)
            gpu["nvidia_smi"] = r.stdout[-6000:]
            q = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)  # fmt: skip
            gpu["nvidia_smi_query"] = q.stdout.strip()
            gpu["driver"] = q.stdout.split(",")[1].strip() if q.stdout.count(",") >= 1 else None
        except (OSError, subprocess.SubprocessError) as e:
            gpu["nvidia_smi_error"] = str(e)
    else:
        gpu["nvidia_smi"] = None
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else None)
    if nvcc:
        try:
            gpu["nvcc"] = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[-1]
        except (OSError, subprocess.SubprocessError, IndexError):
            gpu["nvcc"] = nvcc
    found: dict[str, Any] = {}
    faiss, err = _try_import("faiss")
    found["faiss"] = getattr(faiss, "__version__", None) if faiss else None
    found["faiss_gpu"] = bool(faiss and hasattr(faiss, "StandardGpuResources") and cuda and faiss.get_num_gpus() > 0)
    found["faiss_cuvs"] = bool(found["faiss_gpu"] and hasattr(faiss.GpuIndexFlatConfig(), "use_cuvs"))
    if err:
        found["faiss_error"] = err
    for mod, key in (("cuml", "cuml"), ("cuvs", "cuvs"), ("cupy", "cupy")):
        m, err = _try_import(mod)
        found[key] = getattr(m, "__version__", None) if m else None
        if err:
            found[f"{key}_error"] = err[:300]
    versions = {
        "python": platform.python_version(), "rfmem_fast": __version__, "torch": torch.__version__,
        "triton": _version("triton"), "numpy": _version("numpy"), "scikit-learn": _version("scikit-learn"),
        "faiss": found["faiss"], "cuml": found["cuml"], "cuvs": found["cuvs"], "cupy": found["cupy"],
        "pytest": _version("pytest"), "hypothesis": _version("hypothesis"), "matplotlib": _version("matplotlib"),
    }  # fmt: skip
    run.doc.update(machine=machine, gpu=gpu, versions=versions, comparators_found=found, backends_available=available())
    rec.update(gpu=gpu.get("name"), found=found)
    run.say(f"env: {gpu.get('name', 'no GPU')}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"triton {versions['triton']}, faiss {found['faiss']} (gpu {found['faiss_gpu']}), cuml {found['cuml']}")  # fmt: skip


def stage_build(run: Run, rec: dict[str, Any]) -> None:
    """CMake build with RFMEM_CUDA=ON in place, then the cuda backend's torch extension."""
    if run.args.dry_run:
        rec.update(status="skipped", reason="dry run: no GPU; CI compiles csrc/cuda in tests/test_cuda_build.py (nvcc, sm_90)")
        return
    env = {"RFMEM_CUDA": "ON"}
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else None)
    if nvcc and not os.environ.get("CUDACXX"):
        env["CUDACXX"] = nvcc  # CMake finds the CUDA compiler even when it is not on PATH
    # the cuda backend's torch extension compiles in parallel with the CMake build (16 cores)
    code = "from rfmem_fast.backends.cuda_ext import load_extension; m = load_extension(); print('cuda ext', m.__file__)"
    ext = run.spawn([sys.executable, "-c", code], "build-cuda-ext.log")
    r = run.subprocess([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], "build.log", 120, env=env)
    r2 = run.finish(ext, 150)
    rec["setup_py"] = {k: v for k, v in r.items() if k != "tail"} | ({"tail": r["tail"]} if r["rc"] != 0 else {})
    rec["cuda_ext"] = {k: v for k, v in r2.items() if k != "tail"} | ({"tail": r2["tail"]} if r2["rc"] != 0 else {})
    if r["rc"] != 0:
        raise RuntimeError(f"setup.py build_ext (RFMEM_CUDA=ON) failed: rc {r['rc']} (see build.log)")
    native = run.subprocess([sys.executable, "-c", "import rfmem_fast._native as n; print(n.__file__)"], "tmp/build-check.log", 30)
    rec["native_module"] = native["tail"].strip()[-300:]
    if r2["rc"] != 0:
        rec["status"] = "partial"
        run.doc["notes"].append("the cuda backend's torch extension did not build (build-cuda-ext.log); its tests skip or fail")


def _pack_path(run: Run) -> Path | None:
    p = run.args.pb_pack or (DEFAULT_PACK if DEFAULT_PACK.is_file() else None)
    return p if p is not None and Path(p).is_file() else None


def _pytest(run: Run, rec: dict[str, Any], args: list[str], log: str, cap_s: float) -> None:
    env = {}
    pack = _pack_path(run)
    if pack is not None:
        env["RFMEM_PB_PACK"] = str(Path(pack).resolve())
    rec["pb_pack"] = str(pack) if pack else None
    if run.args.dry_run:
        env["TRITON_INTERPRET"] = "1"
    junit = run.tmp / f"{Path(log).stem}.xml"
    # a test module that cannot be imported here (a missing optional package) must not stop the others
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "--continue-on-collection-errors",
           f"--junitxml={junit}", *args]  # fmt: skip
    r = run.subprocess(cmd, log, cap_s, env)
    rec.update({k: v for k, v in r.items()})
    rec["summary"] = _pytest_summary(junit)
    if r["rc"] not in (0, 5):  # 5: nothing collected (no gpu test selected)
        rec["status"] = "failed"
        run.doc["notes"].append(f"{log}: pytest rc {r['rc']}: {rec['summary']}")


def _pytest_summary(junit: Path) -> dict[str, Any] | None:
    """Counts and failing test names from a junit XML file."""
    import xml.etree.ElementTree as ET

    if not junit.is_file():
        return None
    try:
        root = ET.parse(junit).getroot()
    except ET.ParseError:
        return None
    suites = [root] if root.tag == "testsuite" else list(root)
    out = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    out["failed"] = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s if c.find("failure") is not None or c.find("error") is not None][:50]
    return out


def stage_gpu_tests(run: Run, rec: dict[str, Any]) -> None:
    """``pytest -m gpu tests``: golden parity on the GPU backends, property cases, device-resident batches."""
    # the dry run collects only the files holding gpu tests (collecting the whole suite takes ~30 s here)
    where = ["tests/test_gpu.py"] if run.args.dry_run else ["tests"]
    _pytest(run, rec, ["-m", "gpu", *where], "gpu-tests.log", 150)


def stage_cuda_suite(run: Run, rec: dict[str, Any]) -> None:
    """The Triton and device-resident test files on the GPU (compiled kernels)."""
    if run.args.dry_run:
        rec.update(status="skipped", reason="dry run: CI runs these files under the interpreter already")
        return
    _pytest(run, rec, ["tests/test_triton.py", "tests/test_device_resident.py"], "cuda-suite.log", 150)


def _settings(run: Run):
    """The benchmark's settings: the target sizes on a GPU, tiny ones in the dry run."""
    import torch

    from rfmem_fast.backends import available
    from rfmem_fast.bench.gpu import GpuBenchSettings
    from rfmem_fast.bench.workloads import SyntheticSpec

    if run.args.dry_run:  # the Triton interpreter runs a program per second or so: few, tiny triton cells
        return GpuBenchSettings(
            device="cpu", backends=["torch", "triton"], spec=SyntheticSpec(dim=32), warmup=1,
            scales=[8 * 1024, 16 * 1024], chunk_tokens=256, latency_queries=3, latency_modes=["dense", "rfmem"],
            multitenant=[(6, 48), (12, 24)], mt_batches=[8, 24], dtypes=["float32", "float16"], faiss_batch=8,
            shared_sizes=[600, 1200], batch_sizes=[1, 8, 64], kmeans_problems=[16], cell_budget_s=2.0, repeats=1, memory_budget=None,
            workload_backends={"latency": ["torch", "triton"], "multitenant": ["torch"], "shared": ["torch"], "kmeans": ["torch", "triton"]},
        )  # fmt: skip
    names = [b for b in ("triton", "torch", "cuda") if b in available()] if torch.cuda.is_available() else ["torch"]
    return GpuBenchSettings(device="cuda" if torch.cuda.is_available() else "cpu", backends=names)


def _bench(run: Run, name: str) -> Callable[[dict[str, Any]], None]:
    def go(rec: dict[str, Any]) -> None:
        from rfmem_fast.bench.gpu import GpuBench

        if "settings" not in run.doc:
            run.doc["settings"] = run._settings.to_dict()
        bench = GpuBench(run._settings, run.deadline, say=run.say, checkpoint=run.write)
        out: dict[str, Any] = {}
        run.doc["workloads"][name] = out
        try:
            getattr(bench, name)(out)
        finally:
            out.setdefault("notes", []).extend(bench.notes)
            run.doc["notes"].extend(f"{name}: {n}" for n in bench.notes)
            rec["notes"] = bench.notes

    return go


def stage_report(run: Run, rec: dict[str, Any]) -> None:
    """Goals, plots and a markdown summary."""
    from rfmem_fast.bench.gpu import goal_ratios, plot_doc

    ours = list(run._settings.backends)
    run.doc["goals"] = goal_ratios(run.doc["workloads"], ours)
    try:
        from rfmem_fast.bench.plots import write_plots

        rec["plots"] = [str(p) for p in write_plots(plot_doc(run.doc), run.json_path)]
    except ImportError as e:
        rec["plots"] = []
        run.doc["notes"].append(f"no plots: {e}")
    md = run.out / "gpu-check.md"
    md.write_text(markdown(run.doc), encoding="utf-8")
    rec["markdown"] = str(md)


def markdown(doc: dict[str, Any]) -> str:
    """A short markdown summary of a gpu_check document (goals, stages, key tables)."""
    lines = [f"# gpu_check {'(dry run) ' if doc.get('dry_run') else ''}{doc.get('started', '')}", ""]
    g = doc.get("gpu") or {}
    v = doc.get("versions") or {}
    lines.append(f"GPU: {g.get('name', 'none')}, driver {g.get('driver')}, torch {v.get('torch')} (CUDA {g.get('torch_cuda')}), "
                 f"triton {v.get('triton')}, faiss {v.get('faiss')}, cuml {v.get('cuml')}")  # fmt: skip
    lines += ["", "| stage | status | s |", "|---|---|---|"]
    for name, st in (doc.get("stages") or {}).items():
        lines.append(f"| {name} | {st.get('status')} | {st.get('seconds', 0):.1f} |")
    lines += ["", "| goal | value | goal | met | per backend |", "|---|---|---|---|---|"]
    for name, gl in (doc.get("goals") or {}).items():
        per = ", ".join(f"{b} {x:.4g}" for b, x in (gl.get("per_backend") or {}).items() if x is not None)
        val = gl.get("value")
        lines.append(f"| {name} | {'-' if val is None else f'{val:.4g}'} | {gl.get('goal')} | {gl.get('meets_goal')} | {per or gl.get('pending', '')} |")
    lat = (doc.get("workloads") or {}).get("latency") or {}
    if lat.get("scales"):
        lines += ["", "| system | mode | " + " | ".join(f"{s['scale']} p50 / p99 ms" for s in lat["scales"]) + " |",
                  "|---|---|" + "---|" * len(lat["scales"])]  # fmt: skip
        keys = []
        for s in lat["scales"]:
            for r in s["results"]:
                if (r["system"], r["mode"]) not in keys:
                    keys.append((r["system"], r["mode"]))
        for sy, mo in keys:
            cells = []
            for s in lat["scales"]:
                r = next((r for r in s["results"] if r["system"] == sy and r["mode"] == mo), None)
                cells.append("-" if not r or r.get("p50_ms") is None else f"{r['p50_ms']:.3f} / {r['p99_ms']:.3f}")
            lines.append(f"| {sy} | {mo} | " + " | ".join(cells) + " |")
    mt = (doc.get("workloads") or {}).get("multitenant") or {}
    for bk in mt.get("banks", []):
        if not bk.get("results"):
            continue
        lines += ["", f"Multi-tenant {bk['users']} x {bk['items']} {bk['dtype']}:", "", "| system | mode | batch | q/s |", "|---|---|---|---|"]
        for r in bk["results"]:
            lines.append(f"| {r['system']} | {r['mode']} | {r.get('batch_size')} | {r['qps']:,.0f} |" if r.get("qps") else f"| {r['system']} | {r['mode']} | {r.get('batch_size')} | {r.get('error', '-')} |")
    sh = (doc.get("workloads") or {}).get("shared") or {}
    for sz in sh.get("sizes", []):
        bss = sh.get("batch_sizes", [])
        lines += ["", f"Shared bank of {sz['n']:,} vectors, queries per second:", "",
                  "| system | mode | " + " | ".join(f"batch {b}" for b in bss) + " |", "|---|---|" + "---|" * len(bss)]  # fmt: skip
        keys = list(dict.fromkeys((r["system"], r["mode"]) for r in sz["results"]))
        for sy, mo in keys:
            cells = []
            for b in bss:
                r = next((r for r in sz["results"] if r["system"] == sy and r["mode"] == mo and r["batch_size"] == b), {})
                cells.append(f"{r['qps']:,.0f}" if r.get("qps") else ("skipped" if r.get("skipped") else ("error" if r.get("error") else "-")))
            lines.append(f"| {sy} | {mo} | " + " | ".join(cells) + " |")
    km = (doc.get("workloads") or {}).get("kmeans") or {}
    for e in km.get("problems", []):
        lines += ["", f"KMeans, {e['m']:,} problems of {km.get('points')} points, {km.get('clusters')} clusters:", "",
                  "| system | how | total ms | us per problem |", "|---|---|---|---|"]  # fmt: skip
        for r in e["results"]:
            if r.get("total_s") is not None:
                lines.append(f"| {r['system']} | {r.get('how', '')} | {1e3 * r['total_s']:.2f} | {r['per_problem_us']:.1f} |")
            else:
                lines.append(f"| {r['system']} | - | {r.get('error', '-')} | - |")
    notes = doc.get("notes") or []
    if notes:
        lines += ["", "Notes:", ""] + [f"* {n}" for n in notes[:60]]
    return "\n".join(lines) + "\n"


def prepare(args: argparse.Namespace) -> int:
    """Write the PersonaBench pack (embedded chunks and questions + golden file) into a folder."""
    from rfmem_fast.bench.workloads import write_personabench_pack

    shared = args.shared or (Path(os.environ["RFMEM_SHARED"]) if os.environ.get("RFMEM_SHARED") else ROOT.parent / "shared")
    data = shared / "data" / "personabench" / "eval_data_v1"
    golden = shared / "golden" / "personabench_noise0.0.jsonl"
    for p in (data, golden):
        if not p.exists():
            print(f"gpu_check --prepare: {p} not found (pass --shared DIR)", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    path = write_personabench_pack(Path(args.prepare) / DEFAULT_PACK.name, data, golden)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns 0 when every stage ran (even if some recorded failures), 2 on bad usage."""
    args = _parser().parse_args(argv)
    if args.prepare is not None:
        return prepare(args)
    if args.out is None:
        _parser().error("--out DIR is required (or --prepare DIR)")
    if args.dry_run:
        # the Triton interpreter must be chosen before triton's first import in this process
        os.environ["TRITON_INTERPRET"] = "1"
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        _parser().error(f"unknown stage(s) {bad}; choose from {', '.join(STAGES)}")
    import torch

    if torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        # one architecture, the same in every process of the run: the cuda backend's torch
        # extension is compiled once (build stage) and loaded from torch's cache afterwards
        p = torch.cuda.get_device_properties(0)
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{p.major}.{p.minor}"
    run = Run(args)
    run.write()
    run._settings = _settings(run)
    plan: list[tuple[str, Callable[[dict[str, Any]], None], float]] = [
        ("env", lambda rec: stage_env(run, rec), 0.0),
        ("build", lambda rec: stage_build(run, rec), 30.0),
        ("gpu_tests", lambda rec: stage_gpu_tests(run, rec), 20.0),
        ("bench_latency", _bench(run, "latency"), 5.0),
        ("bench_multitenant", _bench(run, "multitenant"), 5.0),
        ("bench_kmeans", _bench(run, "kmeans"), 5.0),
        ("bench_shared", _bench(run, "shared"), 5.0),
        ("cuda_suite", lambda rec: stage_cuda_suite(run, rec), 30.0),
        ("report", lambda rec: stage_report(run, rec), -1e9),  # always: it writes what was measured
    ]
    for name, fn, min_s in plan:
        if name in stages or name == "report":
            run.stage(name, fn, min_s=min_s)
    run.doc["status"] = "complete"
    run.write()
    shutil.rmtree(run.tmp, ignore_errors=True)
    bad_stages = {k: v.get("status") for k, v in run.doc["stages"].items() if v.get("status") not in ("ok", "skipped")}
    run.say(f"done in {run.deadline.elapsed():.0f} s; {run.json_path}; stages not ok: {bad_stages or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
