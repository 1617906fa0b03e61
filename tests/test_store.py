"""Crash-safe persistence: save / load, checksums, hand edits, fuzzing, SIGKILL mid-save."""
from __future__ import annotations

import hashlib
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rfmem_fast
from rfmem_fast import MemoryBank, RFMemConfig, search
from rfmem_fast.store import CURRENT, DATA_FILES, FORMAT_VERSION, LEXICAL_FILES, MANIFEST, StoreError

CPU_BACKENDS = [b for b in rfmem_fast.available_backends() if b in ("reference", "torch", "native")]
ROOT = Path(__file__).resolve().parents[1]


def make_bank(seed: int = 0, d: int = 8) -> MemoryBank:
    rng = np.random.default_rng(seed)
    bank = MemoryBank(d)
    bank.add("alice", rng.normal(size=(6, d)), ["m1", 2, "2", "ünï", "😀", ""], texts=["x", "", None, "é\u2028", "\U0010ffff\t\x00", "z"])
    bank.add(17, rng.normal(size=(4, d)), [10, 2**70, -3, "10"])
    bank.add("empty", rng.normal(size=(2, d)), ["e0", "e1"])
    bank.add("日本", rng.normal(size=(5, d)).astype(np.float16), list(range(5)))
    bank.delete("empty", ["e0", "e1"])
    bank.delete("alice", ["m1"])
    bank.update("日本", [3], rng.normal(size=(1, d)), texts=["new"])
    return bank


def assert_same_bank(a: MemoryBank, b: MemoryBank) -> None:
    sa, sb = a.snapshot(), b.snapshot()
    assert a.dim == b.dim and a.version == b.version and a.users == b.users
    assert [type(u) for u in a.users] == [type(u) for u in b.users]
    np.testing.assert_array_equal(sa.vectors, sb.vectors)
    assert sa.vectors.dtype == sb.vectors.dtype == np.float32
    np.testing.assert_array_equal(sa.offsets, sb.offsets)
    assert sa.item_ids.tolist() == sb.item_ids.tolist()
    assert [type(i) for i in sa.item_ids] == [type(i) for i in sb.item_ids]
    assert sa.texts.tolist() == sb.texts.tolist()


def data_dir(path: Path) -> Path:
    return path / json.loads((path / CURRENT).read_text())["dir"]


# ----------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("mmap", [False, True])
def test_round_trip_preserves_everything(tmp_path, mmap):
    bank = make_bank()
    bank.save(tmp_path / "store")
    loaded = MemoryBank.load(tmp_path / "store", mmap=mmap)
    assert_same_bank(bank, loaded)
    assert loaded.user_size("empty") == 0 and loaded.texts_of("alice")[0] == ""
    rng = np.random.default_rng(9)
    Q = rng.normal(size=(8, 8))
    users = ["alice", 17, "日本", "empty"] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no torch warning about a read-only array under mmap
        for be in CPU_BACKENDS:
            for mode in ("dense", "rfmem"):
                r1 = search(bank, Q, users, mode=mode, backend=be)
                r2 = search(loaded, Q, users, mode=mode, backend=be)
                assert r1.ids.tolist() == r2.ids.tolist()
                np.testing.assert_array_equal(r1.scores, r2.scores)


def test_manifest_lists_checksums_of_every_file(tmp_path):
    bank = make_bank()
    bank.save(tmp_path / "s")
    d = data_dir(tmp_path / "s")
    man = json.loads((d / MANIFEST).read_text())
    # every bank is written in format 4 (the lexical index, rfmem_fast.lexical; the creation times)
    assert man["format_version"] == 4 and man["dim"] == 8 and man["dtype"] == "float32"
    assert man["num_users"] == 4 and man["num_items"] == bank.num_items and man["bank_version"] == bank.version
    assert sorted(man["files"]) == sorted(DATA_FILES + LEXICAL_FILES) == sorted(p.name for p in d.iterdir() if p.name != MANIFEST)
    for name, meta in man["files"].items():
        data = (d / name).read_bytes()
        assert meta == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    cur = json.loads((tmp_path / "s" / CURRENT).read_text())
    assert cur["manifest_sha256"] == hashlib.sha256((d / MANIFEST).read_bytes()).hexdigest()
    assert np.load(d / "vectors.npy").dtype == np.float32 and np.load(d / "offsets.npy").dtype == np.int64


def test_save_replaces_and_cleans_up(tmp_path):
    path = tmp_path / "s"
    bank = make_bank()
    bank.save(path)
    (path / ".tmp-00000009-1-dead").mkdir()  # leftover of an interrupted save
    (path / ".tmp-00000009-1-dead" / "vectors.npy").write_bytes(b"junk")
    bank.add("new", np.ones((1, 8)), ["n"])
    bank.save(path)
    assert sorted(p.name for p in path.iterdir()) == [CURRENT, "snap-00000002"]
    assert MemoryBank.load(path).item_ids_of("new") == ["n"]


def test_save_refuses_non_store_targets(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="not a directory"):
        make_bank().save(tmp_path / "file")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="not a store"):
        make_bank().save(tmp_path / "dir")
    assert (tmp_path / "dir" / "notes.txt").read_text() == "mine"
    make_bank().save(tmp_path / "a" / "b" / "c")  # parents are created
    with pytest.raises(StoreError, match="not a directory"):
        MemoryBank.load(tmp_path / "nowhere")
    with pytest.raises(StoreError, match="CURRENT.*missing"):
        MemoryBank.load(tmp_path / "dir")


def test_mmap_load_is_lazy_and_copy_on_write(tmp_path):
    rng = np.random.default_rng(1)
    bank = MemoryBank(64)
    bank.add("u", rng.normal(size=(2000, 64)), list(range(2000)))
    bank.save(tmp_path / "s")
    d = data_dir(tmp_path / "s")
    digest = hashlib.sha256((d / "vectors.npy").read_bytes()).hexdigest()
    loaded = MemoryBank.load(tmp_path / "s", mmap=True)
    v = loaded.snapshot().vectors
    base = v
    while not isinstance(base, np.memmap) and getattr(base, "base", None) is not None:
        base = base.base
    assert isinstance(base, np.memmap) or type(base).__name__ == "mmap"
    # writes after an mmap load copy on write: the file never changes
    loaded.update("u", [0], np.ones((1, 64)))
    loaded.delete("u", [1])
    loaded.add("u", np.ones((1, 64)), ["x"])
    assert loaded.snapshot().item_ids[:2].tolist() == [0, 2]
    np.testing.assert_allclose(loaded.snapshot().vectors[0], np.full(64, 0.125), atol=1e-7)
    assert hashlib.sha256((d / "vectors.npy").read_bytes()).hexdigest() == digest
    loaded.save(tmp_path / "s")  # over the mapped store itself
    assert_same_bank(loaded, MemoryBank.load(tmp_path / "s"))


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc (Linux)")
def test_mmap_does_not_read_vectors_into_memory(tmp_path):
    d, n = 256, 96_000  # ~94 MiB of vectors
    bank = MemoryBank(d)
    rng = np.random.default_rng(2)
    for u in range(4):
        bank.add(u, rng.normal(size=(n // 4, d)).astype(np.float32), list(range(n // 4)))
    bank.save(tmp_path / "s")
    del bank
    page = os.sysconf("SC_PAGE_SIZE")

    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * page

    size = (data_dir(tmp_path / "s") / "vectors.npy").stat().st_size
    for verify in (True, False):
        before = rss()
        loaded = MemoryBank.load(tmp_path / "s", mmap=True, verify=verify)
        grown = rss() - before
        assert grown < size / 4, (verify, grown, size)
        res = search(loaded, np.ones((1, d)), [2], RFMemConfig(out_k=3), mode="dense", backend="torch")
        assert len(res.ids_list(0)) == 3
        del loaded, res


# ----------------------------------------------------------------------------- hand edits
def _flip(p: Path, pos: int) -> None:
    data = bytearray(p.read_bytes())
    data[pos % len(data)] ^= 0x01
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("name", list(DATA_FILES) + list(LEXICAL_FILES) + [MANIFEST])
def test_changed_byte_deleted_or_truncated_file_is_refused(tmp_path, name):
    make_bank().save(tmp_path / "s")
    d = data_dir(tmp_path / "s")
    pristine = tmp_path / "pristine"
    shutil.copytree(tmp_path / "s", pristine)
    size = (d / name).stat().st_size
    for pos in (size // 2, size - 1):
        _flip(d / name, pos)
        with pytest.raises(StoreError, match=name.replace(".", r"\.")):
            MemoryBank.load(tmp_path / "s")
        _flip(d / name, pos)
    MemoryBank.load(tmp_path / "s")  # restored
    data = (d / name).read_bytes()
    (d / name).write_bytes(data[:-3])
    with pytest.raises(StoreError, match=name.replace(".", r"\.")):
        MemoryBank.load(tmp_path / "s", verify=False)
    (d / name).unlink()
    with pytest.raises(StoreError, match=name.replace(".", r"\.") + ".*missing"):
        MemoryBank.load(tmp_path / "s", verify=False)


def _rewrite_manifest(path: Path, **changes) -> None:
    """Edit the manifest AND fix CURRENT's checksum, as a careful hand-editor would."""
    d = data_dir(path)
    man = json.loads((d / MANIFEST).read_text())
    man.update(changes)
    raw = json.dumps(man).encode()
    (d / MANIFEST).write_bytes(raw)
    cur = json.loads((path / CURRENT).read_text())
    cur["manifest_sha256"] = hashlib.sha256(raw).hexdigest()
    (path / CURRENT).write_text(json.dumps(cur))


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"format_version": FORMAT_VERSION + 1}, "newer"),
        ({"format_version": 0}, "format_version"),
        ({"dim": 9}, "vectors.npy"),
        ({"num_items": 3}, "offsets.npy|ids.json"),
        ({"num_users": 2}, "offsets.npy"),
        ({"dtype": "float16"}, "dtype|scan\\.npy"),  # format 3 allows float16, then scan.npy is missing
        ({"format": "other"}, "manifest"),
        ({"files": {}}, "files"),
        ({"bank_version": -1}, "bank_version"),
    ],
)
def test_edited_manifest_is_refused(tmp_path, changes, match):
    make_bank().save(tmp_path / "s")
    _rewrite_manifest(tmp_path / "s", **changes)
    with pytest.raises(StoreError, match=match):
        MemoryBank.load(tmp_path / "s")


def test_edited_manifest_without_fixing_current_is_refused(tmp_path):
    make_bank().save(tmp_path / "s")
    d = data_dir(tmp_path / "s")
    man = json.loads((d / MANIFEST).read_text())
    man["bank_version"] += 1
    (d / MANIFEST).write_text(json.dumps(man))
    with pytest.raises(StoreError, match="manifest.json.*checksum"):
        MemoryBank.load(tmp_path / "s", verify=False)


def test_edited_current_or_data_is_refused(tmp_path):
    bank = make_bank()
    bank.save(tmp_path / "s")
    d = data_dir(tmp_path / "s")
    cur = tmp_path / "s" / CURRENT
    good = cur.read_bytes()
    for bad in (b"", b"{", b"[]", json.dumps({"format": "rfmem_fast.store", "dir": "../x", "manifest_sha256": "0" * 64}).encode(),
                json.dumps({"format": "rfmem_fast.store", "dir": "snap-00000099", "manifest_sha256": "0" * 64}).encode(),
                b"\xff\xfe"):
        cur.write_bytes(bad)
        with pytest.raises(StoreError, match="CURRENT|snap-00000099"):
            MemoryBank.load(tmp_path / "s")
    cur.write_bytes(good)
    # a valid-looking ids.json with its checksum fixed: still refused for bad content
    ids = json.loads((d / "ids.json").read_text())
    ids[0] = 1.5
    raw = json.dumps(ids).encode()
    (d / "ids.json").write_bytes(raw)
    man = json.loads((d / MANIFEST).read_text())
    man["files"]["ids.json"] = {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
    _rewrite_manifest(tmp_path / "s", files=man["files"])
    with pytest.raises(StoreError, match="ids.json.*str or int"):
        MemoryBank.load(tmp_path / "s")


def test_verify_false_skips_checksums_only(tmp_path):
    make_bank().save(tmp_path / "s")
    d = data_dir(tmp_path / "s")
    vec = d / "vectors.npy"
    _flip(vec, vec.stat().st_size - 2)  # inside the last float: only a checksum sees it
    with pytest.raises(StoreError, match="vectors.npy.*checksum"):
        MemoryBank.load(tmp_path / "s")
    MemoryBank.load(tmp_path / "s", verify=False)  # documented: not detected
    MemoryBank.load(tmp_path / "s", verify=False, mmap=True)


# ----------------------------------------------------------------------------- fuzzing
_FUZZ_FILES = list(DATA_FILES) + [MANIFEST, CURRENT]


@pytest.fixture(scope="module")
def fuzz_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "s"
    bank = make_bank(3, d=4)
    bank.save(path)
    return path, bank


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    which=st.sampled_from(_FUZZ_FILES),
    edits=st.lists(
        st.tuples(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]), st.integers(0, 1 << 30), st.integers(0, 255)),
        min_size=1,
        max_size=4,
    ),
    verify=st.booleans(),
    mmap=st.booleans(),
)
def test_fuzz_load_gives_store_error_or_the_bank(fuzz_store, which, edits, verify, mmap):
    src, bank = fuzz_store
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s"
        shutil.copytree(src, path)
        target = path / CURRENT if which == CURRENT else data_dir(path) / which
        data = bytearray(target.read_bytes())
        for op, pos, byte in edits:
            p = pos % max(1, len(data))
            if op == "flip" and data:
                data[p] ^= 1 << (byte % 8)
            elif op == "set" and data:
                data[p] = byte
            elif op == "insert":
                data.insert(p, byte)
            elif op == "delete" and data:
                del data[p]
            elif op == "truncate":
                del data[p:]
        target.write_bytes(bytes(data))
        try:
            loaded = MemoryBank.load(path, mmap=mmap, verify=verify)
        except StoreError as exc:
            assert str(exc)  # a clear message naming the file
            return
        if verify:
            assert_same_bank(bank, loaded)
        else:  # without checksums a flipped data byte may load: still a structurally valid bank
            snap = loaded.snapshot()
            assert snap.vectors.shape == (loaded.num_items, loaded.dim)
            del loaded, snap


# ----------------------------------------------------------------------------- crash test
_CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    sys.path.insert(0, {root!r})
    import rfmem_fast.store as store
    from rfmem_fast import MemoryBank

    path, target, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = np.random.default_rng(7)
    bank = MemoryBank(32)
    bank.add("u", rng.normal(size=(n, 32)), list(range(n)))
    bank.add("v", rng.normal(size=(3, 32)), ["a", "b", "c"])

    def hook(stage):
        print("STAGE", stage, flush=True)
        if stage == target:
            time.sleep(120)

    store._hook = hook
    print("READY", flush=True)
    if target == "loop":
        i = 0
        while True:
            bank.add("v", rng.normal(size=(1, 32)), ["x%d" % i])
            bank.save(path)
            i += 1
    bank.delete("v", ["a"])
    bank.save(path)
    print("DONE", flush=True)
    """
)


def _run_child(path: Path, target: str, n: int, kill_after: float | None = None) -> list[str]:
    """Run the child, SIGKILL it at ``target`` (or ``kill_after`` s after READY); return its lines."""
    script = _CHILD.format(root=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(path), target, str(n)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
    )
    lines: list[str] = []
    pending = b""
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + 180  # generous: a loaded CI machine imports torch and fsyncs slowly
    kill_at = None
    done = False
    try:
        while not done:
            timeout = deadline - time.monotonic()
            if kill_at is not None:
                timeout = min(timeout, kill_at - time.monotonic())
            if timeout <= 0:
                break
            # select on the raw pipe and split lines here: a buffered reader could hold several
            # lines that select no longer reports, and the test would wait for the child's sleep
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            pending += chunk
            *complete, pending = pending.split(b"\n")
            for raw in complete:
                line = raw.decode().strip()
                lines.append(line)
                if line == "READY" and kill_after is not None:
                    kill_at = time.monotonic() + kill_after
                if line == f"STAGE {target}":
                    done = True
                    break
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, lines, proc.stderr.read().decode(errors="replace"))
    proc.stderr.close()
    proc.stdout.close()
    return lines


def _old_store(path: Path) -> MemoryBank:
    rng = np.random.default_rng(7)
    bank = MemoryBank(32)
    bank.add("u", rng.normal(size=(50, 32)), list(range(50)))
    bank.add("v", rng.normal(size=(3, 32)), ["a", "b", "c"])
    bank.add("old", np.ones((1, 32)), ["o"])
    bank.save(path)
    return bank


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
@pytest.mark.parametrize(
    "target, committed",
    [("file:vectors.npy", False), ("file:texts.json", False), ("before_commit", False), ("after_commit", True)],
)
def test_sigkill_during_save_leaves_a_loadable_store(tmp_path, target, committed):
    path = tmp_path / "s"
    old = _old_store(path)
    lines = _run_child(path, target, 50)
    assert f"STAGE {target}" in lines
    loaded = MemoryBank.load(path)
    if committed:  # killed after the CURRENT swap: the new store, complete
        assert loaded.users == ["u", "v"] and loaded.item_ids_of("v") == ["b", "c"]
    else:  # killed before: the previous store, intact
        assert_same_bank(old, loaded)
    # the next save works and removes the debris
    loaded.add("later", np.ones((1, 32)), ["l"])
    loaded.save(path)
    names = sorted(p.name for p in path.iterdir())
    assert len(names) == 2 and names[0] == CURRENT and names[1].startswith("snap-"), names
    assert MemoryBank.load(path).item_ids_of("later") == ["l"]


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_at_random_times_during_repeated_saves(tmp_path):
    rnd = random.Random(11)
    path = tmp_path / "s"
    _old_store(path)
    for _ in range(2):
        _run_child(path, "loop", 20_000, kill_after=rnd.uniform(0.2, 1.5))  # ~2.5 MB per save
        loaded = MemoryBank.load(path)
        snap = loaded.snapshot()
        if "old" in loaded:
            assert loaded.item_ids_of("old") == ["o"]
        else:  # one of the child's saves: "v" holds a, b, c, x0 .. x(k-1) in order
            ids = loaded.item_ids_of("v")
            assert ids[:3] == ["a", "b", "c"] and ids[3:] == [f"x{i}" for i in range(len(ids) - 3)]
            assert loaded.user_size("u") == 20_000
        assert np.isfinite(snap.vectors).all()
