"""One user's row storage inside a :class:`~rfmem_fast.bank.MemoryBank`: :class:`_UserRows`
(a shared read-only ``base`` block, an owned ``tail`` buffer with capacity doubling,
tombstones and patches, and the per-slot ids, texts, token encodings, creation times,
threads and positions while the user is changed since the last snapshot). The write and
snapshot models it serves are in :mod:`rfmem_fast.bank`'s module docstring.
"""
from __future__ import annotations

import numpy as np

from .bank_snapshot import NO_POSITION
from .lexical import docs_segment


class _UserRows:
    """Row storage of one user; every method runs under the bank's lock.

    Slots ``0 .. nb-1`` live in ``base`` (shared, never written), slots ``nb ..`` in
    ``tail[:n_tail]`` (owned). ``ids`` / ``texts`` / ``toks`` / ``alive`` are per slot and exist
    only while the user is ``dirty`` (changed since the last snapshot), like ``created``
    (creation times, float seconds); a clean user is described by ``base`` plus
    ``ids_arr`` / ``texts_arr`` / ``created_arr``, views into the last snapshot, and ``lex_src`` = (that snapshot's LexicalIndex, first row, end row).
    ``toks`` holds each slot's encoded text ((terms, tf) int32 arrays, or None for an
    item without text: :mod:`rfmem_fast.lexical`), computed once when the text is written.
    """

    __slots__ = (
        "base", "tail", "n_tail", "ids", "texts", "alive", "n_dead", "patches",
        "slot_of", "dirty", "ids_arr", "texts_arr", "toks", "lex_src", "created", "created_arr",
        "threads", "threads_arr", "positions", "positions_arr",
    )

    def __init__(self, dim: int) -> None:
        self.base = np.zeros((0, dim), dtype=np.float32)
        self.tail: np.ndarray | None = None
        self.n_tail = 0
        self.ids: list = []
        self.texts: list = []
        self.alive = bytearray()
        self.n_dead = 0
        self.patches: dict[int, np.ndarray] = {}
        self.slot_of: dict | None = {}
        self.dirty = True
        self.ids_arr: np.ndarray | None = None
        self.texts_arr: np.ndarray | None = None
        self.toks: list = []
        self.lex_src: tuple | None = None
        self.created: list = []
        self.created_arr: np.ndarray | None = None
        self.threads: list = []
        self.threads_arr: np.ndarray | None = None
        self.positions: list = []
        self.positions_arr: np.ndarray | None = None

    # ---------------------------------------------------------------- reading
    @property
    def n_live(self) -> int:
        if not self.dirty:
            return int(self.base.shape[0])
        return len(self.ids) - self.n_dead

    def _live(self, per_slot: list, clean: np.ndarray | None) -> list:
        if not self.dirty:
            return list(clean)
        if not self.n_dead:
            return list(per_slot)
        return [v for v, a in zip(per_slot, self.alive) if a]

    def live_ids(self) -> list:
        """Item ids of the live rows, in row order."""
        return self._live(self.ids, self.ids_arr)

    def live_texts(self) -> list:
        """Texts of the live rows (None where none was given), in row order."""
        return self._live(self.texts, self.texts_arr)

    def live_created(self) -> list:
        """Creation times (float seconds, NaN unknown) of the live rows, in row order."""
        return self._live(self.created, self.created_arr)

    def live_threads(self) -> list:
        """Threads (str / int / None) of the live rows, in row order."""
        return self._live(self.threads, self.threads_arr)

    def live_positions(self) -> list:
        """Positions (int / None) of the live rows, in row order."""
        if not self.dirty:
            return [None if p == NO_POSITION else p for p in self.positions_arr.tolist()]
        return self._live(self.positions, None)

    def live_toks(self) -> list:
        """Encoded texts ((terms, tf) or None) of the live rows, in row order."""
        if not self.dirty:
            if self.lex_src is None:
                return [None] * int(self.base.shape[0])
            index, a, b = self.lex_src
            return index.docs(a, b)
        return self._live(self.toks, None)

    def lex_segment(self) -> tuple:
        """The live rows' forward lexical CSR (ptr from 0, terms, tf, has_text)."""
        if not self.dirty and self.lex_src is not None:
            index, a, b = self.lex_src
            return index.segment(a, b)
        return docs_segment(self.live_toks())

    def slots(self) -> dict:
        """{live item id: slot}, built on demand."""
        if self.slot_of is None:
            ids = self.ids if self.dirty else self.ids_arr
            if self.dirty and self.n_dead:
                self.slot_of = {i: s for s, (i, a) in enumerate(zip(ids, self.alive)) if a}
            else:
                self.slot_of = {i: s for s, i in enumerate(ids)}
        return self.slot_of

    def fill(self, out: np.ndarray) -> None:
        """Write the live rows, in slot order, into ``out`` [n_live, d]."""
        alive = np.frombuffer(bytes(self.alive), dtype=np.bool_) if (self.dirty and self.n_dead) else None
        nb = self.base.shape[0]
        pos = 0
        parts = [(self.base, 0)]
        if self.tail is not None and self.n_tail:
            parts.append((self.tail[: self.n_tail], nb))
        for arr, s0 in parts:
            m = arr.shape[0]
            if m == 0:
                continue
            if alive is None:
                out[pos : pos + m] = arr
                pos += m
            else:
                msk = alive[s0 : s0 + m]
                c = int(msk.sum())
                np.compress(msk, arr, axis=0, out=out[pos : pos + c])
                pos += c
        if self.patches:
            slots = np.fromiter(self.patches.keys(), dtype=np.int64, count=len(self.patches))
            rows = (np.cumsum(alive) - 1)[slots] if alive is not None else slots
            out[rows] = np.stack(list(self.patches.values()))

    # ---------------------------------------------------------------- writing
    def begin_write(self) -> None:
        """Turn a clean (snapshot-backed) user into a writable one: O(n_u) list copies."""
        if self.dirty:
            return
        n = int(self.base.shape[0])
        self.ids = list(self.ids_arr)
        self.texts = list(self.texts_arr)
        self.created = list(self.created_arr)
        self.threads = list(self.threads_arr)
        self.positions = self.live_positions()
        self.toks = self.live_toks()
        self.alive = bytearray(b"\x01") * n
        self.n_dead = 0
        self.patches = {}
        self.tail = None
        self.n_tail = 0
        self.dirty = True

    def append(self, vec: np.ndarray, ids: list, texts: list, toks: list, created: list, threads: list,
               positions: list) -> None:
        m = vec.shape[0]
        if self.tail is None:
            self.tail, self.n_tail = vec, m  # vec is a fresh array owned by the bank
        else:
            need = self.n_tail + m
            if need > self.tail.shape[0]:
                grown = np.empty((max(need, 2 * self.tail.shape[0], 16), vec.shape[1]), dtype=np.float32)
                grown[: self.n_tail] = self.tail[: self.n_tail]
                self.tail = grown
            self.tail[self.n_tail : need] = vec
            self.n_tail = need
        slots = self.slots()
        s0 = len(self.ids)
        for j, i in enumerate(ids):
            slots[i] = s0 + j
        self.ids.extend(ids)
        self.texts.extend(texts)
        self.toks.extend(toks)
        self.created.extend(created)
        self.threads.extend(threads)
        self.positions.extend(positions)
        self.alive.extend(b"\x01" * m)

    def set_row(self, slot: int, row: np.ndarray) -> None:
        nb = self.base.shape[0]
        if slot < nb:
            self.patches[slot] = row  # the base is shared with a snapshot: never written
        else:
            self.tail[slot - nb] = row

    def kill(self, slot: int) -> None:
        self.alive[slot] = 0
        self.patches.pop(slot, None)
        self.n_dead += 1

    def compact(self, dim: int) -> None:
        """Drop tombstones and patches into one owned buffer: O(n_u d)."""
        out = np.empty((self.n_live, dim), dtype=np.float32)
        self.fill(out)
        self.ids, self.texts, self.toks = self.live_ids(), self.live_texts(), self.live_toks()
        self.created = self.live_created()
        self.threads, self.positions = self.live_threads(), self.live_positions()
        self.base = np.zeros((0, dim), dtype=np.float32)
        self.tail, self.n_tail = out, out.shape[0]
        self.alive = bytearray(b"\x01") * out.shape[0]
        self.n_dead = 0
        self.patches = {}
        self.slot_of = None

    def rebase(self, vectors: np.ndarray, item_ids: np.ndarray, texts: np.ndarray, lex_src: tuple | None = None,
               created: np.ndarray | None = None, threads: np.ndarray | None = None,
               positions: np.ndarray | None = None) -> None:  # fmt: skip
        """Point a user at its segment of a new snapshot (drops tail, tombstones, patches);
        ``lex_src`` = (the snapshot's LexicalIndex, first row, end row) of the segment,
        ``created`` its creation times (float64; None: unknown, NaN), ``threads`` /
        ``positions`` its threads (object) and positions (int64; None: none)."""
        if self.dirty and self.n_dead:
            self.slot_of = None  # slots shifted
        n = len(item_ids)
        self.base = vectors
        self.ids_arr, self.texts_arr = item_ids, texts
        self.created_arr = created if created is not None else np.full(n, np.nan)
        self.threads_arr = threads if threads is not None else np.full(n, None, dtype=object)
        self.positions_arr = positions if positions is not None else np.full(n, NO_POSITION, dtype=np.int64)
        self.lex_src = lex_src
        self.tail, self.n_tail = None, 0
        self.ids, self.texts, self.toks, self.alive = [], [], [], bytearray()
        self.created, self.threads, self.positions = [], [], []
        self.n_dead = 0
        self.patches = {}
        self.dirty = False
