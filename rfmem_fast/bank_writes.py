"""The write machinery of a :class:`~rfmem_fast.bank.MemoryBank`, shared by its public
writes (:meth:`~rfmem_fast.bank.MemoryBank.add`, ``from_arrays``, ``update``, ``delete``,
``set_metadata``): the checked append of one user's items, the texts' lexical encoding,
the per-item metadata store, a user's rows opened for writing, and the snapshot dropped
after a write. ``_Writes`` is a mixin of MemoryBank; every method runs under the bank's
write lock.
"""
from __future__ import annotations

from typing import Hashable

from ._validate import as_float_matrix, l2_normalize_rows
from .bank_rows import _UserRows
from .bank_validate import (_check_ids, _check_metadata, _check_texts, _check_thread_pairs, _check_user,
                            check_created_at, check_positions, check_threads)


class _Writes:
    """Appending, encoding, metadata and write bookkeeping (a mixin of
    :class:`~rfmem_fast.bank.MemoryBank`: the methods read and change its users, rows,
    lexical vocabulary, metadata, caches and version)."""

    def _add_unlocked(self, user, vectors, ids, texts, allow_empty: bool, metadata=None, created_at=None,
                      threads=None, positions=None) -> None:  # fmt: skip
        user = _check_user(user)
        vec = as_float_matrix(vectors, "vectors", self._dim)
        if vec.shape[0] == 0 and not allow_empty:
            raise ValueError("vectors must hold at least one row")
        vec = l2_normalize_rows(vec, "vectors")
        id_list = _check_ids(ids, vec.shape[0])
        tx = _check_texts(texts, vec.shape[0])
        meta = _check_metadata(metadata, vec.shape[0])
        created = check_created_at(created_at, vec.shape[0])
        thr = check_threads(threads, vec.shape[0])
        pos = check_positions(positions, vec.shape[0])
        _check_thread_pairs(thr, pos)
        u = self._uindex.get(user)
        if u is not None:
            slots = self._rows[u].slots()
            clash = [i for i in id_list if i in slots]
            if clash:
                raise ValueError(f"ids: user {user!r} already holds item id {clash[0]!r}")
        else:
            u = len(self._users)
            self._rows.append(_UserRows(self._dim))
            self._users.append(user)
            self._uindex[user] = u
        if vec.shape[0]:
            toks = self._encode(tx)
            r = self._rows[u]
            r.begin_write()
            r.append(vec, id_list, tx, toks, created, thr, pos)
            self._n_live += vec.shape[0]
            self._set_metadata(user, id_list, meta)
        self._touch()

    def _encode(self, texts: list) -> list:
        """Each text tokenised and encoded ((terms, tf) int32 arrays; None for no text), under the lock."""
        an, voc = self._analyzer, self._vocab
        return [None if t is None else voc.encode_doc(an.tokens(t)) for t in texts]

    def _set_metadata(self, user: Hashable, ids: list, meta: list) -> None:
        """Store (dict) or clear (None) the metadata of ``ids`` (under the lock)."""
        store = self._meta.get(user)
        if store is None:
            if all(m is None for m in meta):
                return
            store = self._meta[user] = {}
        for i, m in zip(ids, meta):
            if m is None:
                store.pop(i, None)
            else:
                store[i] = m

    def _writable_slots(self, u: int, id_list: list) -> tuple["_UserRows", dict]:
        """User ``u``'s rows opened for writing and its {id: slot} map (under the lock).

        Raises:
            KeyError: ids the user does not hold, all named (the first 20, then a
                count); nothing is written then.
        """
        r = self._rows[u]
        slots = r.slots()
        missing = [i for i in id_list if i not in slots]
        if missing:
            if len(missing) == 1:
                what = f"item id {missing[0]!r}"
            else:
                shown = ", ".join(repr(i) for i in missing[:20])
                more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
                what = f"item ids {shown}{more} ({len(missing)} missing)"
            raise KeyError(f"ids: user {self._users[u]!r} holds no {what}")
        r.begin_write()
        return r, r.slots()

    def _touch(self) -> None:
        # drop the published snapshot before the version moves (see cached())
        self._snap = None
        self._cache = {}
        self._meta_cache = {}
        self._version += 1
