"""The CSR layout of a :class:`~rfmem_fast.bank.MemoryBank`, both ways: a
:class:`~rfmem_fast.bank_snapshot.BankSnapshot` built from the users' row storage (one
contiguous float32 matrix, ids, texts, creation times, threads, positions, the lexical
forward index, the scan copy; then every user rebased onto it), the snapshot taken with
its rows' metadata (what ``save`` writes), and a snapshot installed as the bank's content
(``load``, ``astype``). ``_Layout`` is a mixin of MemoryBank; the cost model is in
:mod:`rfmem_fast.bank`'s module docstring.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import numpy as np

from .bank_rows import _UserRows
from .bank_snapshot import NO_POSITION, BankSnapshot
from .bank_validate import INSTANT_RANGE, instants_known
from .lexical import LexicalIndex, Vocabulary, concat_segments
from .precision import SCAN_DTYPES, scan_copies

log = logging.getLogger("rfmem_fast.bank")


class _Layout:
    """Building, reading out and installing snapshots (a mixin of
    :class:`~rfmem_fast.bank.MemoryBank`: the methods read and replace its users, rows,
    vocabulary, metadata and caches, under its lock)."""

    def _build_snapshot_locked(self) -> BankSnapshot:
        rows = self._rows
        lengths = [r.n_live for r in rows]
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        n = int(offsets[-1])
        vectors = np.empty((n, self._dim), dtype=np.float32)
        item_ids = np.empty(n, dtype=object)
        texts = np.empty(n, dtype=object)
        created = np.empty(n, dtype=np.float64)
        threads = np.empty(n, dtype=object)
        positions = np.empty(n, dtype=np.int64)
        for u, r in enumerate(rows):
            a, b = int(offsets[u]), int(offsets[u + 1])
            r.fill(vectors[a:b])
            if r.dirty:
                if b > a:
                    item_ids[a:b] = r.live_ids()
                    texts[a:b] = r.live_texts()
                    created[a:b] = r.live_created()
                    threads[a:b] = r.live_threads()
                    positions[a:b] = [NO_POSITION if p is None else p for p in r.live_positions()]
            else:
                item_ids[a:b] = r.ids_arr
                texts[a:b] = r.texts_arr
                created[a:b] = r.created_arr
                threads[a:b] = r.threads_arr
                positions[a:b] = r.positions_arr
        # the lexical forward index: clean users' segments are sliced from their last
        # snapshot's index (no re-tokenising), dirty users' from their cached per-item
        # encodings; clean users keep the postings built for them (rows are segment-local)
        carried = {}
        for u, r in enumerate(rows):
            if not r.dirty and r.lex_src is not None:
                got = r.lex_src[0]._postings.get(u)
                if got is not None:
                    carried[u] = got
        ptr, terms, tf, has = concat_segments([r.lex_segment() for r in rows])
        lex = LexicalIndex(offsets, ptr, terms, tf, has, self._vocab, self._analyzer, carried, item_ids)
        for u, r in enumerate(rows):
            a, b = int(offsets[u]), int(offsets[u + 1])
            r.rebase(vectors[a:b], item_ids[a:b], texts[a:b], (lex, a, b), created[a:b], threads[a:b], positions[a:b])
        scan, scan_meta = scan_copies(vectors, self._dtype)
        created.setflags(write=False)
        positions.setflags(write=False)
        has_thr, has_pos = bool(np.not_equal(threads, None).any()), bool((positions != NO_POSITION).any())
        return BankSnapshot(vectors, offsets, item_ids, self._version, tuple(self._users), texts, scan, self._dtype, lex,
                            created, scan_meta, threads if has_thr else None,
                            positions if has_pos else None)  # fmt: skip

    def _snapshot_and_metadata(self) -> tuple[BankSnapshot, list | None]:
        """The snapshot and its rows' metadata (list [n] of dict / None, or None when no
        item has any), taken together under the lock (what :meth:`save` writes with :func:`rfmem_fast.store.write_store`)."""
        with self._lock:
            snap = self.snapshot()
            if not any(self._meta.values()):
                return snap, None
            meta: list = [None] * snap.num_items
            for user, store in self._meta.items():
                u = self._uindex[user]
                a, b = int(snap.offsets[u]), int(snap.offsets[u + 1])
                for row in range(a, b):
                    m = store.get(snap.item_ids[row])
                    if m is not None:
                        meta[row] = m
            return snap, meta

    def _install(self, snap: BankSnapshot, metadata: Sequence[dict | None] | None = None) -> None:
        """Make ``snap`` the bank's content (used by the store loader; no copy), with the
        rows' metadata (list [n] of dict / None) when given."""
        if (snap.dtype != self._dtype or (snap.scan is None) != (self._dtype not in SCAN_DTYPES)
                or (snap.scan_meta is None) != (self._dtype != "int8")):
            raise ValueError(f"snapshot of dtype {snap.dtype!r} cannot be installed in a {self._dtype} bank")
        with self._lock:
            self._users = list(snap.users)
            self._uindex = {u: i for i, u in enumerate(self._users)}
            texts = snap.texts if snap.texts is not None else np.full(snap.num_items, None, dtype=object)
            if snap.texts is None:
                snap = dataclasses.replace(snap, texts=texts)
            lex = snap.lexical
            if lex is None or lex.analyzer.stemmer != self.lexical_stemmer:  # (re)build from the texts
                self._vocab = Vocabulary()
                lex = LexicalIndex.from_texts(snap.offsets, texts, self._vocab, self._analyzer, snap.item_ids)
            else:  # adopt the index with a vocabulary of our own (later writes must not share it)
                self._vocab = lex.vocab.copy()
                lex = LexicalIndex(snap.offsets, lex.ptr, lex.terms, lex.tf, lex.has_text, self._vocab,
                                   self._analyzer, lex.built_postings() if lex.item_ids is not None else None,
                                   snap.item_ids)  # fmt: skip  (postings built without the row ids: rebuilt)
            snap = dataclasses.replace(snap, lexical=lex)
            if snap.created_at is None:  # unknown creation times (a store of format < 4): NaN
                snap = dataclasses.replace(snap, created_at=np.full(snap.num_items, np.nan))
            created = snap.created_at
            odd = ~instants_known(created) & ~np.isnan(created)
            if odd.any():  # not instants (written before the range was checked): unknown, as NaN
                log.warning("%d items hold a creation time outside %s (e.g. %r): read as unknown (NaN)",
                            int(odd.sum()), INSTANT_RANGE, float(created[odd][0]))
                created = np.where(odd, np.nan, created)
                snap = dataclasses.replace(snap, created_at=created)
            thr, pos = snap.threads_or_none, snap.positions_or_missing
            self._rows = []
            for u in range(snap.num_users):
                a, b = int(snap.offsets[u]), int(snap.offsets[u + 1])
                r = _UserRows(self._dim)
                r.slot_of = None
                r.rebase(snap.vectors[a:b], snap.item_ids[a:b], texts[a:b], (lex, a, b), created[a:b], thr[a:b], pos[a:b])
                self._rows.append(r)
            self._n_live = snap.num_items
            self._version = int(snap.version)
            self._cache = {}
            self._meta_cache = {}
            self._meta = {}
            if metadata is not None:
                for u in range(snap.num_users):
                    a, b = int(snap.offsets[u]), int(snap.offsets[u + 1])
                    self._set_metadata(self._users[u], list(snap.item_ids[a:b]), list(metadata[a:b]))
            self._snap = snap
