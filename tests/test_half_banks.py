"""Half-precision and int8 banks: ``MemoryBank(dim, dtype="float16" | "bfloat16" | "int8")``.

Pinned here:
* the scan copy is each float32 element rounded to nearest even (checked against
  independent roundings: ``struct``'s IEEE half for float16, integer bit arithmetic for
  bfloat16), ties and subnormals included;
* results equal the float32 bank's, ids and scores, on native (every SIMD level, scan
  and GEMM paths) and torch (both scan strategies), against the exact oracle on banks of
  exact and 1-ulp near duplicates (whose float16 / bfloat16 roundings and int8 codes tie
  massively), after writes, and on PersonaBench (263 / 263 golden ids per mode); the
  same for int8 banks (the native backend scans the int8 copy, the others the float32
  rows; tests/test_int8_scan.py has the int8 scan's own adversarial cases);
* the store: round trip per dtype (format 4, scan.npy; int8: format 5 with
  scan_meta.npy) with and without mmap, a scan copy that is not the rounding (the int8
  quantisation) of its float32 rows refused, and a float32 store
  written by a version without half-precision banks (tests/data/store_v1_float32) still loads;
* memory: the scan copy the backends read and hold is half the float32 bytes (int8: a
  quarter plus 12 bytes per row), and a store loaded with mmap keeps resident the scan
  copy plus only the float32 pages of the rows a search re-scores (Linux /proc/self/smaps).
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _exact_oracle import check_backend, near_duplicate_bank

from rfmem_fast import MemoryBank, RFMemConfig, StoreError, search
from rfmem_fast.backends import available
from rfmem_fast.backends.torch_backend import TorchBackend
from rfmem_fast.precision import scan_to_float32, to_scan_copy

NATIVE = "native" in available()
HALF = ("float16", "bfloat16")
SCAN = HALF + ("int8",)  # every bank dtype with a scan copy
DATA = Path(__file__).parent / "data"
GOLD_KEY = {"dense": "dense_ids", "recollection": "recollection_ids", "rfmem": "rfmem_ids"}

if NATIVE:
    from rfmem_fast import _native
    from rfmem_fast.backends.native import NativeBackend


def _fast_backends():
    out = [TorchBackend("cpu"), TorchBackend("cpu", topk_strategy="gather")]
    if NATIVE:
        out += [NativeBackend(topk_path="scan"), NativeBackend(topk_path="gemm"), NativeBackend()]
    return out


def _as(bank: MemoryBank, dtype: str) -> MemoryBank:
    """The same users, items and float32 rows (bit for bit, shared) in a bank of ``dtype``."""
    out = bank.astype(dtype)
    a, b = bank.snapshot(), out.snapshot()
    assert b.vectors is a.vectors and b.item_ids is a.item_ids and out.dtype == dtype
    return out


# ------------------------------------------------------------------ the scan copy
def _bf16_reference(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even, by integer arithmetic."""
    u = x.view(np.uint32).astype(np.uint64)
    lower = u & 0xFFFF
    upper = u >> 16
    up = (lower > 0x8000) | ((lower == 0x8000) & ((upper & 1) == 1))
    return (upper + up).astype(np.uint16)


def test_scan_copy_rounds_to_nearest_even():
    rng = np.random.default_rng(0)
    x = np.concatenate([
        rng.normal(size=2000).astype(np.float32) * np.float32(0.05),
        np.float32([2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14, 1 + 2.0**-11, 1 + 3 * 2.0**-11, -0.0, 1.0]),
        (1 + np.arange(64, dtype=np.float32) * np.float32(2.0**-8)) + np.float32(2.0**-9),  # bfloat16 ties
    ]).astype(np.float32)[None, :]
    f16 = to_scan_copy(x, "float16")
    want16 = np.array([struct.unpack("<H", struct.pack("<e", float(v)))[0] for v in x[0]], dtype=np.uint16)
    np.testing.assert_array_equal(f16.view(np.uint16)[0], want16)
    bf = to_scan_copy(x, "bfloat16")
    np.testing.assert_array_equal(bf[0], _bf16_reference(x[0]))
    # back to float32 exactly
    assert scan_to_float32(bf, "bfloat16").tobytes() == (bf.astype(np.uint32) << 16).tobytes()
    np.testing.assert_array_equal(scan_to_float32(f16, "float16"), f16.astype(np.float32))
    with pytest.raises(ValueError, match="float16 range"):
        to_scan_copy(np.float32([[70000.0]]), "float16")


def test_astype_shares_rows_and_stays_independent():
    rng = np.random.default_rng(8)
    bank = MemoryBank(16)
    bank.add("a", rng.normal(size=(30, 16)), ids=list(range(30)), texts=[str(i) for i in range(30)])
    half = _as(bank, "float16")
    np.testing.assert_array_equal(half.snapshot().scan, bank.snapshot().vectors.astype(np.float16))
    half.delete("a", [0, 1])
    half.add("b", rng.normal(size=(3, 16)), ids=[1, 2, 3])
    bank.update("a", [5], rng.normal(size=(1, 16)))
    assert bank.user_size("a") == 30 and "b" not in bank and half.user_size("a") == 28
    assert half.texts_of("a")[:2] == ["2", "3"] and half.snapshot().scan.shape == (31, 16)
    assert not np.array_equal(half.snapshot().vectors[3], bank.snapshot().vectors[5])  # the update stayed in bank


def test_dtype_argument():
    assert MemoryBank(4, dtype=np.float16).dtype == "float16"
    assert MemoryBank(4, dtype=torch.bfloat16).dtype == "bfloat16"
    assert "dtype=bfloat16" in repr(MemoryBank(4, dtype="bfloat16"))
    assert MemoryBank(4, dtype=np.int8).dtype == "int8" and MemoryBank(4, dtype=torch.int8).dtype == "int8"
    for bad in ("int16", "float64", 3, None):
        with pytest.raises(ValueError, match="dtype must be one of"):
            MemoryBank(4, dtype=bad)


# ------------------------------------------------------------------ results equal float32
@pytest.mark.parametrize("dtype", SCAN)
@pytest.mark.parametrize("seed, d, n", [(1, 384, 60), (2, 17, 90), (3, 64, 40), (4, 1, 12)])
def test_near_duplicates_equal_oracle(dtype, seed, d, n):
    """Exact and 1-ulp near duplicates round to the SAME half-precision vector, so the scan
    sees ties everywhere; every fast backend still returns the exact float32 top-k (ids
    and scores, every k, prefixes, alone and in batches)."""
    bank32, Q, qseg = near_duplicate_bank(seed, d, n)
    bank = _as(bank32, dtype)
    assert bank.snapshot().scan is not None
    ks = sorted({1, 3, min(10, n), n + 2})
    for be in _fast_backends():
        check_backend(be, bank, Q, qseg, ks, seed, batch_sizes=(1, 8, 64))


@pytest.mark.skipif(not NATIVE, reason="native backend not built")
@pytest.mark.parametrize("dtype", SCAN)
def test_every_simd_level_scans_half_copies_exactly(dtype):
    """The float16 / bfloat16 scan of each SIMD level (F16C or shift conversions, or the
    baseline's integer ones) and the int8 scan (AVX2 vpmaddwd or plain C++) on both paths
    give the float32 bank's exact top-k."""
    bank32, Q, qseg = near_duplicate_bank(9, 100, 70)
    bank = _as(bank32, dtype)
    want = [NativeBackend().segmented_topk(NativeBackend().view(bank32), torch.from_numpy(Q), torch.from_numpy(qseg), 9)]
    try:
        for lv in range(_native.set_simd_cap(-1) + 1):
            _native.set_simd_cap(lv)
            for path in ("scan", "gemm"):
                be = NativeBackend(topk_path=path)
                s, r = be.segmented_topk(be.view(bank), torch.from_numpy(Q), torch.from_numpy(qseg), 9)
                assert r.tolist() == want[0][1].tolist() and s.tolist() == want[0][0].tolist(), (lv, path)
    finally:
        _native.set_simd_cap(-1)


@pytest.mark.parametrize("dtype", SCAN)
def test_search_after_writes_equals_float32_bank(dtype):
    """add / update / delete on a half bank and on a float32 bank: every mode gives the
    same ids and scores (the scan copy is rebuilt with the snapshot)."""
    rng = np.random.default_rng(4)
    banks = [MemoryBank(32), MemoryBank(32, dtype=dtype)]
    for b in banks:
        rng_b = np.random.default_rng(5)
        b.add("a", rng_b.normal(size=(300, 32)), ids=list(range(300)))
        b.add("b", rng_b.normal(size=(40, 32)), ids=list(range(40)))
        b.delete("a", list(range(0, 300, 7)))
        b.update("b", [3, 4], rng_b.normal(size=(2, 32)))
        b.add("a", rng_b.normal(size=(20, 32)), ids=list(range(1000, 1020)))
    users = ["a"] * 12 + ["b"] * 4
    Q = rng.normal(size=(16, 32))
    for be in ["torch"] + (["native"] if NATIVE else []):
        for mode in ("dense", "rfmem"):
            want = search(banks[0], Q, users, RFMemConfig(), mode=mode, backend=be)
            got = search(banks[1], Q, users, RFMemConfig(), mode=mode, backend=be)
            assert [got.ids_list(i) for i in range(16)] == [want.ids_list(i) for i in range(16)], (be, mode)
            np.testing.assert_array_equal(got.scores, want.scores)


@pytest.mark.skipif(not NATIVE, reason="native backend not built")
@pytest.mark.parametrize("dtype", SCAN)
def test_both_beam_drivers_scan_the_half_copy_exactly(dtype):
    """The Python driver's rounds use the half copy (scan and GEMM paths: a shared
    segment with many branches), the C++ driver's too except its pruned rounds (segments
    of >= 512 rows: the float32 rows, pruned by q0's scores): same rows, scores and
    rounds as the float32 bank."""
    rng = np.random.default_rng(6)
    X = rng.normal(size=(900, 48)).astype(np.float32)
    bank32 = MemoryBank.from_arrays(X, [0, 700, 900])
    bank = _as(bank32, dtype)
    users = [0] * 24 + [1] * 3
    Q = X[rng.integers(0, 700, size=27)] + 0.3 * rng.normal(size=(27, 48)).astype(np.float32)
    cfg = RFMemConfig(out_k=12)
    want = search(bank32, Q, users, cfg, mode="recollection", backend=NativeBackend(beam_driver="python"))
    for be in (NativeBackend(), NativeBackend(beam_driver="python"), NativeBackend(topk_path="gemm"),
               NativeBackend(beam_driver="python", topk_path="scan")):  # fmt: skip
        got = search(bank, Q, users, cfg, mode="recollection", backend=be)
        assert got.ids.tolist() == want.ids.tolist(), (be.beam_driver, be.topk_path)
        np.testing.assert_array_equal(got.scores, want.scores)
        np.testing.assert_array_equal(got.rounds, want.rounds)


@pytest.mark.skipif(not NATIVE, reason="native backend not built")
@pytest.mark.parametrize("dtype", HALF)
def test_the_half_probe_keeps_its_scan_scores_for_the_pruned_rounds(dtype):
    """The probe over a half copy keeps every row's scan score (SIMD levels >= 1; within
    the half scan's bound of the exact score) and the C++ beam driver prunes its rounds
    with them, with that wider bound: one query at a time (the scan path) on a segment of
    2,048 rows, rows, bitwise scores and rounds equal the float32 bank's, and the driver
    scored far fewer rows than full scans would."""
    from _shared import clustered_rows

    from rfmem_fast.backends.native import _draws_by_clusters
    from rfmem_fast.recollection import recollection_capacity

    rng = np.random.default_rng(31)
    d, n = 48, 2048
    bank32 = MemoryBank.from_arrays(clustered_rows(rng, n, d, "gauss"), [0, n])
    bank = _as(bank32, dtype)
    snap = bank.snapshot()
    X, off = snap.vectors, snap.offsets
    Q = X[rng.integers(0, n, 4)] + np.float32(0.05) * rng.standard_normal((4, d)).astype(np.float32)
    Q = (Q / np.linalg.norm(Q.astype(np.float64), axis=1, keepdims=True)).astype(np.float32)
    cfg = RFMemConfig()
    want = search(bank32, Q, [0] * 4, cfg, mode="recollection", backend=NativeBackend(beam_driver="python"))
    xn = float(np.linalg.norm(X.astype(np.float64), axis=1).max() * (1 + 1e-6))
    bits = snap.scan.view(np.uint16)
    for i in range(4):
        seg = np.zeros(1, np.int64)
        out = _native.probe(X, off, Q[i : i + 1], seg, 10, 10, 20.0, "mean", 1, xn, keep_scan_scores=True,
                            scan=bits, scan_type=dtype)  # fmt: skip
        kept, written = out[5], out[6]
        if _native.simd_level() == 0:
            assert not written[0]
            continue
        assert written[0]
        exact = X.astype(np.float64) @ Q[i].astype(np.float64)
        np.testing.assert_allclose(kept[0], exact, atol=4e-3 if dtype == "bfloat16" else 5e-4)
        st = np.zeros(len(_native.recollect_stat_names))
        rows, scores, rounds = _native.recollect(
            X, off, Q[i : i + 1], seg, out[0], out[1], cfg.beam_width, cfg.fanout, cfg.max_rounds, cfg.out_k,
            cfg.alpha, cfg.mmr_lambda, cfg.score_floor, cfg.kmeans_iters, cfg.kmeans_tol,
            _draws_by_clusters(cfg.kmeans_seed, cfg.beam_width), recollection_capacity(cfg) + 1, 1, xn, 256 << 20,
            stats=st, scan=bits, scan_type=dtype, ref_scores=kept, ref_ok=written,
        )[:3]  # fmt: skip
        np.testing.assert_array_equal(rows[0, : cfg.out_k], want.rows[i], err_msg=f"{dtype} query {i}")
        np.testing.assert_array_equal(scores[0, : cfg.out_k].view(np.uint32), want.scores[i].view(np.uint32))
        assert rounds[0] == want.rounds[i]
        s = dict(zip(_native.recollect_stat_names, st))
        if s["scan_queries"] > 0:
            assert 0 < s["scan_rows"] < 0.5 * n * s["scan_queries"] / cfg.beam_width, s
    got = search(bank, Q, [0] * 4, cfg, mode="recollection", backend=NativeBackend())  # the same through search
    np.testing.assert_array_equal(got.rows, want.rows)
    np.testing.assert_array_equal(got.scores.view(np.uint32), want.scores.view(np.uint32))


_PB_FLOAT32: dict = {}  # (backend, mode) -> the float32 bank's result


@pytest.mark.parametrize("dtype", SCAN)
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_personabench_golden_ids(pb_embedded, dtype, backend):
    """PersonaBench embedded with MiniLM, in a float16 / bfloat16 bank: 263 / 263 questions
    get the golden ids (the authors' float32 results) in every mode, and the same ids,
    scores, routes and signals as the float32 bank on the same backend."""
    if backend not in available():
        pytest.skip(f"{backend} not built")
    pb = pb_embedded
    bank = _as(pb.bank, dtype)
    modes = list(GOLD_KEY) if backend == "native" else ["dense", "rfmem"]  # torch: recollection runs inside rfmem
    for mode in modes:
        res = search(bank, pb.queries, pb.users, RFMemConfig(), mode=mode, backend=backend)
        same = sum(res.ids_list(i) == g[GOLD_KEY[mode]] for i, g in enumerate(pb.golden))
        assert same == 263, (mode, same)
        if (backend, mode) not in _PB_FLOAT32:
            _PB_FLOAT32[backend, mode] = search(pb.bank, pb.queries, pb.users, RFMemConfig(), mode=mode, backend=backend)
        ref = _PB_FLOAT32[backend, mode]
        np.testing.assert_array_equal(res.scores, ref.scores)
        np.testing.assert_array_equal(res.route, ref.route)
        np.testing.assert_array_equal(res.mean, ref.mean)
        np.testing.assert_array_equal(res.entropy, ref.entropy)


# ------------------------------------------------------------------ the store
def _snapdir(path: Path) -> Path:
    return path / json.loads((path / "CURRENT").read_text())["dir"]


@pytest.mark.parametrize("dtype", ["float32", *SCAN])
def test_store_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(7)
    bank = MemoryBank(24, dtype=dtype)
    bank.add("u", rng.normal(size=(50, 24)), ids=[f"i{j}" for j in range(50)], texts=[str(j) for j in range(50)])
    bank.add(3, rng.normal(size=(9, 24)), ids=list(range(9)))
    bank.save(tmp_path / "s")
    man = json.loads((_snapdir(tmp_path / "s") / "manifest.json").read_text())
    assert man["dtype"] == dtype and man["format_version"] == (5 if dtype == "int8" else 4)
    assert ("scan.npy" in man["files"]) == (dtype != "float32")
    assert ("scan_meta.npy" in man["files"]) == (dtype == "int8")
    q = rng.normal(size=(4, 24))
    want = search(bank, q, ["u", "u", 3, "u"], RFMemConfig(out_k=5, probe_k=5), mode="rfmem", backend="torch")
    for mmap in (False, True):
        for verify in (True, False):
            back = MemoryBank.load(tmp_path / "s", mmap=mmap, verify=verify)
            a, b = bank.snapshot(), back.snapshot()
            assert back.dtype == dtype and b.dtype == dtype
            assert a.vectors.tobytes() == b.vectors.tobytes()
            assert (a.scan is None and b.scan is None) or (a.scan.dtype == b.scan.dtype and a.scan.tobytes() == b.scan.tobytes())
            assert (a.scan_meta is None and b.scan_meta is None) or a.scan_meta.tobytes() == b.scan_meta.tobytes()
            assert list(b.item_ids) == list(a.item_ids) and list(b.texts) == list(a.texts)
            for be in ["torch"] + (["native"] if NATIVE else []):
                got = search(back, q, ["u", "u", 3, "u"], RFMemConfig(out_k=5, probe_k=5), mode="rfmem", backend=be)
                assert got.ids.tolist() == want.ids.tolist()
                np.testing.assert_array_equal(got.scores, want.scores)


def _rewrite_checksums(root: Path, names: list[str]) -> tuple[dict, dict]:
    """Re-hash ``names`` of the current snapshot into its manifest and CURRENT (an edit
    only the consistency checks can see); returns (manifest, CURRENT)."""
    d = _snapdir(root)
    man = json.loads((d / "manifest.json").read_text())
    for name in names:
        raw = (d / name).read_bytes()
        man["files"][name] = {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
    mraw = json.dumps(man).encode()
    (d / "manifest.json").write_bytes(mraw)
    cur = json.loads((root / "CURRENT").read_text())
    cur["manifest_sha256"] = hashlib.sha256(mraw).hexdigest()
    (root / "CURRENT").write_text(json.dumps(cur))
    return man, cur


def test_store_refuses_a_scan_copy_that_is_not_the_rounding(tmp_path):
    """scan.npy edited and its checksums rewritten (so only the consistency check can see
    it): load names the file and the row."""
    bank = MemoryBank(8, dtype="float16")
    bank.add("u", np.random.default_rng(1).normal(size=(20, 8)), ids=list(range(20)))
    bank.save(tmp_path / "s")
    d = _snapdir(tmp_path / "s")
    arr = np.load(d / "scan.npy")
    arr[13, 2] = np.float16(0.5) if arr[13, 2] != np.float16(0.5) else np.float16(0.25)
    np.save(d / "scan.npy", arr)
    man, cur = _rewrite_checksums(tmp_path / "s", ["scan.npy"])
    with pytest.raises(StoreError, match=r"scan\.npy: row 13 is not the float16 rounding"):
        MemoryBank.load(tmp_path / "s")
    with pytest.raises(StoreError, match="dtype"):  # a format-1 manifest cannot hold a half bank
        man["format_version"] = 1
        mraw = json.dumps(man).encode()
        (d / "manifest.json").write_bytes(mraw)
        cur["manifest_sha256"] = hashlib.sha256(mraw).hexdigest()
        (tmp_path / "s" / "CURRENT").write_text(json.dumps(cur))
        MemoryBank.load(tmp_path / "s")


@pytest.mark.parametrize("edit", ["code", "scale", "residual_bound", "norm_bound"])
def test_store_refuses_an_int8_copy_that_is_not_the_quantisation(tmp_path, edit):
    """An int8 store whose codes, scales or norm bounds were edited (checksums rewritten):
    a smaller bound would void the scan's proof, so load refuses it, naming the row; a
    format-4 manifest cannot hold an int8 bank."""
    bank = MemoryBank(8, dtype="int8")
    bank.add("u", np.random.default_rng(1).normal(size=(20, 8)), ids=list(range(20)))
    bank.save(tmp_path / "s")
    assert MemoryBank.load(tmp_path / "s").snapshot().scan_meta is not None
    d = _snapdir(tmp_path / "s")
    codes, meta = np.load(d / "scan.npy"), np.load(d / "scan_meta.npy")
    if edit == "code":
        codes[11, 3] = codes[11, 3] + 1 if codes[11, 3] < 127 else 126
    else:
        col = {"scale": 0, "residual_bound": 1, "norm_bound": 2}[edit]
        meta[11, col] = np.float32(meta[11, col] * np.float32(0.999))
    np.save(d / "scan.npy", codes)
    np.save(d / "scan_meta.npy", meta)
    man, cur = _rewrite_checksums(tmp_path / "s", ["scan.npy", "scan_meta.npy"])
    with pytest.raises(StoreError, match=r"scan\.npy: row 11 is not the int8 quantisation"):
        MemoryBank.load(tmp_path / "s")
    MemoryBank.load(tmp_path / "s", verify=False)  # (the checks are the verify pass's)
    man["format_version"] = 4
    mraw = json.dumps(man).encode()
    (d / "manifest.json").write_bytes(mraw)
    cur["manifest_sha256"] = hashlib.sha256(mraw).hexdigest()
    (tmp_path / "s" / "CURRENT").write_text(json.dumps(cur))
    with pytest.raises(StoreError, match="dtype must be one of"):
        MemoryBank.load(tmp_path / "s")


def test_store_written_before_half_banks_still_loads(tmp_path):
    """tests/data/store_v1_float32 was written by rfmem_fast before half-precision banks (format 1):
    it loads (read and mmap) with its users, ids, texts, version and vectors, searches,
    and saves again in the current format (3)."""
    exp = json.loads((DATA / "store_v1_float32.expected.json").read_text())
    for mmap in (False, True):
        bank = MemoryBank.load(DATA / "store_v1_float32", mmap=mmap)
        s = bank.snapshot()
        assert bank.dtype == "float32" and s.scan is None and s.version == exp["version"]
        assert list(s.users) == exp["users"] and s.offsets.tolist() == exp["offsets"]
        assert s.item_ids.tolist() == exp["item_ids"] and s.texts.tolist() == exp["texts"]
        assert hashlib.sha256(s.vectors.astype("<f4").tobytes()).hexdigest() == exp["vectors_sha256"]
        res = search(bank, s.vectors[[0, 6]], ["alice", 42], RFMemConfig(out_k=3, probe_k=3), mode="dense", backend="torch")
        assert res.ids_list(0)[0] == "a0" and res.ids_list(1)[0] == 100
    bank.save(tmp_path / "again")
    assert json.loads((_snapdir(tmp_path / "again") / "manifest.json").read_text())["format_version"] == 4
    half = _as(bank, "bfloat16")
    half.save(tmp_path / "half")
    assert MemoryBank.load(tmp_path / "half").snapshot().scan.tobytes() == half.snapshot().scan.tobytes()


# ------------------------------------------------------------------ memory
@pytest.mark.parametrize("dtype", SCAN)
def test_scan_bytes_are_halved(dtype):
    """What a scan reads and what the scanning backends hold: n d 2 bytes instead of
    n d 4 (int8: n (d + 12)); the float32 rows are shared with the snapshot (no second
    float32 copy)."""
    rng = np.random.default_rng(2)
    X = rng.normal(size=(1000, 64)).astype(np.float32)
    b32, bh = MemoryBank.from_arrays(X, [0, 600, 1000]), MemoryBank.from_arrays(X, [0, 600, 1000], dtype=dtype)
    if dtype == "int8":
        assert bh.snapshot().scan_nbytes == 1000 * (64 + 12) and b32.snapshot().scan_nbytes == X.nbytes
        assert bh.snapshot().scan.dtype == np.int8 and bh.snapshot().scan_meta.shape == (1000, 3)
        for be in [TorchBackend("cpu")] + ([NativeBackend()] if NATIVE else []):  # no torch copy: the
            v = be.view(bh)  # native kernels read the snapshot's int8 copy, torch the float32 rows
            assert v.Xs is None and v.X.data_ptr() == torch.from_numpy(bh.snapshot().vectors).data_ptr()
        return
    assert bh.snapshot().scan_nbytes * 2 == b32.snapshot().scan_nbytes == X.nbytes
    for be in [TorchBackend("cpu")] + ([NativeBackend()] if NATIVE else []):
        v = be.view(bh)
        assert v.scan.element_size() == 2 and v.scan.nbytes * 2 == X.nbytes and v.scan_dtype == dtype
        assert v.X.data_ptr() == torch.from_numpy(bh.snapshot().vectors).data_ptr()
        assert be.view(b32).Xs is None


def _mapped_rss(paths: list[Path]) -> dict[str, int]:
    """Resident bytes of this process's mappings of ``paths`` (/proc/self/smaps)."""
    out = {str(p): 0 for p in paths}
    text = Path("/proc/self/smaps").read_text()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        head = block.split("\n", 1)[0].split()
        if len(head) >= 6 and head[-1] in out:
            out[head[-1]] += int(re.search(r"^Rss:\s+(\d+) kB", block, re.M).group(1)) << 10
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux") or not NATIVE, reason="/proc/self/smaps; native backend")
@pytest.mark.parametrize("dtype", SCAN)
def test_memory_mapped_store_keeps_half_the_bytes_resident(tmp_path, dtype):
    """A store of 20,480 x 384 rows (30 MiB float32) loaded with mmap; 16 dense queries:
    the float32 bank makes its whole vectors.npy resident; the half bank makes scan.npy
    resident (half of that) plus only the float32 pages of the rows it re-scored (at most
    2 pages per kept candidate), so its resident vector bytes are under 0.6 x."""
    rng = np.random.default_rng(3)
    X = rng.normal(size=(20480, 384)).astype(np.float32)
    off = np.arange(41) * 512
    resident = {}
    keep = []
    for dt in ("float32", dtype):
        path = tmp_path / dt
        MemoryBank.from_arrays(X, off, dtype=dt).save(path)
        bank = MemoryBank.load(path, mmap=True)
        keep.append(bank)
        files = [_snapdir(path) / "vectors.npy", _snapdir(path) / "scan.npy"]
        users = list(range(0, 40, 5)) * 2
        search(bank, rng.normal(size=(len(users), 384)), users, RFMemConfig(), mode="dense", backend="native")
        resident[dt] = {Path(k).name: v for k, v in _mapped_rss(files).items()}
    full = X.nbytes
    assert resident["float32"]["vectors.npy"] >= 0.95 * full
    half = resident[dtype]
    part = 4 if dtype == "int8" else 2  # int8: a quarter (scan_meta.npy, 12 bytes a row, is not counted)
    assert half["scan.npy"] >= 0.8 * full / part and half["scan.npy"] <= full / part + 4096  # (read-ahead maps most)
    margin = {"float16": 16, "bfloat16": 32, "int8": 64}[dtype]
    assert half["vectors.npy"] <= 16 * (10 + margin) * 2 * 4096, half
    assert half["vectors.npy"] + half["scan.npy"] <= 0.6 * resident["float32"]["vectors.npy"], resident


@pytest.mark.skipif(not NATIVE, reason="native backend not built")
def test_native_scan_argument_is_checked():
    X = np.eye(4, dtype=np.float32)
    args = (X, np.array([0, 4]), X, np.zeros(4, np.int64), 2)
    h = X.astype(np.float16).view(np.uint16)
    with pytest.raises(ValueError, match="needs the scan copy"):
        _native.segmented_topk(*args, scan_type="float16")
    with pytest.raises(ValueError, match="scan_type is 'float32'"):
        _native.segmented_topk(*args, scan=h)
    with pytest.raises(ValueError, match="scan must have X's shape"):
        _native.segmented_topk(*args, scan=h[:3], scan_type="float16")
    with pytest.raises(TypeError, match="scan must have dtype uint16"):
        _native.segmented_topk(*args, scan=X.astype(np.float16), scan_type="float16")
    with pytest.raises(ValueError, match="scan_type must be one of"):
        _native.segmented_topk(*args, scan=h, scan_type="fp8")
    c8 = np.zeros((4, 4), np.int8)
    m8 = np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match="needs scan_meta"):
        _native.segmented_topk(*args, scan=c8, scan_type="int8")
    with pytest.raises(TypeError, match="scan must have dtype int8"):
        _native.segmented_topk(*args, scan=h, scan_meta=m8, scan_type="int8")
    with pytest.raises(ValueError, match=r"scan_meta must have shape \(4, 3\)"):
        _native.segmented_topk(*args, scan=c8, scan_meta=m8[:, :2].copy(), scan_type="int8")
    with pytest.raises(ValueError, match="scan_meta is only for scan_type='int8'"):
        _native.segmented_topk(*args, scan=h, scan_meta=m8, scan_type="float16")
    with pytest.raises(ValueError, match="scan_meta is the int8 copy's per-row data"):
        _native.segmented_topk(*args, scan_meta=m8)
