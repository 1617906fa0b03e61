"""Crash-safe persistence of a memory bank's arrays (``bank.save`` / ``MemoryBank.load``).

The store reads and writes arrays and manifests only: :func:`write_store` writes a bank
snapshot's arrays (and its items' metadata), :func:`read_store` reads them back, checked,
as a :class:`StoreContents`; :class:`~rfmem_fast.bank.MemoryBank` is built from that
(``MemoryBank.load``). The store imports nothing of the bank (the bank sits above it:
``docs/internals/layers.md``).

Layout of a store directory ``PATH``::

    PATH/CURRENT                 {"format", "dir": "snap-00000007", "manifest_sha256"}
    PATH/snap-00000007/manifest.json   format, format_version, dim, dtype, counts,
                                       bank_version, {file: {"sha256", "bytes"}}
    PATH/snap-00000007/vectors.npy     float32 [n, d], live rows in CSR order (unit rows)
    PATH/snap-00000007/offsets.npy     int64 [U + 1]
    PATH/snap-00000007/users.json      [U user keys]      (JSON keeps str vs int)
    PATH/snap-00000007/ids.json        [n item ids]       (str or int)
    PATH/snap-00000007/texts.json      [n texts]          (str or null)
    PATH/snap-00000007/created_at.npy  float64 "<f8" [n]: each item's creation time,
                                       seconds since the Unix epoch, UTC (format 4)
    PATH/snap-00000007/metadata.json   [n metadata objects] (object or null; optional:
                                       written only when some item has metadata, so a
                                       store without it, older ones included, loads as
                                       "no metadata"; covered by the manifest's checksums)
    PATH/snap-00000007/scan.npy        float16 "<f2" / bfloat16 bits "<u2" [n, d]: the scan
                                       copy of a half-precision bank (format >= 2); int8
                                       "|i1" [n, d]: the codes of an int8 bank (format 5)
    PATH/snap-00000007/scan_meta.npy   float32 "<f4" [n, 3]: an int8 bank's per-row scale,
                                       residual-norm bound and norm bound (format 5)
    PATH/snap-00000007/lex_ptr.npy     int64 [n + 1]  } the lexical forward index
    PATH/snap-00000007/lex_terms.npy   int32 [nnz]    } (rfmem_fast.lexical): each row's
    PATH/snap-00000007/lex_tf.npy      int32 [nnz]    } distinct token ids and counts
    PATH/snap-00000007/lex_vocab.json  [V tokens]     (format 3; manifest "lexical":
                                       {"stemmer": null | "english", "tokenizer"})
    PATH/snap-00000007/threads.json    [n threads]    (str, int or null: each item's
                                       conversation thread; format 6)
    PATH/snap-00000007/positions.npy   int64 "<i8" [n]: each item's position in its
                                       thread, -1 for none (format 6)

Versions: format 1 holds float32 banks (``dtype`` "float32", the five files above, plus
the optional metadata.json); format 2 adds ``dtype`` "float16" / "bfloat16" with
``scan.npy``; format 3 adds the lexical index (the four ``lex_*`` files: the token ids
of every item, so a load does not re-tokenise; the per-user postings are rebuilt from
them on first use); format 4 adds ``created_at.npy`` (the items' creation times,
:meth:`~rfmem_fast.bank.MemoryBank.add`); format 5 adds ``dtype`` "int8" (``scan.npy`` int8
codes and ``scan_meta.npy``: :func:`rfmem_fast.precision.int8_scan_copy`); format 6 adds
``threads.json`` and ``positions.npy`` (the items' conversation threads and positions,
:meth:`~rfmem_fast.bank.MemoryBank.add`). A bank in which some item has a thread or a
position is written as format 6; otherwise an int8 bank is written as format 5, every other
bank as format 4 (readable by versions without int8 banks); this code reads all six (a
format 1 / 2 store builds its lexical index from its texts at load, with no stemmer; a
store of format 1 to 3 loads with every creation time unknown, ``NaN``, which no
``created_at`` comparison matches: :mod:`rfmem_fast.filters`; a store of format 1 to 5
loads with no thread and no position), and refuses newer versions with a StoreError.

JSON is written with ``ensure_ascii=True`` (any Python str, lone surrogates included,
round-trips exactly) and read as UTF-8.

Atomic save (the ``CURRENT`` pointer design): the new store is written into a hidden
sibling ``PATH/.tmp-*`` directory, every file is fsynced, then the directory; it is
renamed to ``PATH/snap-<generation>`` and ``PATH`` is fsynced; then a new ``CURRENT``
is written to a temporary file, fsynced and swapped in with ``os.replace`` (atomic on
POSIX and Windows), and ``PATH`` is fsynced again; only then are older ``snap-*`` and
leftover ``.tmp-*`` directories removed. A crash (even SIGKILL or power loss) at any
point leaves ``CURRENT`` naming either the complete old store or the complete new one;
garbage from an interrupted save is removed by the next save. ``CURRENT`` holds the
manifest's sha256 and the manifest holds every data file's sha256 and size, so any
edit, truncation or deletion is detected on load.

Concurrent saves of one bank are consistent (each writes one snapshot); concurrent
saves to ONE path from several processes are not supported (the last commit wins,
and cleanup may remove a save in progress); saves from one process to one path are
serialised by a lock.

Errors: :class:`StoreError` (a ``ValueError``) names the file and what is wrong.

Testing hook: ``rfmem_fast.store._hook`` (None by default) is called with a stage
name ("file:<name>" after each file, "before_commit", "after_commit") so that a test
can kill a saving process at a chosen point (tests/test_store.py).
"""
from __future__ import annotations

import hashlib
import io
import json
import mmap as mmap_module
import os
import re
import shutil
import threading
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .lexical import STEMMERS, Analyzer, LexicalIndex, Vocabulary
from .precision import BANK_DTYPES, HALF_DTYPES, SCAN_DTYPES, int8_copy_mismatch, storage_dtype, to_scan_copy

FORMAT_NAME = "rfmem_fast.store"
#: the newest format this code reads. It writes version 6 for a bank with threads or
#: positions, else version 5 for an int8 bank and version 4 for the others (format_version_for).
FORMAT_VERSION = 6
#: the lexical index's files (format 3)
LEXICAL_FILES = ("lex_ptr.npy", "lex_terms.npy", "lex_tf.npy", "lex_vocab.json")
#: what the manifest's "lexical" entry names as the tokenizer (rfmem_fast.lexical)
LEXICAL_TOKENIZER = "bm25s-en"
CURRENT = "CURRENT"
MANIFEST = "manifest.json"
DATA_FILES = ("vectors.npy", "offsets.npy", "users.json", "ids.json", "texts.json", "created_at.npy")
#: the data file of format 4 (the items' creation times, float64 [n])
CREATED_FILE = "created_at.npy"
#: files a store may hold besides its data files (listed in the manifest when present)
OPTIONAL_FILES = ("metadata.json",)
#: the scan copy of a half-precision bank (format 2): float16 ``<f2``, or the bfloat16
#: bits as ``<u2``, [n, d], the rounding of vectors.npy
SCAN_FILE = "scan.npy"
#: an int8 bank's per-row data (format 5): float32 ``<f4`` [n, 3]
SCAN_META_FILE = "scan_meta.npy"
#: the items' threads (JSON list of str / int / null) and positions (int64 ``<i8``, -1: none), format 6
THREAD_FILES = ("threads.json", "positions.npy")


def data_files(dtype: str, version: int = FORMAT_VERSION) -> tuple[str, ...]:
    """The data files a store of a bank of ``dtype`` in format ``version`` must hold (besides OPTIONAL_FILES)."""
    base = DATA_FILES if version >= 4 else tuple(f for f in DATA_FILES if f != CREATED_FILE)
    scan = (SCAN_FILE, SCAN_META_FILE) if dtype == "int8" else (SCAN_FILE,) if dtype in HALF_DTYPES else ()
    return base + scan + (LEXICAL_FILES if version >= 3 else ()) + (THREAD_FILES if version >= 6 else ())


def format_version_for(dtype: str, threads: bool = False) -> int:
    """The format version a bank of ``dtype`` is written in: 6 when some item has a thread
    or a position (``threads``), else 5 for int8 (its scan copy), 4 for the others (the
    lexical index and the creation times)."""
    if threads:
        return 6
    return 5 if dtype == "int8" else 4
_SNAP_RE = re.compile(r"^snap-(\d{8,})$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 22  # bytes per read while hashing / verifying
_NORM_TOL = 1e-3  # |norm - 1| allowed for a stored row (rows are float32 unit vectors)

#: test hook: called with a stage name ("file:<name>", "before_commit", "after_commit")
_hook: Callable[[str], None] | None = None
_path_locks: dict[str, threading.Lock] = {}
_path_locks_guard = threading.Lock()

__all__ = [
    "StoreError", "StoreContents", "write_store", "read_store",
    "FORMAT_VERSION", "FORMAT_NAME",
]  # fmt: skip


@dataclass(frozen=True)
class StoreContents:
    """What a store holds, read and checked by :func:`read_store`: a bank is built from it.

    Attributes:
        dim: vector dimension d (int >= 1).
        dtype: "float32", "float16", "bfloat16" or "int8".
        version: the bank's write counter when it was saved.
        vectors: float32 [n, d] unit rows in CSR order (read, or memory-mapped).
        offsets: int64 [U + 1] CSR offsets.
        users: the U user keys (tuple of str / int).
        item_ids: object [n] item ids (str / int); texts: object [n] (str / None).
        scan: the half-precision or int8 scan copy [n, d] (:mod:`rfmem_fast.precision`), or None.
        scan_meta: the int8 copy's per-row data float32 [n, 3], or None.
        metadata: list [n] of dict / None, or None when the store has no metadata.json.
        lexical_stemmer: the lexical index's stemmer (None or "english").
        lexical: the stored :class:`~rfmem_fast.lexical.LexicalIndex` (format 3), or
            None (format 1 / 2: the bank indexes its texts when it is built).
        path: the store directory (str); mmap: whether the rows are memory-mapped.
        created_at: float64 [n] the items' creation times (seconds since the Unix epoch,
            UTC; format 4), or None (format < 4: unknown, NaN in the bank).
        threads: object [n] the items' threads (str / int / None; format 6), or None (no
            item has one, or format < 6).
        positions: int64 [n] the items' positions (-1: none; format 6), or None.
    """

    dim: int
    dtype: str
    version: int
    vectors: np.ndarray
    offsets: np.ndarray
    users: tuple
    item_ids: np.ndarray
    texts: np.ndarray
    scan: np.ndarray | None
    metadata: list | None
    lexical_stemmer: str | None
    lexical: LexicalIndex | None
    path: str
    mmap: bool
    created_at: np.ndarray | None = None
    scan_meta: np.ndarray | None = None
    threads: np.ndarray | None = None
    positions: np.ndarray | None = None


class StoreError(ValueError):
    """A store directory cannot be written or read: missing, corrupt, truncated,
    edited by hand, or written by a newer format version.

    Attributes:
        path: the offending file or directory (str), also in the message.
    """

    def __init__(self, path: Any, what: str) -> None:
        self.path = str(path)
        self.what = what
        super().__init__(f"{self.path}: {what}")

    def __reduce__(self):  # picklable across processes despite the two-argument constructor
        return (type(self), (self.path, self.what))


def _stage(name: str) -> None:
    if _hook is not None:
        _hook(name)


# ---------------------------------------------------------------------------- writing
def _fsync_dir(path: Path) -> None:
    """fsync a directory so that renames inside it are durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


class _HashingWriter(io.RawIOBase):
    """A write-only file wrapper that feeds every byte to sha256 and counts them."""

    def __init__(self, f: Any) -> None:
        super().__init__()
        self._f = f
        self.sha = hashlib.sha256()
        self.nbytes = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        self.sha.update(mv)
        self._f.write(mv)
        self.nbytes += mv.nbytes
        return mv.nbytes


def _write_file(path: Path, write: Callable[[Any], None]) -> dict:
    with open(path, "xb") as f:
        w = _HashingWriter(f)
        write(w)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": w.sha.hexdigest(), "bytes": w.nbytes}


def _write_array(arr: np.ndarray) -> Callable[[Any], None]:
    def write(w: Any) -> None:
        np.lib.format.write_array(w, np.ascontiguousarray(arr), allow_pickle=False)

    return write


def _write_json(obj: Any) -> Callable[[Any], None]:
    data = json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode("ascii")

    def write(w: Any) -> None:
        w.write(data)

    return write


def _path_lock(path: Path) -> threading.Lock:
    key = os.path.abspath(path)
    with _path_locks_guard:
        return _path_locks.setdefault(key, threading.Lock())


def _generation(path: Path) -> int:
    gen = 0
    for entry in path.iterdir():
        m = _SNAP_RE.match(entry.name)
        if m:
            gen = max(gen, int(m.group(1)))
    return gen + 1


def write_store(path: Any, snapshot: Any, metadata: list | None = None, *, dim: int,
                lexical_stemmer: str | None = None) -> Path:  # fmt: skip
    """Write a bank snapshot's arrays to the store directory ``path``, atomically.

    Args:
        path: directory; created (with parents) if absent. An existing store there is
            replaced atomically; an existing directory that is not a store (non-empty
            and without ``CURRENT``) is refused.
        snapshot: a :class:`~rfmem_fast.bank.BankSnapshot` (read through its attributes
            ``vectors``, ``offsets``, ``users``, ``item_ids``, ``texts``, ``scan``, ``scan_meta``,
            ``dtype``, ``version``, ``lexical``, ``num_items``, ``num_users``).
        metadata: list [n] of JSON-serialisable dict / None, one per row, or None (no
            metadata.json is written).
        dim: the bank's vector dimension (the manifest's ``dim``).
        lexical_stemmer: the stemmer a snapshot without a lexical index is indexed
            with (a hand-made snapshot; a bank's snapshots carry their index).

    Returns:
        Path of the committed data directory (``path/snap-<generation>``).

    Raises:
        StoreError: ``path`` is a file, or a non-empty directory that is not a store,
            or it cannot be created or written into (a parent is a file, a dangling
            symlink, no permission, a read-only file system: the OS error is chained
            as ``__cause__`` and named in the message); nothing is written then.
        OSError: I/O failure while the files are written (disk full, ...); the
            previous store is left intact (see the module docstring).
    """
    path = Path(os.fspath(path))
    snap = snapshot
    with _path_lock(path):
        if path.exists() and not path.is_dir():
            raise StoreError(path, "exists and is not a directory; refusing to overwrite it")
        try:
            if path.is_dir():
                if any(True for _ in path.iterdir()) and not (path / CURRENT).is_file():
                    raise StoreError(path, "is a non-empty directory without a CURRENT file (not a store); refusing to overwrite it")
            else:
                path.mkdir(parents=True, exist_ok=True)
                _fsync_dir(path.parent)
            gen = _generation(path)
            tmp = path / f".tmp-{gen:08d}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            tmp.mkdir()
        except OSError as exc:  # the directory cannot be created, listed or written into
            reason = exc.strerror or str(exc)
            where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
            raise StoreError(path, f"cannot be created or written: {type(exc).__name__}: {reason}{where}") from exc
        try:
            files: dict[str, dict] = {}
            payload: list[tuple[str, Callable[[Any], None]]] = [
                ("vectors.npy", _write_array(snap.vectors.astype(np.float32, copy=False))),
                ("offsets.npy", _write_array(snap.offsets.astype(np.int64, copy=False))),
                ("users.json", _write_json(list(snap.users))),
                ("ids.json", _write_json(snap.item_ids.tolist())),
                ("texts.json", _write_json(snap.texts.tolist() if snap.texts is not None else [None] * snap.num_items)),
                (CREATED_FILE, _write_array(np.asarray(snap.created_at_or_nan, dtype="<f8"))),
            ]
            if snap.scan is not None:
                payload.append((SCAN_FILE, _write_array(snap.scan)))
            if getattr(snap, "scan_meta", None) is not None:
                payload.append((SCAN_META_FILE, _write_array(np.asarray(snap.scan_meta, dtype="<f4"))))
            lex = snap.lexical
            if lex is None:  # a hand-made snapshot: index its texts
                texts = snap.texts if snap.texts is not None else [None] * snap.num_items
                lex = LexicalIndex.from_texts(snap.offsets, texts, Vocabulary(), Analyzer(lexical_stemmer))
            vocab = list(lex.vocab.tokens)  # append-only: a prefix covers every id of the snapshot
            payload += [
                ("lex_ptr.npy", _write_array(np.asarray(lex.ptr, dtype=np.int64))),
                ("lex_terms.npy", _write_array(np.asarray(lex.terms, dtype=np.int32))),
                ("lex_tf.npy", _write_array(np.asarray(lex.tf, dtype=np.int32))),
                ("lex_vocab.json", _write_json(vocab)),
            ]
            thr, pos = getattr(snap, "threads", None), getattr(snap, "positions", None)
            has_threads = thr is not None or pos is not None
            if has_threads:
                n = snap.num_items
                payload += [
                    ("threads.json", _write_json(thr.tolist() if thr is not None else [None] * n)),
                    ("positions.npy", _write_array(np.asarray(pos if pos is not None else np.full(n, -1), dtype="<i8"))),
                ]
            if metadata is not None:
                payload.append(("metadata.json", _write_json(metadata)))
            for name, write in payload:
                files[name] = _write_file(tmp / name, write)
                _stage(f"file:{name}")
            manifest = {
                "format": FORMAT_NAME,
                "format_version": format_version_for(snap.dtype, has_threads),
                "dim": int(dim),
                "dtype": snap.dtype,
                "num_users": snap.num_users,
                "num_items": snap.num_items,
                "bank_version": int(snap.version),
                "lexical": {"stemmer": lex.analyzer.stemmer, "tokenizer": LEXICAL_TOKENIZER},
                "files": files,
            }
            mf = _write_file(tmp / MANIFEST, _write_json(manifest))
            _stage(f"file:{MANIFEST}")
            _fsync_dir(tmp)
            final = path / f"snap-{gen:08d}"
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_dir(path)
        _stage("before_commit")
        cur_tmp = path / f".CURRENT.tmp-{uuid.uuid4().hex[:12]}"
        current = {"format": FORMAT_NAME, "dir": final.name, "manifest_sha256": mf["sha256"]}
        try:
            _write_file(cur_tmp, _write_json(current))
            os.replace(cur_tmp, path / CURRENT)
        except BaseException:
            try:
                cur_tmp.unlink()
            except OSError:
                pass
            raise
        _fsync_dir(path)
        _stage("after_commit")
        for entry in path.iterdir():  # older generations and leftovers of interrupted saves
            name = entry.name
            if name == final.name or name == CURRENT:
                continue
            if _SNAP_RE.match(name) or name.startswith(".tmp-") or name.startswith(".CURRENT.tmp-"):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    try:
                        entry.unlink()
                    except OSError:
                        pass
        return final


# ---------------------------------------------------------------------------- reading
def _read_bytes(path: Path, missing: str) -> bytes:
    """The bytes of ``path``; StoreError (``missing`` or the OS error) naming it otherwise."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise StoreError(path, missing) from None
    except OSError as exc:
        raise StoreError(path, f"cannot be read: {exc}") from None


def _read_small(path: Path, expect: dict | None, verify: bool) -> bytes:
    """Read a whole (JSON) file, checking its size and checksum against ``expect``."""
    data = _read_bytes(path, "missing file")
    if expect is not None:
        if len(data) != expect["bytes"]:
            raise StoreError(path, f"has {len(data)} bytes, the manifest says {expect['bytes']} (truncated or edited)")
        if verify and hashlib.sha256(data).hexdigest() != expect["sha256"]:
            raise StoreError(path, "sha256 checksum mismatch (corrupt or edited)")
    return data


def _parse_json(path: Path, data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise StoreError(path, f"is not valid UTF-8 JSON: {exc}") from None


def _check_size(path: Path, expect: dict) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise StoreError(path, "missing file") from None
    if size != expect["bytes"]:
        raise StoreError(path, f"has {size} bytes, the manifest says {expect['bytes']} (truncated or edited)")


def _npy_header(path: Path, dtype: np.dtype, shape: tuple) -> int:
    """Check a .npy header (dtype, C order, shape, size) and return the data offset."""
    try:
        with open(path, "rb") as f, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. numpy's "created on Python 2" for a mangled header
            major, _minor = np.lib.format.read_magic(f)
            if major == 1:
                shp, fortran, dt = np.lib.format.read_array_header_1_0(f)
            elif major in (2, 3):
                shp, fortran, dt = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"unsupported .npy version {major}")
            offset = f.tell()
    except FileNotFoundError:
        raise StoreError(path, "missing file") from None
    except Exception as exc:  # untrusted header text: any parse failure is corruption
        raise StoreError(path, f"bad .npy header: {type(exc).__name__}: {exc}") from None
    if dt != dtype or fortran or tuple(shp) != tuple(shape):
        raise StoreError(
            path,
            f"holds {dt} {tuple(shp)}{' (Fortran order)' if fortran else ''}, expected {dtype} {tuple(shape)} C order",
        )
    size = path.stat().st_size
    need = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size != need:
        raise StoreError(path, f"has {size} bytes, its header needs {need} (truncated or padded)")
    return offset


def _read_rows(
    data_dir: Path, files: dict, n: int, d: int, dtype: str, mmap: bool, verify: bool
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """vectors.npy as float32 [n, d] (and scan.npy for a half-precision or int8 bank, and
    scan_meta.npy for int8): read (or map) them, hashing and checking rows in chunks.

    With ``verify`` every byte is hashed, every row checked (finite, unit norm) and every
    row of the scan copy checked to be the rounding (int8: the quantisation,
    :func:`rfmem_fast.precision.int8_copy_mismatch`) of its float32 row, in one streaming
    pass over the files; under ``mmap`` that pass reads the files with ordinary reads
    into small buffers, so the mappings themselves stay untouched (not resident).

    Returns:
        (vectors, scan or None, scan_meta or None).
    """
    half = dtype in HALF_DTYPES
    i8 = dtype == "int8"
    specs = [("vectors.npy", np.dtype("<f4"), d)]
    if dtype in SCAN_DTYPES:
        specs.append((SCAN_FILE, storage_dtype(dtype), d))
    if i8:
        specs.append((SCAN_META_FILE, np.dtype("<f4"), 3))
    paths = [data_dir / name for name, _, _ in specs]
    offsets = [_npy_header(path, dt, (n, w)) for path, (_, dt, w) in zip(paths, specs)]
    outs = [None if mmap else np.empty((n, w), dtype=dt) for _, dt, w in specs]
    if verify or not mmap:
        rows_per = max(1, _CHUNK // max(1, d * 4))
        bufs = [np.empty((rows_per, w), dtype=dt) if mmap else None for _, dt, w in specs]
        shas = [hashlib.sha256() for _ in specs]
        bad: list[str | None] = [None] * len(specs)
        handles = []
        try:
            for path, off, sha in zip(paths, offsets, shas):
                f = open(path, "rb")
                handles.append(f)
                sha.update(f.read(off))
            for a in range(0, n, rows_per):
                b = min(n, a + rows_per)
                blocks = []
                for i, f in enumerate(handles):
                    block = bufs[i][: b - a] if mmap else outs[i][a:b]
                    mv = memoryview(block).cast("B")
                    if f.readinto(mv) != mv.nbytes:
                        raise StoreError(paths[i], "ends early (truncated)")
                    if verify:
                        shas[i].update(mv)
                    blocks.append(block)
                if verify and bad[0] is None:
                    with np.errstate(all="ignore"):
                        norms = np.linalg.norm(blocks[0].astype(np.float64), axis=1)
                    off = ~(np.abs(norms - 1.0) <= _NORM_TOL)  # NaN / Inf included
                    if off.any():
                        bad[0] = f"row {a + int(np.flatnonzero(off)[0])} is not a finite unit vector"
                if verify and half and bad[0] is None and bad[1] is None:
                    same = (to_scan_copy(blocks[0], dtype).view(np.uint16) == blocks[1].view(np.uint16)).all(axis=1)
                    if not same.all():
                        bad[1] = f"row {a + int(np.flatnonzero(~same)[0])} is not the {dtype} rounding of its float32 row"
                if verify and i8 and bad[0] is None and bad[1] is None:
                    first = int8_copy_mismatch(blocks[0], blocks[1], blocks[2])
                    if first >= 0:
                        bad[1] = f"row {a + first} is not the int8 quantisation of its float32 row (with scan_meta.npy)"
            if verify:
                for f, sha in zip(handles, shas):
                    sha.update(f.read())
        except OSError as exc:
            raise StoreError(paths[len(handles) - 1 if handles else 0], f"cannot be read: {exc}") from None
        finally:
            for f in handles:
                f.close()
        if verify:
            for path, (name, _, _), sha in zip(paths, specs, shas):
                if sha.hexdigest() != files[name]["sha256"]:
                    raise StoreError(path, "sha256 checksum mismatch (corrupt or edited)")
        for path, msg in zip(paths, bad):
            if msg is not None:  # checksums fine: the store was written with bad rows
                raise StoreError(path, msg)
    if mmap:
        for i, (path, (_, dt, w)) in enumerate(zip(paths, specs)):
            if n == 0:
                outs[i] = np.zeros((0, w), dtype=dt)
                continue
            try:
                # copy-on-write map: writable in memory (torch wraps it without a copy or a
                # warning), never written back to the file, pages read only when touched
                mm = np.load(path, mmap_mode="c", allow_pickle=False)
            except (ValueError, OSError, EOFError) as exc:
                raise StoreError(path, f"cannot be mapped: {exc}") from None
            if len(specs) > 1 and i == 0:
                _random_access(path, mm)
            outs[i] = np.asarray(mm)
    return outs[0], (outs[1] if len(specs) > 1 else None), (outs[2] if i8 else None)


def _random_access(path: Path, mm: np.memmap) -> None:
    """Hints for the float32 rows of a half-precision or int8 bank, which searches read only for
    the candidates they re-score (a few rows per query, at random): drop the file's
    clean pages from the page cache (the verify pass read them) and map it for random
    access (no read-ahead), so that a search makes resident only the pages of the rows
    it reads. Best effort: silently skipped where the OS lacks these calls."""
    try:
        if hasattr(os, "posix_fadvise"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        raw = getattr(mm, "_mmap", None)
        if raw is not None and hasattr(raw, "madvise") and hasattr(mmap_module, "MADV_RANDOM"):
            raw.madvise(mmap_module.MADV_RANDOM)
    except (OSError, ValueError):
        pass


def _read_offsets(path: Path, expect: dict, u: int, n: int, verify: bool) -> np.ndarray:
    dt = np.dtype("<i8")
    _npy_header(path, dt, (u + 1,))
    data = _read_small(path, expect, verify)
    try:
        off = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise StoreError(path, f"cannot be read: {exc}") from None
    off = np.ascontiguousarray(off, dtype=np.int64)
    if off[0] != 0 or off[-1] != n or (np.diff(off) < 0).any():
        raise StoreError(path, f"offsets must be non-decreasing from 0 to {n}")
    return off


def _is_key(v: Any) -> bool:
    return isinstance(v, (str, int)) and not isinstance(v, bool)


def check_format_header(path: Any, man: Any, format_name: str, max_version: int) -> dict:
    """Check a manifest's ``format`` and ``format_version`` (this store's and the sharded store's).

    Args:
        path: the manifest file, named in errors.
        man: the parsed JSON.
        format_name: the expected ``format``.
        max_version: the newest ``format_version`` this code reads.

    Returns:
        ``man`` (a dict).

    Raises:
        StoreError: not a dict of that format, an invalid or a newer format version.
    """
    if not isinstance(man, dict) or man.get("format") != format_name:
        raise StoreError(path, f"is not an {format_name} manifest")
    fv = man.get("format_version")
    if not isinstance(fv, int) or isinstance(fv, bool) or fv < 1:
        raise StoreError(path, f"invalid format_version {fv!r}")
    if fv > max_version:
        raise StoreError(path, f"format_version {fv} is newer than this rfmem_fast supports ({max_version}); upgrade rfmem_fast")
    return man


def _load_once(root: Path, current_bytes: bytes, mmap: bool, verify: bool) -> StoreContents:
    cur_path = root / CURRENT
    cur = _parse_json(cur_path, current_bytes)
    if not isinstance(cur, dict) or cur.get("format") != FORMAT_NAME:
        raise StoreError(cur_path, f"is not an {FORMAT_NAME} pointer")
    name, msha = cur.get("dir"), cur.get("manifest_sha256")
    if not isinstance(name, str) or not _SNAP_RE.match(name):
        raise StoreError(cur_path, f"names an invalid data directory {name!r}")
    if not isinstance(msha, str) or not _HEX64.match(msha):
        raise StoreError(cur_path, "holds no valid manifest checksum")
    data_dir = root / name
    if not data_dir.is_dir():
        raise StoreError(data_dir, "missing data directory")

    mpath = data_dir / MANIFEST
    mbytes = _read_small(mpath, None, verify)
    if hashlib.sha256(mbytes).hexdigest() != msha:  # always: the manifest is tiny
        raise StoreError(mpath, "sha256 checksum mismatch with CURRENT (corrupt or edited)")
    man = check_format_header(mpath, _parse_json(mpath, mbytes), FORMAT_NAME, FORMAT_VERSION)
    ints = {}
    for key, lo in (("dim", 1), ("num_users", 0), ("num_items", 0), ("bank_version", 0)):
        v = man.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise StoreError(mpath, f"{key} must be an int >= {lo}, got {v!r}")
        ints[key] = v
    dtype = man.get("dtype")
    allowed = ("float32",) if man["format_version"] < 2 else BANK_DTYPES if man["format_version"] >= 5 else HALF_DTYPES + ("float32",)
    if dtype not in allowed:
        raise StoreError(mpath, f"dtype must be one of {allowed} (format_version {man['format_version']}), got {dtype!r}")
    fv = man["format_version"]
    names = data_files(dtype, fv)
    files = man.get("files")
    if (
        not isinstance(files, dict)
        or not set(names) <= set(files)
        or not set(files) <= set(names) | set(OPTIONAL_FILES)
    ):
        raise StoreError(mpath, f"files must list exactly {list(names)}, plus optionally {list(OPTIONAL_FILES)}")
    for fname, meta in files.items():
        if (
            not isinstance(meta, dict)
            or not isinstance(meta.get("sha256"), str)
            or not _HEX64.match(meta["sha256"])
            or not isinstance(meta.get("bytes"), int)
            or isinstance(meta.get("bytes"), bool)
            or meta["bytes"] < 0
        ):
            raise StoreError(mpath, f"invalid entry for {fname!r}")
    d, u, n = ints["dim"], ints["num_users"], ints["num_items"]
    for fname in files:  # cheap size checks first: truncation / deletion found early
        _check_size(data_dir / fname, files[fname])

    offsets = _read_offsets(data_dir / "offsets.npy", files["offsets.npy"], u, n, verify)
    jsons = {}
    for fname, length in (("users.json", u), ("ids.json", n), ("texts.json", n)):
        p = data_dir / fname
        obj = _parse_json(p, _read_small(p, files[fname], verify))
        if not isinstance(obj, list) or len(obj) != length:
            raise StoreError(p, f"must be a JSON list of {length} entries")
        jsons[fname] = obj
    users, ids, texts = jsons["users.json"], jsons["ids.json"], jsons["texts.json"]
    upath, ipath, tpath = data_dir / "users.json", data_dir / "ids.json", data_dir / "texts.json"
    if not all(_is_key(x) for x in users):
        raise StoreError(upath, "user keys must be str or int")
    if len(set(users)) != len(users):
        raise StoreError(upath, "holds duplicate user keys")
    if not all(_is_key(x) for x in ids):
        raise StoreError(ipath, "item ids must be str or int")
    for k in range(u):
        a, b = int(offsets[k]), int(offsets[k + 1])
        if len(set(ids[a:b])) != b - a:
            raise StoreError(ipath, f"user {users[k]!r} holds a duplicate item id")
    if not all(t is None or isinstance(t, str) for t in texts):
        raise StoreError(tpath, "texts must be str or null")
    metadata = None
    if "metadata.json" in files:
        mdpath = data_dir / "metadata.json"
        metadata = _parse_json(mdpath, _read_small(mdpath, files["metadata.json"], verify))
        if not isinstance(metadata, list) or len(metadata) != n:
            raise StoreError(mdpath, f"must be a JSON list of {n} entries")
        if not all(m is None or isinstance(m, dict) for m in metadata):
            raise StoreError(mdpath, "entries must be JSON objects or null")

    vectors, scan, scan_meta = _read_rows(data_dir, files, n, d, dtype, mmap, verify)
    item_ids = np.empty(n, dtype=object)
    text_arr = np.empty(n, dtype=object)
    if n:
        item_ids[:] = ids
        text_arr[:] = texts
    stemmer, lex = None, None
    if fv >= 3:
        stemmer, lex = _read_lexical(mpath, man, data_dir, files, offsets, text_arr, mmap, verify)
    created = None  # format < 4: unknown creation times (NaN, filled by MemoryBank._install)
    if fv >= 4:
        cpath = data_dir / CREATED_FILE
        created = _read_npy(cpath, files[CREATED_FILE], np.dtype("<f8"), mmap, verify)
        if created.shape[0] != n:
            raise StoreError(cpath, f"must hold {n} creation times (one per item), got {created.shape[0]}")
        if verify and np.isinf(created).any():
            raise StoreError(cpath, "holds an infinite creation time")
    threads = positions = None  # format < 6: no thread, no position
    if fv >= 6:
        threads, positions = _read_threads(data_dir, files, n, verify)
    return StoreContents(dim=d, dtype=dtype, version=ints["bank_version"], vectors=vectors, offsets=offsets,
                         users=tuple(users), item_ids=item_ids, texts=text_arr, scan=scan, metadata=metadata,
                         lexical_stemmer=stemmer, lexical=lex, path=str(root), mmap=bool(mmap),
                         created_at=created, scan_meta=scan_meta, threads=threads, positions=positions)  # fmt: skip


def _read_threads(data_dir: Path, files: dict, n: int, verify: bool) -> tuple:
    """(threads object [n] or None, positions int64 [n] or None) of a format-6 store, checked:
    threads str / int / null, positions -1 or >= 0, no position without a thread. None
    where no item has one."""
    tpath, ppath = data_dir / "threads.json", data_dir / "positions.npy"
    thr = _parse_json(tpath, _read_small(tpath, files["threads.json"], verify))
    if not isinstance(thr, list) or len(thr) != n:
        raise StoreError(tpath, f"must be a JSON list of {n} entries")
    if not all(t is None or _is_key(t) for t in thr):
        raise StoreError(tpath, "threads must be str, int or null")
    pos = np.array(_read_npy(ppath, files["positions.npy"], np.dtype("<i8"), False, verify), dtype=np.int64)
    if pos.shape[0] != n:
        raise StoreError(ppath, f"must hold {n} positions (one per item), got {pos.shape[0]}")
    if (pos < -1).any():
        raise StoreError(ppath, "positions must be -1 (none) or >= 0")
    threads = np.empty(n, dtype=object)
    if n:
        threads[:] = thr
    has_thr = threads != None  # noqa: E711 (elementwise)
    if (~has_thr & (pos >= 0)).any():
        raise StoreError(ppath, "an item has a position but no thread")
    pos.setflags(write=False)
    return (threads if has_thr.any() else None), (pos if (pos >= 0).any() else None)


def _read_npy(path: Path, expect: dict, dtype: np.dtype, mmap: bool, verify: bool) -> np.ndarray:
    """A 1-D .npy of ``dtype`` (read, or mapped read-only), its checksum checked when ``verify``."""
    if mmap:
        if verify:
            sha = hashlib.sha256()
            try:
                with open(path, "rb") as f:
                    for block in iter(lambda: f.read(_CHUNK), b""):
                        sha.update(block)
            except OSError as exc:
                raise StoreError(path, f"cannot be read: {exc}") from None
            if sha.hexdigest() != expect["sha256"]:
                raise StoreError(path, "sha256 checksum mismatch (corrupt or edited)")
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except Exception as exc:
            raise StoreError(path, f"cannot be mapped: {type(exc).__name__}: {exc}") from None
    else:
        data = _read_small(path, expect, verify)
        try:
            arr = np.load(io.BytesIO(data), allow_pickle=False)
        except Exception as exc:
            raise StoreError(path, f"bad .npy file: {type(exc).__name__}: {exc}") from None
    if arr.dtype != dtype or arr.ndim != 1:
        raise StoreError(path, f"holds {arr.dtype} {arr.shape}, expected 1-D {dtype}")
    return arr


def _read_lexical(mpath: Path, man: dict, data_dir: Path, files: dict, offsets: np.ndarray, texts: np.ndarray,
                  mmap: bool, verify: bool) -> tuple:  # fmt: skip
    """(stemmer, LexicalIndex) of a format-3 store, checked (shapes, ranges, rows without text empty)."""
    meta = man.get("lexical")
    if not isinstance(meta, dict) or meta.get("stemmer") not in STEMMERS or meta.get("tokenizer") != LEXICAL_TOKENIZER:
        raise StoreError(mpath, f"lexical must be {{'stemmer': one of {STEMMERS}, 'tokenizer': {LEXICAL_TOKENIZER!r}}}, got {meta!r}")
    stemmer = meta["stemmer"]
    vpath = data_dir / "lex_vocab.json"
    vocab = _parse_json(vpath, _read_small(vpath, files["lex_vocab.json"], verify))
    if not isinstance(vocab, list) or not all(isinstance(t, str) for t in vocab) or len(set(vocab)) != len(vocab):
        raise StoreError(vpath, "must be a JSON list of distinct strings")
    n = int(texts.shape[0])
    ptr = _read_npy(data_dir / "lex_ptr.npy", files["lex_ptr.npy"], np.dtype("<i8"), mmap, verify)
    terms = _read_npy(data_dir / "lex_terms.npy", files["lex_terms.npy"], np.dtype("<i4"), mmap, verify)
    tf = _read_npy(data_dir / "lex_tf.npy", files["lex_tf.npy"], np.dtype("<i4"), mmap, verify)
    pp = data_dir / "lex_ptr.npy"
    if ptr.shape[0] != n + 1 or ptr[0] != 0 or ptr[-1] != terms.shape[0] or (np.diff(ptr) < 0).any():
        raise StoreError(pp, f"must be non-decreasing int64 [{n + 1}] from 0 to the number of lex_terms")
    if tf.shape[0] != terms.shape[0] or (terms.shape[0] and (int(terms.min()) < 0 or int(terms.max()) >= len(vocab) or int(tf.min()) < 1)):
        raise StoreError(data_dir / "lex_terms.npy", "token ids must lie in the vocabulary and counts be >= 1, one count per id")
    has = np.fromiter((t is not None for t in texts), np.bool_, n)
    if (np.diff(ptr)[~has] != 0).any():
        raise StoreError(pp, "a row without text has lexical entries")
    analyzer = Analyzer(stemmer)
    return stemmer, LexicalIndex(offsets, ptr, terms, tf, has, Vocabulary(vocab), analyzer)


def read_store(path: Any, mmap: bool = False, verify: bool = True) -> StoreContents:
    """Read and check the store at ``path`` (written by :func:`write_store` / ``bank.save``).

    ``MemoryBank.load`` builds the bank from what this returns.

    Args:
        path: the store directory.
        mmap: if True, ``vectors.npy`` is memory-mapped copy-on-write
            (``np.load(mmap_mode="c")``) instead of read: pages are read only as
            searches touch them, the array is writable in memory (so backends can wrap
            it without a copy or warning) but nothing is ever written back to the file.
            The first snapshot after a write to the loaded bank copies all rows into
            memory. Do not truncate or rewrite the mapped file in place while the bank
            lives (``save`` never does: it writes a new directory). A half-precision
            bank maps ``scan.npy`` too (an int8 bank also ``scan_meta.npy``); its
            ``vectors.npy`` is then only read for the rows searches re-score, so it is
            mapped for random access and its pages are dropped from the page cache after
            the verify pass: the process keeps resident the scan copy (half the float32
            bytes; a quarter plus 12 bytes per row for int8) plus the pages of the rows
            it re-scored (README "Half-precision banks").
        verify: if True (default), every data file's sha256 is checked and every row
            is checked to be finite and of unit norm (and, for a half-precision or int8
            bank, every row of ``scan.npy`` to be the rounding / quantisation of its
            float32 row), in one
            streaming pass over the files (under ``mmap`` with ordinary reads, so the
            mappings are not made resident). If False these checks are skipped (the manifest's own
            checksum, file sizes, headers, shapes, offsets, ids and texts are still
            checked): faster, but a flipped byte inside the data goes unnoticed.

    Returns:
        :class:`StoreContents`: the saved snapshot's arrays (users, item ids with their
        str / int types, texts, vectors and scan copy bit for bit, dtype, offsets,
        version, lexical index) and the items' metadata, as read (no copy).

    Raises:
        StoreError (ValueError): no store at ``path``, a missing / truncated / corrupt
            / edited file, an invalid manifest, or a newer ``format_version``; the
            message names the file.
    """
    root = Path(os.fspath(path))
    cur_path = root / CURRENT
    if not root.is_dir():
        raise StoreError(root, "no store here (not a directory)")
    last: StoreError | None = None
    for _ in range(3):  # a concurrent save may swap CURRENT and remove the old directory
        current = _read_bytes(cur_path, "missing file (not a store, or never committed)")
        try:
            return _load_once(root, current, bool(mmap), bool(verify))
        except StoreError as exc:
            try:
                changed = cur_path.read_bytes() != current
            except OSError:
                changed = False
            if not changed:
                raise
            last = exc  # CURRENT moved while we read: try the new store
    assert last is not None
    raise last
