"""The triton backend: parity of every primitive with the torch and
reference backends, plus end-to-end search.

On a machine without CUDA the kernels run in Triton's CPU interpreter: a module-scoped
fixture sets ``TRITON_INTERPRET=1`` (restored afterwards, so that other test modules
see the machine as it is) and the backend reads it at call time. Triton binds its own
library to the interpreter or to the compiler at the FIRST ``import triton`` of a
process, and sentence-transformers imports it compiled: on a CPU-only machine this
module therefore runs in a fresh subprocess that tests/conftest.py starts right after
collection (it uses the second core while the rest of the suite runs);
``test_module_in_a_fresh_interpreter`` collects its verdict and the in-process tests
skip with that reason. The interpreter runs each program in Python, hence the small shapes (about
30 s of CPU in all). With CUDA the same tests run the compiled kernels on the GPU. The
real compiler is exercised here without a GPU too: the kernels are compiled down to
sm_90 cubins in a fresh subprocess (``test_kernels_compile_for_sm90_without_a_gpu``).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from _exact_oracle import check_backend, near_duplicate_bank
from hypothesis import given, settings
from hypothesis import strategies as st

from rfmem_fast import MemoryBank, RFMemConfig, search
from rfmem_fast.backends import available, get_backend
from rfmem_fast.backends.reference import ReferenceBackend
from rfmem_fast.backends.torch_backend import TorchBackend

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _compiled_triton_already_imported() -> bool:
    """True when this process imported triton in compiled mode (e.g. via sentence-transformers)."""
    if CUDA or "triton.language" not in sys.modules:
        return False
    from rfmem_fast.backends.triton_backend import process_mode

    return process_mode() is False


#: Decided when the module's first test runs (another module may import triton
#: compiled before that, e.g. through sentence-transformers): True = this process cannot
#: interpret, so the whole module runs in a fresh subprocess instead.
STATE = {"subprocess": False}
CHILD = os.environ.get("RFMEM_TRITON_TEST_CHILD") == "1"


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """TRITON_INTERPRET=1 for this module only (CPU machines); skip when it cannot run."""
    from conftest import EARLY

    STATE["subprocess"] = ("triton" in EARLY or _compiled_triton_already_imported()) and not CHILD
    if STATE["subprocess"]:
        yield
        return
    mp = pytest.MonkeyPatch()
    if not CUDA:
        mp.setenv("TRITON_INTERPRET", "1")
    try:
        from rfmem_fast.backends.triton_backend import TritonBackend

        be = TritonBackend(DEV)
        bank = MemoryBank.from_arrays(np.eye(3, dtype=np.float32), [0, 3])
        s, r = be.segmented_topk(be.view(bank), torch.eye(3)[:1], torch.zeros(1, dtype=torch.int64), 2)
        assert r[0].tolist() == [0, 1], r
    except Exception as e:  # pragma: no cover - depends on the triton build
        mp.undo()
        pytest.skip(f"triton kernels cannot run here: {type(e).__name__}: {e}")
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _in_process_only(request, interpreter):
    if STATE["subprocess"] and request.node.name != "test_module_in_a_fresh_interpreter":
        pytest.skip("run in a fresh interpreter by test_module_in_a_fresh_interpreter (Triton interprets only there)")


def test_module_in_a_fresh_interpreter():
    """Triton binds its library to the compiler or the interpreter at its first import;
    on a CPU-only machine this module runs in a fresh process: the one conftest started
    right after collection (it runs on the second core meanwhile), or one started here
    when another module imported triton compiled and no early run exists."""
    from conftest import early_result

    if not STATE["subprocess"]:
        pytest.skip("the tests of this module run in this process")
    early = early_result("triton")
    if early is not None:
        rc, text = early
    else:
        env = dict(os.environ, TRITON_INTERPRET="1", RFMEM_TRITON_TEST_CHILD="1")
        res = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
            env=env, capture_output=True, text=True, timeout=900,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )  # fmt: skip
        rc, text = res.returncode, res.stdout + res.stderr
    assert rc == 0, text[-8000:]
    assert " passed" in text and " failed" not in text


def _triton(**kw):
    from rfmem_fast.backends.triton_backend import TritonBackend

    return TritonBackend(DEV, **kw)


def _torch():
    return TorchBackend(DEV)


def _cpu(out):
    """Results on the CPU, for comparisons across devices."""
    return tuple(t.cpu() for t in out) if isinstance(out, tuple) else out.cpu()


def _bank(d, lens, seed=0, dup=True):
    """CSR bank with the given segment lengths (0 = empty user); a duplicated row in the longest."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(sum(lens), d, generator=g)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    if dup:
        u = int(np.argmax(lens))
        a = int(off[u])
        X[a + 3] = X[a + 1]
        X[a + 5] = X[a + 1]
    return MemoryBank.from_arrays(X.numpy(), off), off, g


def _queries(bank, off, qseg, g, d):
    Q = torch.randn(len(qseg), d, generator=g)
    X = torch.from_numpy(bank.snapshot().vectors)
    u = int(np.argmax(np.diff(off)))
    Q[0] = X[int(off[u]) + 1]  # hits the duplicated rows: exact ties
    return Q / Q.norm(dim=1, keepdim=True), torch.tensor(qseg)


LENS = [0, 1, 5, 37, 70]  # an empty user, one item, fewer items than k, longer than a tile
QSEG = [4, 0, 1, 2, 3, 4, 4, 3, 2, 1, 4]


@pytest.mark.parametrize("d", [3, 72])
def test_segmented_topk_matches_torch_and_reference(d):
    bank, off, g = _bank(d, LENS, seed=d)
    Q, qseg = _queries(bank, off, QSEG, g, d)
    tb, rb, ref = _triton(), _torch(), ReferenceBackend()
    for k in ((1, 7, 40) if d == 72 else (1, 40)):
        s, r = _cpu(tb.segmented_topk(tb.view(bank), Q, qseg, k))
        s2, r2 = _cpu(rb.segmented_topk(rb.view(bank), Q, qseg, k))
        s3, r3 = _cpu(ref.segmented_topk(ref.view(bank), Q, qseg, k))
        assert s.shape == (len(QSEG), k) and s.dtype == torch.float32 and r.dtype == torch.int64
        assert torch.equal(r, r2), (k, r, r2)
        assert torch.equal(s, s2)  # exact mode: the torch backend's exactly re-scored values
        assert torch.equal(r, r3)
        assert torch.equal(s, s3)  # every backend returns the exact scores
        # padding: -inf / -1 exactly where the user has fewer than k items
        n_user = torch.tensor(np.diff(off))[qseg]
        pad = torch.arange(k)[None, :] >= n_user[:, None]
        assert torch.equal(r < 0, pad) and bool(torch.isinf(s[pad]).all())


def test_ties_by_smaller_row_and_one_item():
    v = np.array([[1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 1], [1, 0, 0], [0, 1, 0]], np.float32)
    bank = MemoryBank.from_arrays(np.vstack([v, [[0, 1, 0]]]), [0, 6, 7])
    tb = _triton()
    Q = torch.tensor([[1.0, 0, 0], [0, 0, 1.0], [1.0, 0, 0]])
    s, r = _cpu(tb.segmented_topk(tb.view(bank), Q, torch.tensor([0, 0, 1]), 8))
    assert r[0].tolist() == [0, 2, 4, 1, 3, 5, -1, -1]  # 1,1,1 then the zeros by row
    assert r[1].tolist()[:6] == [3, 0, 1, 2, 4, 5]
    assert r[2].tolist() == [6] + [-1] * 7 and s[2, 0].item() == 0.0


@pytest.mark.parametrize("block_m,exact", [(4, True), (16, True), (16, False)])
def test_query_tiles_of_one_segment(block_m, exact):
    """Several queries per user share a program (BLOCK_M > 1); float32 mode uses tl.dot."""
    d = 24
    bank, off, g = _bank(d, [19, 0, 45], seed=3)
    qseg = [0] * 5 + [2] * 18 + [1] * 2
    Q, qseg = _queries(bank, off, qseg, g, d)
    tb, rb = _triton(block_m=block_m, exact=exact), _torch()
    s, r = _cpu(tb.segmented_topk(tb.view(bank), Q, qseg, 10))
    s2, r2 = _cpu(rb.segmented_topk(rb.view(bank), Q, qseg, 10))
    assert torch.equal(r, r2)
    assert torch.equal(s, s2)  # float32 scans too: the exact re-scoring gives the exact scores


@pytest.mark.parametrize("convention", ["mean", "sum", "normalized"])
def test_fused_probe_signals(convention):
    d = 37
    bank, off, g = _bank(d, LENS, seed=11)
    Q, qseg = _queries(bank, off, QSEG, g, d)
    tb, rb = _triton(), _torch()
    out = _cpu(tb.probe(tb.view(bank), Q, qseg, 12, 10, 20.0, convention))
    ref = _cpu(rb.probe(rb.view(bank), Q, qseg, 12, 10, 20.0, convention))
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert out[2].dtype == torch.float64 and out[3].dtype == torch.float64
    torch.testing.assert_close(out[2], ref[2], atol=1e-12, rtol=0)
    torch.testing.assert_close(out[3], ref[3], atol=1e-12, rtol=0)
    assert torch.equal(out[4], ref[4])
    empty = qseg == 0
    assert bool((out[4][empty] == 0).all()) and bool((out[2][empty] == 0).all())


@settings(max_examples=2)
@given(seed=st.integers(0, 2**31 - 1), d=st.sampled_from([1, 3, 17, 64] + ([384, 512] if CUDA else [])), n=st.integers(2, 60))
def test_near_duplicates_exact_prefix_batch_invariant(seed, d, n):
    """Exact top-k under near-ties on the triton backend (float64 and float32 scans): banks of exact and
    1-ulp near duplicates give the oracle's ids and scores for every k, prefixes agree,
    and a query's result is identical alone and in batches (tests/_exact_oracle.py; the
    CPU backends run it with more examples in tests/test_exact_topk.py). Triton's
    interpreter is slow (about a second per program, more for long d), hence two
    examples, three queries, d <= 64 and batches of at most 8 on the CPU; up to 256 and
    d = 512 on a GPU."""
    bank, Q, qseg = near_duplicate_bank(seed, d, n)
    Q, qseg = Q[[0, 2, 4]], qseg[[0, 2, 4]]
    sizes = (1, 2, 8, 256) if CUDA else (1, 8)
    check_backend(_triton(), bank, Q, qseg, sorted({1, n + 2}), seed, batch_sizes=sizes)
    check_backend(_triton(exact=False, block_m=16), bank, Q, qseg, [3], seed, batch_sizes=sizes)


def test_wide_k_falls_back_to_torch():
    bank, off, g = _bank(8, [40, 3], seed=5)
    Q, qseg = _queries(bank, off, [0, 1, 0], g, 8)
    tb, rb = _triton(max_k=16), _torch()
    s, r = _cpu(tb.segmented_topk(tb.view(bank), Q, qseg, 33))
    s2, r2 = _cpu(rb.segmented_topk(rb.view(bank), Q, qseg, 33))
    assert torch.equal(r, r2) and torch.equal(s, s2)


@pytest.mark.parametrize("n,d", [(5, 3), (13, 37), (40, 20)])
def test_batched_kmeans_matches_torch(n, d):
    g = torch.Generator().manual_seed(n * 100 + d)
    m = 16
    V = torch.randn(m, n, d, generator=g)
    V = V / V.norm(dim=2, keepdim=True)
    V[1, 2] = V[1, 0]  # duplicate points
    V[1, 3] = V[1, 0]
    counts = torch.randint(1, n + 1, (m,), generator=g)
    counts[:2] = n
    clusters = torch.minimum(torch.randint(1, 17, (m,), generator=g), counts)
    tb, rb = _triton(), _torch()
    lab, cen = _cpu(tb.batched_kmeans(V, counts, clusters, 300, 1e-4, 42))
    lab2, cen2 = _cpu(rb.batched_kmeans(V, counts, clusters, 300, 1e-4, 42))
    assert lab.dtype == torch.int64 and cen.dtype == torch.float32
    assert cen.shape == (m, int(clusters.max()), d)
    assert torch.equal(lab, lab2)
    torch.testing.assert_close(cen, cen2, atol=1e-6, rtol=0)
    pad = torch.arange(n)[None, :] >= counts[:, None]
    assert bool((lab[pad] == -1).all()) and bool((lab[~pad] >= 0).all())


def test_alpha_mix_matches_torch_and_reference():
    g = torch.Generator().manual_seed(9)
    m, c, d = 6, 4, 37
    qb, q0 = torch.randn(m, d, generator=g), torch.randn(m, d, generator=g)
    cen = torch.randn(m, c, d, generator=g)
    cen[2, 3] = 0.0  # an empty cluster's zero centroid
    out = _cpu(_triton().alpha_mix(qb, cen, q0, 0.3))
    torch.testing.assert_close(out, _cpu(_torch().alpha_mix(qb, cen, q0, 0.3)), atol=1e-6, rtol=0)
    torch.testing.assert_close(out, ReferenceBackend().alpha_mix(qb, cen, q0, 0.3), atol=1e-5, rtol=0)


def _clustered_bank(users=4, per=24, d=16, seed=0):
    """Users whose items gather around 3 centres each, plus one user with no item."""
    rng = np.random.default_rng(seed)
    centres, blocks, ids = {}, [], []
    for u in range(users):
        c = rng.normal(size=(3, d))
        centres[u] = c
        blocks.append(c[rng.integers(0, 3, per)] + 0.35 * rng.normal(size=(per, d)))
        ids += [f"{u}:{i}" for i in range(per)]
    off = [per * u for u in range(users + 1)] + [per * users]
    bank = MemoryBank.from_arrays(np.vstack(blocks), off, [f"u{u}" for u in range(users)] + ["empty"], ids)
    owners, Q = [], []
    for i in range(10):
        u = i % users
        owners.append(f"u{u}")
        Q.append(centres[u][i % 3] if i % 2 else rng.normal(size=d))  # familiar / unfamiliar
    owners.append("empty")
    Q.append(rng.normal(size=d))
    return bank, np.array(Q), owners


@pytest.mark.parametrize("mode", ["dense", "rfmem"])
def test_search_end_to_end_matches_torch(mode):
    bank, Q, owners = _clustered_bank()
    cfg = RFMemConfig(max_rounds=3, tau=0.12)
    res = search(bank, Q, owners, cfg, mode=mode, backend=_triton())
    ref = search(bank, Q, owners, cfg, mode=mode, backend="torch")
    assert res.backend == "triton"
    assert res.ids.tolist() == ref.ids.tolist()
    assert res.route.tolist() == ref.route.tolist()
    assert res.rule.tolist() == ref.rule.tolist()
    np.testing.assert_array_equal(res.scores, ref.scores)
    np.testing.assert_allclose(res.mean, ref.mean, atol=1e-12)
    np.testing.assert_allclose(res.entropy, ref.entropy, atol=1e-12)
    np.testing.assert_array_equal(res.rounds, ref.rounds)
    if mode == "rfmem":
        assert set(res.route[:-1].tolist()) == {0, 1}  # both paths exercised


def test_registry_under_the_interpreter():
    names = available()
    assert "triton" in names
    if not torch.cuda.is_available():
        assert names[-1] == "triton" and get_backend("auto").name != "triton"
    assert get_backend("triton", DEV).name == "triton"
    from rfmem_fast.backends import triton_backend

    if not CUDA:  # the kernels ran through the interpreter
        assert triton_backend.process_mode() is True and True in triton_backend._KERNEL_MODULES
    else:
        assert names[0] == "triton" and get_backend("auto").name == "triton"


def test_bad_input_and_unrunnable_device(monkeypatch):
    tb = _triton()
    bank, off, g = _bank(4, [3, 2], seed=1, dup=False)
    view = tb.view(bank)
    Q = torch.randn(2, 4)
    with pytest.raises(ValueError, match="dimension"):
        tb.segmented_topk(view, torch.randn(2, 5), torch.zeros(2, dtype=torch.int64), 2)
    with pytest.raises(TypeError, match="integer"):
        tb.segmented_topk(view, Q, torch.zeros(2), 2)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        tb.segmented_topk(view, Q, torch.tensor([0, 2]), 2)
    with pytest.raises(ValueError, match="k must be"):
        tb.segmented_topk(view, Q, torch.zeros(2, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="probe_k"):
        tb.probe(view, Q, torch.zeros(2, dtype=torch.int64), 2, 3, 20.0, "mean")
    with pytest.raises(ValueError, match="convention"):
        tb.probe(view, Q, torch.zeros(2, dtype=torch.int64), 2, 2, 20.0, "median")
    with pytest.raises(ValueError, match="clusters"):
        tb.batched_kmeans(torch.randn(1, 3, 4), torch.tensor([2]), torch.tensor([3]), 10, 1e-4, 42)
    with pytest.raises(ValueError, match="alpha"):
        tb.alpha_mix(torch.randn(1, 4), torch.randn(1, 2, 4), torch.randn(1, 4), 1.5)
    with pytest.raises(ValueError, match="qb and q0"):
        tb.alpha_mix(torch.randn(1, 4), torch.randn(1, 2, 5), torch.randn(1, 4), 0.5)
    with pytest.raises(ValueError, match="block_m"):
        _triton(block_m=3)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            _triton()
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            tb.segmented_topk(view, Q, torch.zeros(2, dtype=torch.int64), 2)


AOT_SCRIPT = textwrap.dedent(
    """
    import torch
    from rfmem_fast.backends.triton_backend import TritonBackend, compile_kernels
    if not torch.cuda.is_available():  # on the CPU, without TRITON_INTERPRET: refused clearly
        try:
            TritonBackend("cpu")
        except RuntimeError as e:
            assert "TRITON_INTERPRET" in str(e), e
        else:
            raise AssertionError("TritonBackend('cpu') must need TRITON_INTERPRET=1")
    built = compile_kernels(90)
    assert len(built) == 8 and all(size > 0 for size in built.values()), built
    print("compiled", len(built))
    """
)


def test_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    """The interpreter checks semantics only: also run Triton's compiler down to sm_90
    cubins (ptxas ships with triton; no GPU or driver needed), in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run(
        [sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=600, cwd=root
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "compiled 8" in res.stdout
