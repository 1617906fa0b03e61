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

The parts are split by concept, and the names callers import from here are re-exported:
:mod:`rfmem_fast.store_format` (file names, format versions, the manifest header,
:class:`StoreContents`, :class:`StoreError`), :mod:`rfmem_fast.store_files` (each file read
and checked; the rows streamed through the checks or memory-mapped) and
:mod:`rfmem_fast.store_read` (:func:`read_store`). This module keeps the atomic save
(:func:`write_store`) and its testing hook.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .lexical import Analyzer, LexicalIndex, Vocabulary
from .store_format import CREATED_FILE as CREATED_FILE
from .store_format import CURRENT as CURRENT
from .store_format import DATA_FILES as DATA_FILES
from .store_format import FORMAT_NAME as FORMAT_NAME
from .store_format import FORMAT_VERSION as FORMAT_VERSION
from .store_format import LEXICAL_FILES as LEXICAL_FILES
from .store_format import LEXICAL_TOKENIZER as LEXICAL_TOKENIZER
from .store_format import MANIFEST as MANIFEST
from .store_format import OPTIONAL_FILES as OPTIONAL_FILES
from .store_format import SCAN_FILE as SCAN_FILE
from .store_format import SCAN_META_FILE as SCAN_META_FILE
from .store_format import THREAD_FILES as THREAD_FILES
from .store_format import StoreContents as StoreContents
from .store_format import StoreError as StoreError
from .store_format import _SNAP_RE, format_version_for
from .store_format import check_format_header as check_format_header
from .store_format import data_files as data_files
from .store_read import read_store as read_store

# every other name these concept modules took from this one stays importable from here
from .store_files import (_CHUNK, _NORM_TOL, _check_size, _npy_header, _parse_json, _random_access,  # noqa: F401
                          _read_bytes, _read_npy, _read_offsets, _read_rows, _read_small)
from .store_format import _HEX64  # noqa: F401
from .store_read import _is_key, _load_once, _read_lexical, _read_threads  # noqa: F401

#: test hook: called with a stage name ("file:<name>", "before_commit", "after_commit")
_hook: Callable[[str], None] | None = None
_path_locks: dict[str, threading.Lock] = {}
_path_locks_guard = threading.Lock()

__all__ = [
    "StoreError", "StoreContents", "write_store", "read_store",
    "FORMAT_VERSION", "FORMAT_NAME",
]  # fmt: skip


def _stage(name: str) -> None:
    if _hook is not None:
        _hook(name)


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
