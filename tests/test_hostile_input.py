"""Hostile input catalogue: every bad input gets a clear, named error, never a crash.

| input | where | result |
|---|---|---|
| NaN / +-Inf | add, update, queries | ValueError "holds NaN or Inf" |
| finite float64 beyond float32 | add, queries | ValueError "beyond the float32 range" |
| zero (or < 1e-12 norm) vector | add, update, queries | ValueError "zero norm" |
| wrong d, 1-D, 3-D, scalar, ragged lists | add, update, queries | ValueError naming the argument |
| int / bool / complex / object / str dtype | add, update, queries | TypeError "floating" |
| float16, bfloat16 (torch), big-endian, Fortran order, grad tensors | everywhere | accepted |
| out_k / probe_k <= 0, > 2**20, bool, float | RFMemConfig | ValueError / TypeError naming the field |
| huge out_k / probe_k (10**6) over a small bank | search | padded result, bounded memory |
| empty ids, duplicate ids, bool / float / None ids | add, update, delete | ValueError / TypeError |
| "" as an id or a text | add | valid ("" is a text distinct from None) |
| bool / float / None user keys | add, search | TypeError (never silently user 1) |
| 10**6 queries in one batch | search | chunked (max_batch), bounded memory |
| hand-edited store | load | StoreError (tests/test_store.py) |
| mutated PersonaBench JSON | load_personabench | ValueError / FileNotFoundError / KeyError |
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rfmem_fast
from rfmem_fast import MemoryBank, RFMemConfig, search
from rfmem_fast.datasets import load_personabench

CPU_BACKENDS = [b for b in rfmem_fast.available_backends() if b in ("reference", "torch", "native")]
MODES = ["dense", "recollection", "rfmem"]
ROOT = Path(__file__).resolve().parents[1]


def small_bank() -> MemoryBank:
    rng = np.random.default_rng(0)
    bank = MemoryBank(4)
    bank.add("a", rng.normal(size=(5, 4)), ["a0", "a1", "a2", "a3", "a4"])
    bank.add(1, rng.normal(size=(3, 4)), [0, 1, 2])
    return bank


BAD_MATRICES = [
    (np.array([[1.0, np.nan, 0, 0]]), ValueError, "NaN or Inf"),
    (np.array([[1.0, np.inf, 0, 0]]), ValueError, "NaN or Inf"),
    (np.array([[-np.inf, 0, 0, 0]], np.float16), ValueError, "NaN or Inf"),
    (np.array([[1e39, 1.0, 0, 0]]), ValueError, "float32 range"),
    (np.zeros((1, 4)), ValueError, "zero norm"),
    (np.full((1, 4), 1e-30), ValueError, "zero norm"),
    (np.ones((1, 5)), ValueError, "dimension 4"),
    (np.ones(4), ValueError, "2-D"),
    (np.ones((1, 1, 4)), ValueError, "2-D"),
    (np.float64(1.0), ValueError, "2-D"),
    ([[1.0, 0.0, 0.0, 0.0], [1.0]], ValueError, "2-D"),
    (np.ones((1, 4), np.int64), TypeError, "floating"),
    (np.ones((1, 4), bool), TypeError, "floating"),
    (np.ones((1, 4), np.complex64), TypeError, "floating"),
    (np.array([[1.0, "x", 0, 0]], dtype=object), TypeError, "floating"),
    ([["a", "b", "c", "d"]], TypeError, "floating"),
    (torch.full((1, 4), float("nan")), ValueError, "NaN or Inf"),
    (torch.ones(1, 4, dtype=torch.int32), TypeError, "floating"),
    (None, TypeError, "floating"),
]


@pytest.mark.parametrize("x, exc, match", BAD_MATRICES)
def test_bad_vectors_in_add_update_and_queries(x, exc, match):
    bank = small_bank()
    snap, version = bank.snapshot(), bank.version
    with pytest.raises(exc, match=match) as info:
        bank.add("a", x, ["new"])
    assert "vectors" in str(info.value)
    with pytest.raises(exc, match=match):
        bank.update("a", ["a0"], x)
    with pytest.raises(exc, match=match) as info:
        search(bank, x, ["a"])
    assert "queries" in str(info.value)
    assert bank.version == version and bank.snapshot() is snap  # nothing written


@pytest.mark.parametrize(
    "x",
    [
        np.ones((1, 4), np.float16),
        torch.ones(1, 4, dtype=torch.bfloat16),
        torch.ones(1, 4, requires_grad=True),
        np.ones((1, 4), dtype=">f4"),
        np.asfortranarray(np.ones((2, 4)))[:1],
        np.ones((4, 8))[::4, ::2],
        [[1.0, 2.0, 3.0, 4.0]],
    ],
)
def test_accepted_vector_forms(x):
    bank = small_bank()
    bank.add("b", x, ["x"])
    np.testing.assert_allclose(np.linalg.norm(bank.snapshot().vectors[-1]), 1.0, atol=1e-6)
    res = search(bank, x, ["b"], mode="dense")
    assert res.ids_list(0) == ["x"]
    np.testing.assert_allclose(res.scores[0, 0], 1.0, atol=1e-6)


@pytest.mark.parametrize(
    "field, value, exc",
    [
        ("out_k", 0, ValueError), ("out_k", -1, ValueError), ("out_k", 2**20 + 1, ValueError),
        ("probe_k", 0, ValueError), ("probe_k", -5, ValueError), ("probe_k", 2**21, ValueError),
        ("out_k", True, TypeError), ("probe_k", 2.0, TypeError), ("out_k", None, TypeError),
    ],
)
def test_k_out_of_range_is_refused(field, value, exc):
    with pytest.raises(exc, match=f"RFMemConfig.{field}"):
        RFMemConfig(**{field: value})


def test_max_batch_is_checked():
    bank = small_bank()
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="max_batch"):
            search(bank, np.ones((1, 4)), ["a"], max_batch=bad)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_huge_k_gives_padded_results(backend, mode):
    bank = small_bank()
    Q = np.random.default_rng(1).normal(size=(3, 4))
    users = ["a", 1, "a"]
    big = RFMemConfig(out_k=10**6, probe_k=10**6, score_floor=-1.0)
    exact = RFMemConfig(out_k=5, probe_k=5, score_floor=-1.0)
    r_big = search(bank, Q, users, big, mode=mode, backend=backend)
    r_ref = search(bank, Q, users, exact, mode=mode, backend=backend)
    assert r_big.ids.shape == (3, 10**6) and r_big.probe_ids.shape == (3, 10**6)
    assert r_big.ids[:, :5].tolist() == r_ref.ids.tolist()
    np.testing.assert_array_equal(r_big.scores[:, :5], r_ref.scores)
    np.testing.assert_array_equal(r_big.probe_scores[:, :5], r_ref.probe_scores)
    assert (r_big.rows[:, 5:] == -1).all() and np.isneginf(r_big.scores[:, 5:]).all()
    assert all(x is None for x in r_big.ids[:, 5:].ravel()[:1000])
    np.testing.assert_array_equal(r_big.mean, r_ref.mean)
    np.testing.assert_array_equal(r_big.entropy, r_ref.entropy)
    assert r_big.route.tolist() == r_ref.route.tolist()


@pytest.mark.parametrize(
    "ids, n, exc, match",
    [
        ([], 1, ValueError, "ids has 0 entries"),
        ([], 0, ValueError, "at least one row"),
        (["a", "a"], 2, ValueError, "duplicate item id 'a'"),
        ([1, np.int64(1)], 2, ValueError, "duplicate item id 1"),
        ([True], 1, TypeError, "str or int"),
        ([1.0], 1, TypeError, "str or int"),
        ([None], 1, TypeError, "str or int"),
        ([b"x"], 1, TypeError, "str or int"),
        ([("t",)], 1, TypeError, "str or int"),
        ("ab", 2, TypeError, "sequence"),
        (5, 1, TypeError, "sequence"),
        (["a0"], 1, ValueError, "already holds item id 'a0'"),
    ],
)
def test_bad_ids(ids, n, exc, match):
    bank = small_bank()
    with pytest.raises(exc, match=match):
        bank.add("a", np.ones((n, 4)), ids)
    assert bank.user_size("a") == 5


def test_empty_string_ids_and_texts_are_valid():
    bank = small_bank()
    bank.add("a", np.ones((3, 4)), ["", "1", 5], texts=["", None, "text"])
    assert bank.item_ids_of("a")[-3:] == ["", "1", 5]
    assert bank.texts_of("a")[-3:] == ["", None, "text"]
    bank.add("a", np.ones((1, 4)), [1])  # int 1 next to str "1": different ids
    res = search(bank, np.ones((1, 4)), ["a"], RFMemConfig(out_k=4, probe_k=4), mode="dense")
    assert set(res.ids_list(0)) == {"", "1", 5, 1}
    with pytest.raises(TypeError, match="texts"):
        bank.add("a", np.ones((1, 4)), ["t"], texts="one string")
    with pytest.raises(TypeError, match="texts"):
        bank.add("a", np.ones((1, 4)), ["t"], texts=[b"bytes"])
    with pytest.raises(ValueError, match="texts has 2"):
        bank.add("a", np.ones((1, 4)), ["t"], texts=["x", "y"])


def test_user_keys_are_never_coerced():
    bank = small_bank()  # holds users "a" and 1
    for bad in (True, np.True_, 1.0, None, [1]):
        with pytest.raises(TypeError, match=r"users\[0\]"):
            search(bank, np.ones((1, 4)), [bad])
        with pytest.raises(TypeError, match="user"):
            bank.add(bad, np.ones((1, 4)), ["z"])
    with pytest.raises(KeyError, match=r"users\[1\]: unknown user 'b'"):
        search(bank, np.ones((2, 4)), ["a", "b"])
    with pytest.raises(KeyError, match="unknown user '1'"):
        search(bank, np.ones((1, 4)), ["1"])  # str "1" is not int 1
    res = search(bank, np.ones((2, 4)), [np.int64(1), np.str_("a")], mode="dense")
    assert res.ids_list(0)[0] in (0, 1, 2) and str(res.ids_list(1)[0]).startswith("a")


# --------------------------------------------------------------------------- memory-bounded runs
_MEM_CHILD = textwrap.dedent(
    """
    import json, resource, sys, time
    from pathlib import Path
    import torch
    torch.set_num_threads(1)  # see the test's docstring
    sys.path.insert(0, {root!r})
    import numpy as np
    from rfmem_fast import MemoryBank, RFMemConfig, search
    import rfmem_fast

    def rss():
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()

    def peak():
        # VmHWM belongs to this process's address space; ru_maxrss would carry the
        # parent's (pytest's) peak across fork + exec
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    rng = np.random.default_rng(0)
    bank = MemoryBank(8)
    for u in range(4):
        bank.add(u, rng.normal(size=(6, 8)), ["%d:%d" % (u, i) for i in range(6)])
    out = {{}}
    if sys.argv[1] == "batch":
        b = 10**6
        Q = rng.normal(size=(b, 8)).astype(np.float32)
        users = (np.arange(b) % 4).tolist()
        search(bank, Q[:10], users[:10], mode="dense", backend="torch")
        r0 = rss()
        t = time.perf_counter()
        res = search(bank, Q, users, mode="dense", backend="torch")
        out["seconds"] = time.perf_counter() - t
        out["peak_growth"] = peak() - r0
        out["result_bytes"] = sum(getattr(res, f).nbytes for f in ("ids", "rows", "scores", "route", "mean", "entropy", "rule", "rounds", "probe_ids", "probe_scores", "dense_scores", "lexical_scores", "context_scores"))
        # spot-check against brute force
        snap = bank.snapshot()
        ok = True
        for i in rng.integers(0, b, size=200):
            u = users[i]
            a, c = snap.offsets[u], snap.offsets[u + 1]
            q = Q[i] / np.linalg.norm(Q[i])
            order = np.argsort(-(snap.vectors[a:c] @ q), kind="stable")
            ok &= res.ids_list(int(i)) == [snap.item_ids[a + j] for j in order]
        out["correct"] = bool(ok)
    else:
        backends = [x for x in rfmem_fast.available_backends() if x in ("reference", "torch", "native")]
        Q = rng.normal(size=(4, 8))
        cfg = RFMemConfig(out_k=10**6, probe_k=10**6)
        for be in backends:  # warm-up: imports (scikit-learn) and caches are not the point
            for mode in ("dense", "recollection", "rfmem"):
                search(bank, Q, [0, 1, 2, 3], mode=mode, backend=be)
        r0 = rss()
        t = time.perf_counter()
        for be in backends:
            for mode in ("dense", "recollection", "rfmem"):
                res = search(bank, Q, [0, 1, 2, 3], cfg, mode=mode, backend=be)
                out["result_bytes"] = sum(getattr(res, f).nbytes for f in ("ids", "rows", "scores", "probe_ids", "probe_scores", "dense_scores", "lexical_scores", "context_scores"))
                del res
        out["seconds"] = time.perf_counter() - t
        out["peak_growth"] = peak() - r0
    print(json.dumps(out))
    """
)


def _mem_child(kind: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _MEM_CHILD.format(root=str(ROOT)), kind],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc (Linux)")
def test_million_query_batch_is_chunked_with_bounded_memory():
    """10**6 queries (d=8) over a tiny bank, dense, torch backend, in a fresh process.

    The run is chunked (``max_batch`` 8192): the peak RSS grows by the result arrays
    (about 370 MB of ids / rows / scores for 10**6 x 10) plus a bounded per-chunk
    working set; unchunked, the torch backend's float64 re-scoring alone would take
    several GB. torch runs single-threaded here: on a small shared machine OpenMP
    barriers under CPU oversubscription, not the work, dominate small per-chunk ops.
    """
    out = _mem_child("batch")
    assert out["correct"]
    assert out["seconds"] < 60, out
    assert out["peak_growth"] < out["result_bytes"] + (256 << 20), out


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc (Linux)")
def test_huge_k_does_not_allocate_absurd_memory():
    out = _mem_child("huge_k")
    # 4 queries x 10**6 columns: ~128 MB of padded output per call. Without the width cap the
    # torch / native probes alone allocate ~135 MB of work arrays PER QUERY (measured).
    assert out["peak_growth"] < 2 * out["result_bytes"] + (128 << 20), out
    assert out["seconds"] < 60, out


# --------------------------------------------------------------------------- PersonaBench fuzzing
def _write_layout(root: Path) -> None:
    """A tiny valid PersonaBench layout: 2 users, 3 questions, all three private files."""
    c = root / "synthetic_data" / "community_0"
    (c / "eval_info").mkdir(parents=True)
    priv = c / "private_data" / "noise_0.0"
    priv.mkdir(parents=True)
    info = [
        {"Name": "U", "Eval_Info": {"qa": [
            {"q_id": "q1", "question": "Where?", "answer": "a", "type": "Social", "difficulty": "easy"},
            {"q_id": "q2", "question": "What?", "answer": ["b"], "type": "Preference", "difficulty": "hard"},
        ]}},
        {"Name": "V", "Eval_Info": {"qa": [
            {"q_id": "q3", "question": "Who?", "answer": None, "type": "Subjective", "difficulty": "easy"},
        ]}},
    ]
    gt = [{"q_id": "q1", "segment_id": {"a": ["c1"]}}, {"q_id": "q2", "segment_id": {"b": ["p1", "i1"]}},
          {"q_id": "q3", "segment_id": {}}]
    conv = [{"Name": "U", "Data": [{"Target_name": "V", "Conversations": [
        {"segment_id": "c1", "session": "s", "conversation": [{"role": "U", "content": "hé", "session": 1}]},
        {"segment_id": "c2", "session": "s", "conversation": []}]}]},
        {"Name": "V", "Data": [{"Conversations": [{"segment_id": "c9", "x": {"segment_id": "y"}}]}]}]
    uai = [{"Name": "U", "Data": [{"segment_id": "i1", "session": "s", "q": "?"}]}]
    ph = [{"Name": "U", "Data": [{"segment_id": "p1", "session": "s", "item": 3}]},
          {"Name": "V", "Data": []}]
    (c / "eval_info" / "eval_info_all.json").write_text(json.dumps(info))
    (c / "eval_info" / "qa_gt_context_all_noise_0.0.json").write_text(json.dumps(gt))
    (priv / "conversation_data_all.json").write_text(json.dumps(conv))
    (priv / "user_ai_interaction_data_all.json").write_text(json.dumps(uai))
    (priv / "purchase_history_data_all.json").write_text(json.dumps(ph))


_PB_FILES = [
    "eval_info/eval_info_all.json",
    "eval_info/qa_gt_context_all_noise_0.0.json",
    "private_data/noise_0.0/conversation_data_all.json",
    "private_data/noise_0.0/user_ai_interaction_data_all.json",
    "private_data/noise_0.0/purchase_history_data_all.json",
]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=True) | st.text(max_size=4)
    | st.sampled_from(["U", "V", "q1", "c1", "segment_id", "Conversations", "Data", "Name", "qa"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["Name", "Data", "Eval_Info", "qa", "q_id", "segment_id", "Conversations",
                         "question", "type", "difficulty", "session", "x"]), inner, max_size=3),
    max_leaves=6,
)


def _mutate_json(obj, path_choices, value, action):
    """Replace / delete / insert at a node chosen by walking ``path_choices``."""
    if not isinstance(obj, (dict, list)) or not obj or not path_choices:
        return value if action != "delete" else obj
    keys = list(obj) if isinstance(obj, dict) else list(range(len(obj)))
    k = keys[path_choices[0] % len(keys)]
    if len(path_choices) == 1:
        if action == "delete":
            del obj[k]
        elif action == "insert" and isinstance(obj, list):
            obj.insert(k, value)
        else:
            obj[k] = value
        return obj
    obj[k] = _mutate_json(obj[k], path_choices[1:], value, action)
    return obj


def _allowed(exc: BaseException) -> bool:
    if isinstance(exc, KeyError):
        return bool(exc.args) and bool(str(exc.args[0]))
    return isinstance(exc, (ValueError, FileNotFoundError))


@pytest.fixture(scope="module")
def pb_layout(tmp_path_factory):
    root = tmp_path_factory.mktemp("pb")
    _write_layout(root)
    data = load_personabench(root, communities=(0,))
    assert [u.key for u in data.users] == ["0/U", "0/V"] and len(data.questions) == 3
    return root


@settings(max_examples=80, deadline=None)
@given(
    which=st.sampled_from(_PB_FILES),
    structural=st.booleans(),
    path=st.lists(st.integers(0, 7), min_size=1, max_size=6),
    value=json_values,
    action=st.sampled_from(["replace", "delete", "insert"]),
    edits=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=3),
    cut=st.one_of(st.none(), st.integers(0, 1 << 20)),
)
def test_fuzz_personabench_loader(pb_layout, which, structural, path, value, action, edits, cut):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "pb"
        shutil.copytree(pb_layout, root)
        f = root / "synthetic_data" / "community_0" / which
        if structural:
            obj = _mutate_json(json.loads(f.read_text()), path, value, action)
            f.write_text(json.dumps(obj))
        else:
            data = bytearray(f.read_bytes())
            for pos, byte in edits:
                data[pos % len(data)] = byte
            if cut is not None:
                del data[cut % (len(data) + 1):]
            f.write_bytes(bytes(data))
        try:
            out = load_personabench(root, communities=(0,))
        except Exception as exc:  # noqa: BLE001 - the point is which types escape
            assert _allowed(exc), f"{type(exc).__name__}: {exc}"
            return
        for u in out.users:  # a loaded result is well formed
            assert len(u.chunk_ids) == len(u.chunk_texts) == len(set(u.chunk_ids))
            assert all(isinstance(t, str) for t in u.chunk_texts)
