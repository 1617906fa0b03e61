"""Long texts of a :class:`~rfmem_fast.serving.memory.Memory`: a text over the encoder's
window is cut into overlapping chunks (each an exact substring of the text), embedded in
one encoder call with the other texts, and stored as bank rows of its item (the first
chunk is the item's row; the extra ones have row ids ``"<item>\x1f<j>"``, j >= 1, and carry
the item's metadata, creation time, thread and position). ``_Chunking`` (a mixin of Memory) holds the
splitting, the chunk-row layout, the logged add / update / delete records that write
those rows, and the per-user map of extra chunk rows.
"""
from __future__ import annotations

from typing import Any, Hashable, Sequence

import numpy as np

# CHUNK_SEP separates a parent item id from a chunk number in the bank's row ids of a long
# text's extra chunks ("<parent>\x1f<j>", j >= 1; the lexical index reads them as one item);
# refused in user-given ids
from ..lexical import CHUNK_SEP
from .validate import _check_pairs


#: tokens shared by consecutive chunks of a long text (default of ``chunk_overlap``)
DEFAULT_CHUNK_OVERLAP = 32


class _Chunking:
    """Chunks of long texts (a mixin of :class:`~rfmem_fast.serving.memory.Memory`: the
    methods read its chunk map, encoder and bank)."""

    # ------------------------------------------------------------------ long texts
    @staticmethod
    def _note_chunks(chunks: dict[str, int], ids: list) -> None:
        for i in ids:
            if isinstance(i, str) and CHUNK_SEP in i:
                parent, _, j = i.rpartition(CHUNK_SEP)
                chunks[parent] = max(chunks.get(parent, 0), int(j))

    def _index_chunks(self) -> None:
        """Rebuild the chunk map from the bank's row ids (on open, before the replay)."""
        self._chunks = {}
        for user in self.bank.users:
            ids = [i for i in self.bank.item_ids_of(user) if isinstance(i, str) and CHUNK_SEP in i]
            if ids:
                self._note_chunks(self._chunks.setdefault(user, {}), ids)

    def _extra_rows(self, user: Hashable) -> int:
        """Bank rows of ``user`` that are extra chunks of long texts (not items)."""
        c = self._chunks.get(user)
        return sum(c.values()) if c else 0

    def _chunk_ids_of(self, user: Hashable, ids: list) -> list[str]:
        """The extra chunk rows of the items ``ids`` of ``user``."""
        c = self._chunks.get(user) or {}
        return [f"{p}{CHUNK_SEP}{j}" for p in ids for j in range(1, c.get(p, 0) + 1)]

    def _split(self, texts: list[str], name: str = "texts", labels: Sequence[str] | None = None) -> list[list[str]]:
        """Per text, its chunks: ``[text]`` when it fits the encoder's window (or the
        encoder does not tell one), else overlapping windows of the text itself.

        Raises:
            ValueError: a text over the window of an encoder that tells its window
                (``max_tokens``, ``count_tokens``) but cannot cut (no ``token_spans``),
                named by ``labels[i]`` (default ``name[i]``).

        A chunk holds at most ``max_tokens`` minus the special tokens of the encoder's
        tokenizer (254 for all-MiniLM-L6-v2), consecutive chunks share
        ``chunk_overlap`` tokens; each chunk is the exact substring its tokens span.
        The tokenizer used is a borrowed encoder's (never one a worker is encoding with)."""
        with self._borrow_encoder() as enc:
            return self._split_with(enc, texts, name, labels)

    def _split_with(self, enc: Any, texts: list[str], name: str,
                    labels: Sequence[str] | None = None) -> list[list[str]]:
        """:meth:`_split` with the tokenizer of ``enc``."""
        limit, count = getattr(enc, "max_tokens", None), getattr(enc, "count_tokens", None)
        spans_of = getattr(enc, "token_spans", None)
        if limit is None or not callable(count):
            return [[t] for t in texts]
        counts = count(texts)
        long = [i for i, n in enumerate(counts) if n > limit]
        out = [[t] for t in texts]
        if not long:
            return out
        if not callable(spans_of):  # a window but no way to cut: refuse rather than truncate
            i = long[0]
            raise ValueError(
                f"{labels[i] if labels is not None else f'{name}[{i}]'} is {counts[i]} tokens long, but the encoder reads at most {limit} tokens "
                f"(special tokens included) and would silently ignore the rest; this encoder has no "
                f"token_spans() to chunk it: split it into memories of at most {limit} tokens")
        size = int(limit) - int(count([""])[0])  # room for the text's own tokens
        step = size - self._chunk_overlap
        if step < 1:
            raise ValueError(f"chunk_overlap={self._chunk_overlap} leaves no room in the encoder's window of "
                             f"{size} text tokens: use a smaller chunk_overlap")
        for i, spans in zip(long, spans_of([texts[i] for i in long])):
            t, parts = texts[i], []
            for a in range(0, len(spans), step):
                win = spans[a:a + size]
                parts.append(t[win[0][0]:win[-1][1]])
                if a + size >= len(spans):
                    break
            out[i] = parts
        return out

    def _embed_chunks(self, tx: list[str], labels: Sequence[str] | None = None) -> list[np.ndarray]:
        """ONE encoder call for the chunks of every text (long ones cut, :meth:`_split`):
        per text its float32 [c, d] rows (c >= 1 chunks; views into one array).

        Raises:
            ValueError: a text that cannot be cut or embeds as a zero / non-finite row,
                named by ``labels[i]`` (default ``texts[i]``)."""
        parts = self._split(tx, labels=labels)
        flat = [c for p in parts for c in p]
        names = labels if labels is not None else [f"texts[{i}]" for i in range(len(tx))]
        rows = self._encode(flat, labels=[lab for lab, p in zip(names, parts) for _ in p])
        out, r = [], 0
        for p in parts:
            out.append(rows[r:r + len(p)])
            r += len(p)
        return out

    @staticmethod
    def _chunk_layout(id_list: list[str], per_item: list[np.ndarray]) -> tuple[np.ndarray, list[str], np.ndarray | None]:
        """Items' chunk rows (:meth:`_embed_chunks`) as bank rows: (one row per item: its
        first chunk; the extra chunks' row ids ``"<id>\x1f<j>"``, j >= 1; their rows, or None)."""
        first = np.stack([c[0] for c in per_item])
        extra_ids = [f"{pid}{CHUNK_SEP}{j}" for pid, c in zip(id_list, per_item) for j in range(1, c.shape[0])]
        if not extra_ids:
            return first, [], None
        return first, extra_ids, np.concatenate([c[1:] for c in per_item if c.shape[0] > 1])

    def _encode_items(self, tx: list[str], id_list: list[str]) -> tuple[np.ndarray, list[str], np.ndarray | None]:
        """Embeddings of items' texts, long ones chunked: (one row per item: its first
        chunk; the extra chunks' row ids; their rows, or None)."""
        return self._chunk_layout(id_list, self._embed_chunks(tx))

    @staticmethod
    def _add_record(user: str, id_list: list[str], vec: np.ndarray, extra_ids: list[str], extra: np.ndarray | None,
                    columns: dict[str, list | None]) -> dict[str, Any]:
        """The logged record of an add to one user: ``vec`` [m, d] the items' rows,
        ``extra_ids`` / ``extra`` the extra chunk rows of long texts (after the items),
        ``columns`` {record key: m per-item values or None} (``texts``, ``metadata``,
        ``created_at``, ``threads``, ``positions``; a column of only None is None, and
        left out for ``threads`` / ``positions``, so a record without a conversation
        is the record of a version without them). A chunk row has no text of its own and
        carries its item's metadata, creation time, thread and position (so that a
        filter sees the item in each of its rows)."""
        pos = {i: j for j, i in enumerate(id_list)}
        parents = [pos[x.rpartition(CHUNK_SEP)[0]] for x in extra_ids]
        rec: dict[str, Any] = {"op": "add", "user": user, "ids": id_list + extra_ids,
                               "vectors": np.concatenate([vec, extra]) if extra_ids else vec}
        for col, vals in columns.items():
            if vals is None or all(v is None for v in vals):
                if col not in ("threads", "positions"):
                    rec[col] = None
            else:
                pad = [None] * len(parents) if col == "texts" else [vals[j] for j in parents]
                rec[col] = list(vals) + pad
        return rec

    def _conversation_of(self, user: str, id_list: list[str], threads: list | None, positions: list | None,
                         labels: Any) -> tuple[list, list] | None:
        """The threads and positions of an update's items as they will be (call under the
        write mutex): None when neither is changed, else (m threads, m positions), the
        ones not given read from the bank (kept), checked by
        :func:`~rfmem_fast.serving.validate._check_pairs` (``labels(j)``: the names of
        item ``j``'s position and thread arguments).

        Raises:
            KeyError: an id the user does not hold (named). ValueError: an item that
                would hold a position without a thread.
        """
        if threads is None and positions is None:
            return None
        kept_pos = positions is None
        if threads is None:
            threads = self.bank.threads_of(user, id_list)
        if positions is None:
            positions = self.bank.positions_of(user, id_list)
        if not kept_pos:
            _check_pairs(threads, positions, labels)
        for j, (t, p) in enumerate(zip(threads, positions)):  # a thread cleared, the position kept
            if p is not None and t is None:
                plab, tlab = labels(j)
                raise ValueError(f"{tlab} clears the thread of item {id_list[j]!r}, which keeps its position {p}: "
                                 f"an item with a position needs a thread, so clear its position too (with {plab})")
        return list(threads), list(positions)

    def _update_record(self, user: str, id_list: list[str], tx: list[str] | None, vec: np.ndarray | None,
                       meta: list | None, extra_ids: list[str], extra: np.ndarray | None,
                       conv: tuple[list, list] | None = None) -> dict[str, Any]:
        """The logged record of an update of one user's items (call under the write
        mutex): a new vector (given, or a new text's first chunk) drops the items' old
        chunk rows and adds ``extra_ids`` / ``extra``, the new text's other chunks;
        ``conv`` (:meth:`_conversation_of`) the items' threads and positions as they will
        be (record keys ``threads`` / ``positions``, left out when they do not change)."""
        rec = {"op": "update", "user": user, "ids": id_list, "texts": tx, "vectors": vec, "metadata": meta}
        if conv is not None:
            rec["threads"], rec["positions"] = conv
        if vec is not None:  # a new text / vector replaces the item's chunks
            drop = self._chunk_ids_of(user, id_list)
            if drop or extra_ids:
                rec.update(drop=drop, extra_ids=extra_ids, extra_vectors=extra)
        return rec

    def _delete_record(self, user: str, id_list: list[str]) -> dict[str, Any]:
        """The logged record of a delete of one user's items and their chunk rows
        (call under the write mutex)."""
        return {"op": "delete", "user": user, "ids": id_list + self._chunk_ids_of(user, id_list)}
