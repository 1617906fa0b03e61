"""The compiled form of a batch's filters: :class:`RowSelection`, the rows each query may
return, as every backend applies it while it takes the top-k (:mod:`rfmem_fast.backends`),
and :data:`LIST_MAX_FRACTION`, where the native kernel switches from a row list to a mask.
:func:`rfmem_fast.filters.compile_filters` builds it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: a selection holding at most this fraction of its segment's rows is scanned as a row
#: list by the native kernel; a larger one is given as a per-row mask too, which the
#: kernel checks inside the GEMM scan when its queries take the GEMM path (many queries
#: of one long segment) and trades for the list otherwise (csrc/cpu/topk.cpp, kernels.h
#: SelTable)
LIST_MAX_FRACTION = 0.25


@dataclass(frozen=True)
class RowSelection:
    """The rows each query of a batch may return: the compiled filters of one batch.

    Selection ``p`` is a sorted list of rows of ONE segment (``seg[p]``): the rows of
    that user that its filter keeps. A query ``i`` with ``qsel[i] == p`` returns only
    those rows; ``qsel[i] == -1`` leaves the query unfiltered (its whole segment). Every
    backend takes the top-k over the selected rows only (probe, recollection rounds and
    final list: :mod:`rfmem_fast.backends`), so a filtered query's result is the exact
    top-k of its matching items.

    Attributes:
        qsel: int64 [b] selection of each query (-1: none).
        seg: int64 [P] segment of each selection.
        off: int64 [P + 1] CSR offsets of the selections in ``rows``.
        rows: int64 [M] the selected rows (global, sorted within each selection).
        seg_len: int64 [P] the length of each selection's segment.
    """

    qsel: np.ndarray
    seg: np.ndarray
    off: np.ndarray
    rows: np.ndarray
    seg_len: np.ndarray
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_selections(self) -> int:
        """Number of selections P."""
        return int(self.seg.shape[0])

    @property
    def counts(self) -> np.ndarray:
        """int64 [P]: rows per selection."""
        got = self._memo.get("counts")
        if got is None:
            got = self._memo["counts"] = np.diff(self.off)
        return got

    def local_rows(self, qsel: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
        """Positions in :attr:`rows` (the compacted rows) of global ``rows`` [m, w] of the
        selections ``qsel`` [m] (-1 stays -1; every other row must be selected).

        Args:
            qsel: int64 [m] a selection per row of ``rows`` (>= 0).
            rows: int64 [m, w] global rows or -1.
            n: the number of rows of the bank (> every row).
        """
        keys = self._memo.get(("keys", n))
        if keys is None:  # (selection, row) as one increasing key
            keys = self._memo[("keys", n)] = np.repeat(np.arange(self.num_selections, dtype=np.int64), self.counts) * n + self.rows
        loc = np.searchsorted(keys, qsel[:, None] * n + np.maximum(rows, 0))
        return np.where(rows >= 0, loc, -1).astype(np.int64, copy=False)

    def take(self, idx: Any) -> "RowSelection":
        """The selection of the queries ``idx`` (an index array, slice or torch tensor); the
        selections table (and its cached device copies) is shared."""
        if hasattr(idx, "detach"):  # a torch tensor
            idx = idx.detach().cpu().numpy()
        return RowSelection(np.ascontiguousarray(self.qsel[idx]), self.seg, self.off, self.rows, self.seg_len, self._memo)

    def any(self) -> bool:
        """True when some query is filtered."""
        got = self.__dict__.get("_any")
        if got is None:
            got = bool((self.qsel >= 0).any())
            object.__setattr__(self, "_any", got)  # per query list (not shared with take())
        return got

    def list_mode(self) -> np.ndarray:
        """bool [P]: selections the native kernel scans as a row list (at most
        :data:`LIST_MAX_FRACTION` of their segment's rows); the others as a mask."""
        return self.counts <= LIST_MAX_FRACTION * self.seg_len

    def native_table(self, offsets: np.ndarray) -> dict:
        """The selections table in the native kernel's layout (computed once, cached):
        ``sel_seg``, ``sel_off``, ``sel_rows`` and, for the mask-mode selections, their
        masks concatenated over their segments' rows (``sel_mask`` uint8, ``sel_mask_off``
        int64 [P], -1 for a list-mode selection)."""
        got = self._memo.get("native")
        if got is None:
            lm = self.list_mode()
            mask_off = np.full(self.num_selections, -1, dtype=np.int64)
            total = int(self.seg_len[~lm].sum())
            mask = np.zeros(total, dtype=np.uint8)
            pos = 0
            for p in np.flatnonzero(~lm).tolist():
                a = int(offsets[self.seg[p]])
                mask_off[p] = pos
                mask[pos + self.rows[self.off[p] : self.off[p + 1]] - a] = 1
                pos += int(self.seg_len[p])
            got = self._memo["native"] = dict(
                sel_seg=self.seg, sel_off=self.off, sel_rows=self.rows, sel_mask=mask, sel_mask_off=mask_off
            )
        return got

    def allowed(self, i: int, a: int, n: int) -> np.ndarray | None:
        """bool [n]: the rows ``a .. a + n - 1`` (query ``i``'s segment) it may return; None: all."""
        p = int(self.qsel[i])
        if p < 0:
            return None
        m = np.zeros(n, dtype=np.bool_)
        m[self.rows[self.off[p] : self.off[p + 1]] - a] = True
        return m
