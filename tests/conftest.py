"""Shared fixtures: the PersonaBench data embedded once per test session, the golden file."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

# One intra-op thread unless the caller chose (set before numpy / torch load, inherited by
# the subprocesses tests start): most tests run many small ops, which OpenMP threads make
# slower on 2 shared cores (the suite: 341 s with the default threads, ~310 s with one);
# tests of threading set their threads explicitly (tests/test_threads.py and others).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
from _shared import shared_dir
from hypothesis import settings

# Property tests are deterministic (derandomized, no example database): the suite is
# seeded end to end and gives the same verdict on every run.
settings.register_profile("rfmem", derandomize=True, database=None, deadline=None)
settings.load_profile("rfmem")

from rfmem_fast import MemoryBank


@dataclass
class EmbeddedPB:
    """PersonaBench (noise 0.0) embedded with the offline MiniLM encoder."""

    bank: MemoryBank
    queries: np.ndarray  # float32 [263, 384]
    users: list  # user key per question
    questions: list  # PBQuestion per row
    golden: list  # golden dict per row, same order


def _pack() -> dict | None:
    """The PersonaBench pack named by $RFMEM_PB_PACK (bench/gpu_check.py --prepare), if any:
    a machine without the shared data or the encoder (a lent GPU) runs the golden tests from it."""
    path = _pack_path()
    if not path:
        return None
    if "pack" not in _PACK:
        from rfmem_fast.bench.workloads import read_personabench_pack

        _PACK["pack"] = read_personabench_pack(path)
    return _PACK["pack"]


_PACK: dict = {}


def _pack_path() -> str:
    """$RFMEM_PB_PACK, or "" when unset."""
    return os.environ.get("RFMEM_PB_PACK", "")


def xdist_worker(config) -> str:
    """This process's pytest-xdist worker id ("gw0", ...), "" when the suite runs in one
    process (the README's command runs two workers: ``-n 2``). Read off the config, not the
    environment: a pytest that a test starts inherits $PYTEST_XDIST_WORKER but is no worker."""
    return getattr(config, "workerinput", {}).get("workerid", "")


@pytest.fixture(scope="session", autouse=True)
def int8_copy_on_small_banks():
    """The int8 scan copy read on banks of any size (the engine reads it from
    INT8_MIN_ROWS rows per queried segment, where it pays): the suite's small int8 banks
    exercise the int8 kernels; tests/test_int8_scan.py checks the rule itself."""
    try:
        from rfmem_fast import _native
    except ImportError:  # a build without the native module
        yield
        return
    _native.set_int8_min_rows(0)
    yield
    _native.set_int8_min_rows(-1)


@pytest.fixture(scope="session")
def golden_rows() -> list[dict]:
    pack = _pack()
    if pack is not None:
        return pack["golden"]
    shared = shared_dir()
    path = shared / "golden" / "personabench_noise0.0.jsonl" if shared else None
    if path is None or not path.is_file():
        pytest.skip("golden file absent (set RFMEM_SHARED or place shared/ beside the checkout)")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")
def pb_cache_dir(request, tmp_path_factory):
    """Embedding cache of this test session: PersonaBench is encoded once (by
    pb_embedded) and every later CLI / evaluation test reads it with --cache-dir.
    ``$RFMEM_TEST_EMBEDDINGS`` names a folder kept between sessions instead."""
    import os
    from pathlib import Path

    keep = os.environ.get("RFMEM_TEST_EMBEDDINGS")
    if keep:
        return Path(keep)
    if xdist_worker(request.config):  # one folder for every worker of this run (the parent of theirs): encoded once
        return _pb_shared_cache(request.config)
    return tmp_path_factory.mktemp("embeddings")


@pytest.fixture(scope="session")
def pb_embedded(golden_rows, pb_cache_dir) -> EmbeddedPB:
    pack = _pack()
    if pack is not None:
        by_key = {(g["community"], g["q_id"]): g for g in golden_rows}
        gold = [by_key[(q.community, q.q_id)] for q in pack["questions"]]
        return EmbeddedPB(pack["bank"], pack["queries"], pack["users"], pack["questions"], gold)
    from rfmem_fast.datasets.embedded import personabench_embeddings

    from filelock import FileLock

    # under pytest-xdist the first worker encodes, the others wait and read its cache file
    with FileLock(str(pb_cache_dir / "encode.lock")):
        emb = personabench_embeddings(shared_dir() / "data" / "personabench" / "eval_data_v1", 0.0, cache_dir=pb_cache_dir)
    data = emb.data
    by_key = {(g["community"], g["q_id"]): g for g in golden_rows}
    gold = [by_key[(q.community, q.q_id)] for q in data.questions]
    return EmbeddedPB(emb.bank, emb.Q, [q.user_key for q in data.questions], data.questions, gold)


@pytest.fixture(scope="session")
def text_encoder():
    """The offline MiniLM encoder as the serving layer's default builds it (loaded once)."""
    from rfmem_fast.serving.memory import _default_encoder

    return _default_encoder()


# ---------------------------------------------------------------------------- early subprocess suites
#: Self-contained suites that run in their own interpreter, started as soon as collection
#: is done so that they use the second core while this process runs the rest (the suite is
#: single-threaded: OMP_NUM_THREADS above). name -> (Popen, output file).
EARLY: dict = {}
TRITON_CHILD_ENV = "RFMEM_TRITON_TEST_CHILD"


def _triton_child_wanted(items) -> bool:
    """tests/test_triton.py must run in a fresh interpreter on a CPU-only machine (Triton binds
    to its interpreter only at its first import, and sentence-transformers imports it
    compiled): True when its runner test is selected and this is not that child."""
    import importlib.util

    if os.environ.get(TRITON_CHILD_ENV) == "1" or importlib.util.find_spec("triton") is None:
        return False
    import torch

    if torch.cuda.is_available():  # compiled kernels on the GPU: the module runs in process
        return False
    return any(it.nodeid.endswith("test_triton.py::test_module_in_a_fresh_interpreter") for it in items)


def _start_early(name: str, argv: list, env: dict, cwd) -> None:
    """Start ``argv`` now, its stdout and stderr into a temporary file: EARLY[name]."""
    import subprocess
    import tempfile

    out = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, cwd=cwd)
    EARLY[name] = (proc, out)


def early_result(name: str, timeout: float = 900) -> tuple[int, str] | None:
    """(exit code, output) of the early job ``name`` (waiting for it), or None when none was started."""
    if name not in EARLY:
        return None
    import subprocess

    proc, out = EARLY[name]
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    out.seek(0)
    return rc, out.read()


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only jobs of selected tests start
def pytest_collection_modifyitems(session, config, items):
    import sys
    import tempfile
    from pathlib import Path

    here = Path(__file__).resolve().parent
    worker = xdist_worker(config)
    if worker:  # every worker collects every test: the tests start their own jobs, on their worker
        waits = set()
        if _pb_encode_wanted(items):
            if worker == "gw0" and "pb_encode" not in EARLY:
                _start_early("pb_encode", [sys.executable, "-c", _PB_ENCODE, str(_pb_shared_cache(config))],
                             dict(os.environ), here.parent)  # fmt: skip
            waits = {it.path for it in items if "pb_embedded" in getattr(it, "fixturenames", ())}
        # the files that wait for that job last, the longest files first within each part (the
        # same order in every worker, as xdist needs; its loadfile scheduler hands out files in order)
        items.sort(key=lambda it: (it.path in waits, it.path.name not in LONG_FILES))
        return
    if _triton_child_wanted(items) and "triton" not in EARLY:
        env = dict(os.environ, TRITON_INTERPRET="1", **{TRITON_CHILD_ENV: "1"})
        _start_early("triton", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here / "test_triton.py")],
                     env, here.parent)  # fmt: skip
    dry = "test_gpu_check_dryrun.py::test_gpu_check_dry_run_runs_every_stage"
    if any(it.nodeid.endswith(dry) for it in items) and "gpu_dry_run" not in EARLY and os.environ.get(TRITON_CHILD_ENV) != "1":
        import importlib.util

        if importlib.util.find_spec("triton") is not None:
            out_dir = tempfile.mkdtemp(prefix="rfmem-gpu-dry-")
            env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RFMEM_PB_PACK")}
            _start_early("gpu_dry_run", [sys.executable, str(here.parent / "bench" / "gpu_check.py"), "--dry-run", "--out", out_dir],
                         env, here.parent)  # fmt: skip
            EARLY_DIRS["gpu_dry_run"] = out_dir


#: the test files that take longest (30-100 s each on 2 cores: the Triton interpreter's
#: subprocess, Ray's cluster, the ONNX exports, the reference backend over PersonaBench)
LONG_FILES = frozenset({"test_triton.py", "test_distributed_ray.py", "test_encoders.py",
                        "test_parity_personabench.py", "test_mcp_server.py", "test_bench_smoke.py"})

#: the early job that encodes PersonaBench into the cache folder argv[1] under its lock (the
#: workers' pb_embedded then read the cache file; if the job fails they encode themselves)
_PB_ENCODE = """
import sys
from pathlib import Path
from filelock import FileLock
sys.path.insert(0, "tests")
from _shared import shared_dir
from rfmem_fast.datasets.embedded import personabench_embeddings
cache = Path(sys.argv[1])
with FileLock(str(cache / "encode.lock")):
    personabench_embeddings(shared_dir() / "data" / "personabench" / "eval_data_v1", 0.0, cache_dir=cache)
"""


def _pb_shared_cache(config) -> "os.PathLike":
    """The embedding cache folder the pytest-xdist workers of this run share (pb_cache_dir)."""
    shared = config._tmp_path_factory.getbasetemp().parent / "embeddings"
    shared.mkdir(exist_ok=True)
    return shared


def _pb_encode_wanted(items) -> bool:
    """Whether a selected test embeds PersonaBench from the shared data (no pack, no kept cache)."""
    if _pack_path() or os.environ.get("RFMEM_TEST_EMBEDDINGS") or shared_dir() is None:
        return False
    return any("pb_embedded" in getattr(it, "fixturenames", ()) for it in items)


#: output folders of early jobs (removed at the end of the session)
EARLY_DIRS: dict = {}


def pytest_sessionfinish(session, exitstatus):
    import shutil

    for proc, out in EARLY.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()
    EARLY.clear()
    for d in EARLY_DIRS.values():
        shutil.rmtree(d, ignore_errors=True)
    EARLY_DIRS.clear()

