"""Reading a store: :func:`read_store` follows ``CURRENT`` to the manifest, checks it and
every file it lists (users, ids, texts, metadata, rows, creation times, threads and
positions, the lexical index) and returns a :class:`~rfmem_fast.store_format.StoreContents`,
retrying when a concurrent save moves ``CURRENT``. The format: :mod:`rfmem_fast.store`.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from .lexical import STEMMERS, Analyzer, LexicalIndex, Vocabulary
from .precision import BANK_DTYPES, HALF_DTYPES
from .store_files import _check_size, _parse_json, _read_bytes, _read_npy, _read_offsets, _read_rows, _read_small
from .store_format import (_HEX64, _SNAP_RE, CREATED_FILE, CURRENT, FORMAT_NAME, FORMAT_VERSION, LEXICAL_TOKENIZER,
                           MANIFEST, OPTIONAL_FILES, StoreContents, StoreError, check_format_header, data_files)


def _is_key(v: Any) -> bool:
    return isinstance(v, (str, int)) and not isinstance(v, bool)


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
