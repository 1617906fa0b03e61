"""What readers of a :class:`~rfmem_fast.bank.MemoryBank` see: :class:`BankSnapshot`, the
immutable CSR view of the bank's live rows (``bank.snapshot()``) that every backend and
search reads, and :data:`NO_POSITION`, the stored position of an item without one. How a
bank builds, caches and installs snapshots: :mod:`rfmem_fast.bank` (its module docstring)
and :mod:`rfmem_fast.bank_layout`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

#: the stored position of an item without one (:attr:`BankSnapshot.positions`)
NO_POSITION = -1


@dataclass(frozen=True)
class BankSnapshot:
    """An immutable CSR view of a bank, as the backends consume it.

    Attributes:
        vectors: float32 [n, d], C-contiguous, unit rows; only live (not deleted)
            items. After ``MemoryBank.load(..., mmap=True)`` it may be backed by a
            copy-on-write memory map of the store's ``vectors.npy``.
        offsets: int64 [U + 1], non-decreasing, ``offsets[0] == 0``, ``offsets[U] == n``;
            user ``u`` owns rows ``offsets[u]:offsets[u+1]``.
        item_ids: object ndarray [n], the caller's item id (str or int) of each row.
        version: the bank's write counter when the snapshot was taken.
        users: the U user keys in segment order (str or int).
        texts: object ndarray [n], the text (str or None) of each row; None when
            the snapshot was made by hand without texts.
        scan: None for a float32 bank; for a float16 / bfloat16 bank the scan copy
            [n, d] of ``vectors`` rounded to that type (numpy float16, or uint16
            holding the bfloat16 bits); for an int8 bank the int8 codes [n, d]
            (:mod:`rfmem_fast.precision`).
        dtype: "float32", "float16", "bfloat16" or "int8": the type the rows are scanned in.
        lexical: the snapshot's :class:`rfmem_fast.lexical.LexicalIndex` (forward CSR
            of every row's token ids and, built on demand, per-user BM25 postings);
            None for a snapshot made by hand (no lexical channel).
        created_at: float64 [n], each row's creation time in seconds since the Unix
            epoch (UTC; :meth:`MemoryBank.add`), NaN where unknown (rows loaded from a
            store written before timestamps, format < 4); None for a snapshot made by
            hand (every time unknown: :attr:`created_at_or_nan`).
        scan_meta: float32 [n, 3] for an int8 bank (per row: the scale, an upper bound of
            the residual norm, an upper bound of the norm:
            :func:`rfmem_fast.precision.int8_scan_copy`), else None.
        threads: object [n], each row's conversation thread (str or int; None for a row
            without one: :meth:`MemoryBank.add`), or None when no row has a thread.
        positions: int64 [n], each row's position in its thread (>= 0;
            :data:`NO_POSITION` = -1 where none was given), or None when no row has one.

    Nothing here may be written: banks and searches share these arrays.
    """

    vectors: np.ndarray
    offsets: np.ndarray
    item_ids: np.ndarray
    version: int
    users: tuple = ()
    texts: np.ndarray | None = None
    scan: np.ndarray | None = None
    dtype: str = "float32"
    lexical: Any = None
    created_at: np.ndarray | None = None
    scan_meta: np.ndarray | None = None
    threads: np.ndarray | None = None
    positions: np.ndarray | None = None

    @property
    def threads_or_none(self) -> np.ndarray:
        """object [n]: :attr:`threads`, or all None when no row has a thread."""
        if self.threads is not None:
            return self.threads
        return np.full(self.num_items, None, dtype=object)

    @property
    def positions_or_missing(self) -> np.ndarray:
        """int64 [n]: :attr:`positions`, or all :data:`NO_POSITION` when no row has a position."""
        if self.positions is not None:
            return self.positions
        return np.full(self.num_items, NO_POSITION, dtype=np.int64)

    @property
    def created_at_or_nan(self) -> np.ndarray:
        """float64 [n]: :attr:`created_at`, or all NaN (unknown) when the snapshot has none."""
        if self.created_at is not None:
            return self.created_at
        return np.full(self.num_items, np.nan)

    @property
    def num_users(self) -> int:
        """Number of user segments U."""
        return int(self.offsets.shape[0] - 1)

    @property
    def num_items(self) -> int:
        """Number of live rows n."""
        return int(self.vectors.shape[0])

    @property
    def segment_lengths(self) -> np.ndarray:
        """int64 [U]: rows per user."""
        return np.diff(self.offsets)

    @property
    def scan_vectors(self) -> np.ndarray:
        """The rows a scan reads: ``scan`` for a half-precision or int8 bank, else ``vectors``."""
        return self.scan if self.scan is not None else self.vectors

    @property
    def scan_nbytes(self) -> int:
        """Bytes of :attr:`scan_vectors` (and of :attr:`scan_meta`): what a scan of every
        row reads, and what the backends hold resident for scanning (n d 4 for float32,
        n d 2 for a half-precision bank, n (d + 12) for int8)."""
        meta = 0 if self.scan_meta is None else int(self.scan_meta.nbytes)
        return int(self.scan_vectors.nbytes) + meta


def _positions_array(positions: Sequence[int | None]) -> np.ndarray:
    """int64 [n] of positions, :data:`NO_POSITION` for None."""
    out = np.empty(len(positions), dtype=np.int64)
    if len(positions):
        out[:] = [NO_POSITION if p is None else p for p in positions]
    return out


def _object_array(values: Sequence[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    if len(values):
        out[:] = list(values)
    return out
