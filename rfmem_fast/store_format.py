"""The on-disk format of a store (the layout and the versions: :mod:`rfmem_fast.store`): the
file names and format versions (:func:`data_files`, :func:`format_version_for`), the
manifest's format header (:func:`check_format_header`), what a store holds once read
(:class:`StoreContents`) and :class:`StoreError`, which names the file and what is wrong.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from .lexical import LexicalIndex
from .precision import HALF_DTYPES

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
