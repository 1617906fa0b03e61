"""MemoryBank: many users' memory vectors in one CSR layout (RFMEM_SPEC.md, "Vectors and scores").

What readers see
----------------
A :class:`BankSnapshot` (``bank.snapshot()``): one float32 matrix ``vectors[n, d]``
holding the LIVE rows of all users, user ``u`` owning the contiguous rows
``offsets[u] : offsets[u + 1]`` (CSR segments), the caller's item id and text of each
row, the user keys, and the bank's write counter. A bank made with
``dtype="float16"`` / ``"bfloat16"`` adds ``scan``: the same rows rounded to that type,
which the fast backends scan instead of ``vectors`` (half the bytes per query), the
float32 rows being read only to re-score the candidates exactly
(:mod:`rfmem_fast.precision`; results are those of the float32 bank); ``dtype="int8"``
adds an int8 ``scan`` (a quarter of the bytes) and its per-row ``scan_meta``, which the
native backend scans. Every row is L2-normalised on the
way in, so the inner product is the cosine score. Deleted items are never in a
snapshot, so no search mode or backend can return one. A snapshot is immutable: a
search holding it is unaffected by later writes.

Writes
------
``add`` / ``delete`` / ``update`` change per-user storage only, under one write lock,
and never touch a published snapshot:

* each user owns a ``base`` block (a read-only view into the last snapshot, or into
  the memory-mapped store after ``load(mmap=True)``) and an owned ``tail`` buffer with
  capacity doubling, so appends are amortised O(d) per row;
* ``delete`` marks tombstones (O(1) per id); a user whose tombstones outnumber its
  live rows (and are at least 64) is compacted on the spot (O(n_u d), amortised over
  those deletions);
* ``update`` overwrites a tail row in place, or records a patch for a base row (the
  base is shared with the snapshot, so it is never written); the item keeps its id
  and its row position (hence its tie-breaking rank, spec "Vectors and scores").

Cost model
----------
* write: O(m d) to validate and normalise m rows, O(m) bookkeeping; the first write to
  a user after a snapshot also copies that user's id / text lists (O(n_u)).
* snapshot: built lazily on the first read after a write (so a burst of writes costs
  one build), under the lock: one O(N d) copy into a fresh matrix (CSR segments must
  be contiguous, so every write moves the rows after it), plus O(n_u) per changed user
  for ids and texts; unchanged users' id / text arrays are copied at C speed. After
  the build every user's storage is rebased onto the new matrix (tails, tombstones and
  patches dropped), so the bank holds ONE copy of its rows in steady state and two
  while a build runs or while an old snapshot is still held by a search.
* :meth:`MemoryBank.compact` forces that build now (reclaiming tombstoned rows); it
  changes neither the version nor any search result.

Concurrency model
-----------------
One re-entrant write lock serialises writers and snapshot builds; readers take the
current snapshot without the lock (an attribute read) and work on that immutable copy
(copy-on-write). A search therefore sees exactly one bank version: never a torn mix,
never an item deleted before it started (its snapshot is at least as new as every
write that completed before the call). Users are append-only (a user whose items are
all deleted stays, with 0 items), so user indices are stable across versions.

Persistence: :meth:`MemoryBank.save` / :meth:`MemoryBank.load` (see :mod:`rfmem_fast.store`).

The :class:`MemoryBank` class keeps its public methods here (each with the docstring the
API reference renders); its parts are split by concept: :mod:`rfmem_fast.bank_snapshot`
(:class:`BankSnapshot`), :mod:`rfmem_fast.bank_validate` (the argument checks of a write),
:mod:`rfmem_fast.bank_rows` (one user's row storage), :mod:`rfmem_fast.bank_writes` (the
write machinery the public writes share) and :mod:`rfmem_fast.bank_layout` (snapshots
built from the rows, and installed as them); the names they define that callers import
from here are re-exported. This module is longer than the others because the public
methods' docstrings are the API reference.
"""
from __future__ import annotations

import copy
import dataclasses
import threading
from typing import Any, Hashable, Iterable, Sequence

import numpy as np

from ._validate import as_float_matrix, check_positive_int, l2_normalize_rows
from .bank_layout import _Layout
from .bank_rows import _UserRows as _UserRows
from .bank_snapshot import NO_POSITION as NO_POSITION
from .bank_snapshot import BankSnapshot as BankSnapshot
from .bank_validate import INSTANT_END as INSTANT_END
from .bank_validate import INSTANT_MIN as INSTANT_MIN
from .bank_validate import INSTANT_RANGE as INSTANT_RANGE
from .bank_validate import MAX_METADATA_DEPTH as MAX_METADATA_DEPTH
from .bank_validate import MAX_POSITION as MAX_POSITION
from .bank_validate import ItemId as ItemId
from .bank_validate import _check_unicode as _check_unicode
from .bank_validate import check_instant as check_instant
from .bank_validate import instants_known as instants_known
from .bank_validate import (_check_id_list, _check_ids, _check_metadata, _check_texts, _check_thread_pairs, _check_user,
                            check_created_at, check_positions, check_threads)
from .bank_writes import _Writes
from .lexical import Analyzer, Vocabulary
from .precision import check_dtype, scan_copies
from .store import read_store, write_store

#: a user is compacted on the spot once its tombstones reach this many AND outnumber its live rows
COMPACT_MIN_DEAD = 64


class MemoryBank(_Writes, _Layout):
    """Many users' memory items in one CSR layout, with incremental updates.

    Args:
        dim: vector dimension d (int >= 1).
        dtype: "float32" (default), "float16" or "bfloat16" (numpy / torch dtypes
            accepted): the type the rows are scanned in. A half-precision bank keeps a
            scan copy of its rows rounded to that type (half the bytes every query
            reads, and what the backends keep resident on their device) next to the
            float32 rows, which only the exact re-scoring of the candidates reads
            (about k rows per query); results equal the float32 bank's
            (:mod:`rfmem_fast.precision`, README "Half-precision banks"). In a bank
            loaded with ``MemoryBank.load(path, mmap=True)`` the float32 rows stay in the
            store file and only the re-scored rows' pages are read. "int8": an int8
            copy with a scale per row and two norm bounds (d + 12 bytes per row), which
            the native backend scans with integer dot products and a proven bound per
            (query, row); the other backends scan the float32 rows; results are the
            float32 bank's too (:func:`rfmem_fast.precision.int8_scan_copy`).

        lexical_stemmer: None (default) or "english": the stemmer of the bank's lexical
            (BM25) index (:mod:`rfmem_fast.lexical`; "english" needs PyStemmer, the
            ``lexical`` extra). Every item's text is tokenised once when it is written.

    Raises:
        TypeError: ``dim`` not an int (a bool, float or string).
        ValueError: ``dim`` < 1; an unknown ``dtype`` or ``lexical_stemmer``.
        ImportError: ``lexical_stemmer="english"`` without PyStemmer.

    Writes: :meth:`add`, :meth:`update`, :meth:`delete` (per-user blocks, tombstones,
    no rebuild of the whole bank per write), :meth:`compact`. Reads: :meth:`snapshot`
    (an immutable :class:`BankSnapshot` of the live rows). Persistence: :meth:`save`,
    :meth:`load`. The module docstring gives the cost and concurrency models.

    Thread safety: any number of threads may search while one or more threads write;
    every search sees one consistent snapshot (a write lock plus immutable
    copy-on-write snapshots).
    """

    def __init__(self, dim: int, dtype: Any = "float32", lexical_stemmer: str | None = None) -> None:
        self._dim = check_positive_int(dim, "dim")
        self._dtype = check_dtype(dtype)
        self._analyzer = Analyzer(lexical_stemmer)
        self._vocab = Vocabulary()
        self._lock = threading.RLock()
        self._users: list[Hashable] = []
        self._uindex: dict[Hashable, int] = {}
        self._rows: list[_UserRows] = []
        self._n_live = 0
        self._version = 0
        self._snap: BankSnapshot | None = None
        self._cache: dict[Any, Any] = {}
        self._store: tuple[str, bool] | None = None  # (path, mmap) when made by load()
        # per-item metadata, {user: {item id: dict}}, only for items that have some;
        # not part of the snapshot (only filtered searches read it, through
        # metadata_rows / metadata_cached), guarded by the lock
        self._meta: dict[Hashable, dict[ItemId, dict]] = {}
        # derived per-(snapshot, metadata) values (rfmem_fast.filters' columns): dropped
        # by every write and by set_metadata
        self._meta_cache: dict[Any, Any] = {}

    def __repr__(self) -> str:
        """``MemoryBank(dim=384, users=2, items=79, version=5, dtype=float16[, store='...', mmap=True])``.

        ``items`` counts live items (deleted ones excluded); ``store`` is the directory
        the bank was loaded from (:meth:`load`; absent otherwise), ``mmap`` whether its
        vectors were memory-mapped then. O(1); takes no lock.
        """
        parts = [
            f"dim={self._dim}", f"users={len(self._users)}", f"items={self._n_live}",
            f"version={self._version}", f"dtype={self._dtype}",
        ]  # fmt: skip
        if self._store is not None:
            parts.append(f"store={self._store[0]!r}")
            if self._store[1]:
                parts.append("mmap=True")
        return f"MemoryBank({', '.join(parts)})"


    # ------------------------------------------------------------------ building
    @classmethod
    def from_arrays(
        cls,
        vectors: Any,
        offsets: Any,
        users: Sequence[Hashable] | None = None,
        item_ids: Sequence[ItemId] | None = None,
        texts: Sequence[str | None] | None = None,
        dtype: Any = "float32",
        lexical_stemmer: str | None = None,
        created_at: Any = None,
        threads: Any = None,
        positions: Any = None,
    ) -> "MemoryBank":
        """Build a bank from a CSR layout in one call.

        Args:
            vectors: [n, d] floating array (float16/32/64, any strides); rows are
                L2-normalised.
            offsets: int [U + 1] non-decreasing, starting at 0 and ending at n; user
                ``u`` owns rows ``offsets[u]:offsets[u+1]`` (a user may own none).
            users: U distinct user keys (str or int); default ``0 .. U-1``.
            item_ids: n item ids (str or int), unique within each user; default the
                row's position inside its user's segment (0, 1, ...).
            texts: n optional texts.
            dtype: the bank's scan type (see :class:`MemoryBank`).
            lexical_stemmer: the lexical index's stemmer (see :class:`MemoryBank`).
            created_at: None (every item: now), one number, or n numbers: creation
                times in seconds since the Unix epoch, UTC (as :meth:`add`).
            threads: None, one thread id, or n threads (str / int / None), as :meth:`add`.
            positions: None or n positions (int >= 0 / None), as :meth:`add`.

        Returns:
            MemoryBank.

        Raises:
            TypeError / ValueError: as :meth:`add`, or malformed ``offsets`` / ``users``,
                or an unknown ``dtype``.
        """
        vec = as_float_matrix(vectors, "vectors")
        off = np.asarray(offsets)
        if off.ndim != 1 or off.shape[0] < 1 or not np.issubdtype(off.dtype, np.integer):
            raise ValueError(f"offsets must be a 1-D integer array [U + 1], got {off.dtype} {off.shape}")
        off = off.astype(np.int64)
        if off[0] != 0 or off[-1] != vec.shape[0] or (np.diff(off) < 0).any():
            raise ValueError(
                f"offsets must be non-decreasing from 0 to n={vec.shape[0]}, got {off[:5]}...{off[-1:]}"
            )
        n_users = off.shape[0] - 1
        if users is None:
            users = list(range(n_users))
        users = list(users)
        if len(users) != n_users:
            raise ValueError(f"users has {len(users)} entries but offsets describes {n_users} users")
        if len(set(_check_user(u, "users") for u in users)) != len(users):
            raise ValueError("users holds duplicate user keys")
        if item_ids is not None and len(item_ids) != vec.shape[0]:
            raise ValueError(f"item_ids has {len(item_ids)} entries but vectors has {vec.shape[0]} rows")
        if texts is not None and len(texts) != vec.shape[0]:
            raise ValueError(f"texts has {len(texts)} entries but vectors has {vec.shape[0]} rows")
        created = check_created_at(created_at, vec.shape[0])
        thr = check_threads(threads, vec.shape[0])
        pos = check_positions(positions, vec.shape[0])
        _check_thread_pairs(thr, pos)
        bank = cls(vec.shape[1], dtype=dtype, lexical_stemmer=lexical_stemmer)
        for u, user in enumerate(users):
            a, b = int(off[u]), int(off[u + 1])
            ids = list(item_ids[a:b]) if item_ids is not None else list(range(b - a))
            tx = list(texts[a:b]) if texts is not None else None
            bank._add_unlocked(user, vec[a:b], ids, tx, allow_empty=True, created_at=created[a:b], threads=thr[a:b],
                               positions=pos[a:b])  # fmt: skip
        return bank

    def add(
        self,
        user: Hashable,
        vectors: Any,
        ids: Sequence[ItemId],
        texts: Sequence[str | None] | None = None,
        metadata: Sequence[dict | None] | None = None,
        created_at: Any = None,
        threads: Any = None,
        positions: Any = None,
    ) -> None:
        """Append items to a user's memory (creating the user if new).

        Args:
            user: user key, str or int (bool refused; numpy scalars accepted).
            vectors: [m, d] floating array (float16/32/64, any strides, numpy or torch),
                m >= 1; each row is L2-normalised before it is stored.
            ids: m item ids (str or int; ``"1"`` and ``1`` are different ids), unique
                within the user's live items. The id of a deleted item may be reused.
            texts: m optional texts (str or None; the empty string is a valid text and
                is kept as ``""``, distinct from None).
            metadata: m optional per-item metadata dicts (or None): JSON objects (str
                keys, JSON values), stored as a deep copy, saved with the bank and read
                back by :meth:`get_metadata`. Only filtered searches read them
                (:mod:`rfmem_fast.filters`).
            created_at: the items' creation times, float64 seconds since the Unix epoch
                (UTC): None (default: now, ``time.time()``, the same for all m), one
                number for all m, or m numbers; each within :data:`INSTANT_RANGE`
                (0001-01-01 .. 9999-12-31 in UTC, :func:`check_instant`). Kept by :meth:`update` unless
                given, stored in the snapshot (:attr:`BankSnapshot.created_at`), saved
                with the bank, and filterable as the reserved field ``created_at``; NaN
                marks an unknown time.
            threads: the items' conversation threads (a session, a chat): None (default:
                no item has one), one str / int thread id for all m, or m entries (str /
                int / None). Ids like item ids (``"1"`` is not ``1``). Stored in the
                snapshot (:attr:`BankSnapshot.threads`), saved with the bank, kept by
                :meth:`update` unless given, filterable as the reserved field ``thread``;
                read by the context score (``RFMemConfig.context_weight`` /
                ``thread_weight``, docs "Conversations").
            positions: the items' positions in their threads (their turn order): None
                (default) or m entries (int >= 0, or None). Items of one thread are
                ordered by position, then by row (insertion order); an item without a
                position comes after those with one. An item with a position must have
                a thread. Filterable as the reserved field ``position``.

        Cost: amortised O(m d) (the user's tail buffer doubles); the next read builds
        a new snapshot (module docstring).

        Raises:
            TypeError: wrong type of user, ids, texts, metadata or a non-floating dtype.
            ValueError: wrong shape or dimension, no rows, NaN / Inf, a zero vector,
                mismatched lengths, a duplicate id, an id the user already holds,
                metadata that is not JSON (a ``datetime`` named, with the ``.isoformat()``
                advice), or a ``created_at`` that is infinite or outside
                :data:`INSTANT_RANGE` (``created_at[i]`` named, with a hint for epoch
                milliseconds and the like); a thread that is not a str / int / None
                (TypeError naming ``threads[i]``), a position that is not an int >= 0
                (``positions[i]`` named), a position without a thread.
            Nothing is written when an error is raised.
        """
        with self._lock:
            self._add_unlocked(user, vectors, ids, texts, allow_empty=False, metadata=metadata, created_at=created_at,
                               threads=threads, positions=positions)  # fmt: skip

    @property
    def lexical_stemmer(self) -> str | None:
        """The stemmer of the lexical index: None or "english"."""
        return self._analyzer.stemmer

    def delete(self, user: Hashable, ids: Sequence[ItemId], missing_ok: bool = False) -> int:
        """Delete items of a user; they are never returned by any later search.

        Args:
            user: an existing user key.
            ids: m >= 1 distinct item ids (str or int) the user holds.
            missing_ok: False (default): an id the user does not hold is an error
                (KeyError naming every missing id; nothing is deleted). True: such
                ids are skipped and the others deleted (an idempotent delete; when
                none is held, nothing changes, not even :attr:`version`).

        Returns:
            int: the number of items deleted (``m`` unless ``missing_ok`` skipped some).

        Cost: O(m) (tombstones); a user whose tombstones reach ``COMPACT_MIN_DEAD`` and
        outnumber its live rows is compacted on the spot (O(n_u d), amortised). The
        user stays, with 0 items when all are deleted (a search for it then gets the
        documented empty row).

        Raises:
            KeyError: unknown user (also with ``missing_ok=True``), or, with
                ``missing_ok=False``, ids the user does not hold (the message names
                them); nothing is deleted then.
            TypeError: ids not a sequence of str / int, or ``missing_ok`` not a bool.
            ValueError: no ids, or a duplicate id.
        """
        if not isinstance(missing_ok, (bool, np.bool_)):
            raise TypeError(f"missing_ok must be a bool, got {type(missing_ok).__name__}")
        with self._lock:
            u = self.user_index(user)
            id_list = _check_id_list(ids)
            if not id_list:
                raise ValueError("ids must hold at least one item id")
            if missing_ok:
                held = self._rows[u].slots()
                id_list = [i for i in id_list if i in held]
                if not id_list:
                    return 0
            r, slots = self._writable_slots(u, id_list)
            for i in id_list:
                r.kill(slots.pop(i))
            self._set_metadata(self._users[u], id_list, [None] * len(id_list))
            self._n_live -= len(id_list)
            if r.n_dead >= COMPACT_MIN_DEAD and r.n_dead > r.n_live:
                r.compact(self._dim)
            self._touch()
            return len(id_list)

    def update(
        self,
        user: Hashable,
        ids: Sequence[ItemId],
        vectors: Any,
        texts: Sequence[str | None] | None = None,
        metadata: Sequence[dict | None] | None = None,
        created_at: Any = None,
        threads: Any = None,
        positions: Any = None,
    ) -> None:
        """Replace the vectors (and optionally texts, metadata, creation times, threads, positions) of existing items, keeping their ids.

        Args:
            user: an existing user key.
            ids: m >= 1 distinct item ids the user holds.
            vectors: [m, d] floating array, checked and L2-normalised as in :meth:`add`,
                or None to keep the items' vectors (change only the other fields; at
                least one of them must be given).
            texts: m new texts (str or None), or None to keep the current texts.
            metadata: m new metadata dicts (None entries clear an item's metadata), or
                None to keep the current metadata (:meth:`set_metadata` changes only
                metadata).
            created_at: None (default) keeps each item's creation time; one number or
                m numbers (seconds since the Unix epoch, UTC, within :data:`INSTANT_RANGE`)
                replace them.
            threads: None (default) keeps each item's thread; one thread id or m
                entries (str / int / None: None removes an item's thread) replace them.
            positions: None (default) keeps each item's position; m entries (int >= 0
                / None) replace them. The resulting items must not hold a position
                without a thread (clear both with ``threads=[None] * m,
                positions=[None] * m``).

        Each item keeps its id and its row position within the user (so ties still
        break as before). Cost: O(m d).

        Raises:
            KeyError: unknown user, or an id the user does not hold (named).
            TypeError / ValueError: as :meth:`add` (shapes, dtype, NaN / Inf, zero
                rows, lengths, duplicates); ``vectors`` None with nothing else to change
                (TypeError). Nothing is written when an error is raised.
        """
        with self._lock:
            u = self.user_index(user)
            if vectors is None:  # the other fields only: the rows are kept bit for bit
                if texts is None and metadata is None and created_at is None and threads is None and positions is None:
                    raise TypeError("vectors must be a floating [m, d] array, or None with another field to change "
                                    "(texts, metadata, created_at, threads, positions); got None and nothing else")
                vec = None
                id_list = _check_id_list(ids)
                if not id_list:
                    raise ValueError("ids must hold at least one item id")
            else:
                vec = as_float_matrix(vectors, "vectors", self._dim)
                if vec.shape[0] == 0:
                    raise ValueError("vectors must hold at least one row")
                vec = l2_normalize_rows(vec, "vectors")
                id_list = _check_ids(ids, vec.shape[0])
            m = len(id_list)
            tx = None if texts is None else _check_texts(texts, m)
            meta = None if metadata is None else _check_metadata(metadata, m)
            created = None if created_at is None else check_created_at(created_at, m)
            thr = None if threads is None else check_threads(threads, m)
            pos = None if positions is None else check_positions(positions, m)
            if (thr is None) != (pos is None):  # the items as they will be: no position without a thread
                r0 = self._rows[u]
                cur = {i: j for j, i in enumerate(r0.live_ids())}
                kept = r0.live_threads() if thr is None else r0.live_positions()
                old = [kept[cur[i]] if i in cur else None for i in id_list]
                _check_thread_pairs(old if thr is None else thr, pos if pos is not None else old,
                                    "the item's " if thr is None else "")  # fmt: skip
            elif thr is not None:
                _check_thread_pairs(thr, pos)
            r, slots = self._writable_slots(u, id_list)
            enc = self._encode(tx) if tx is not None else None
            for j, i in enumerate(id_list):
                s = slots[i]
                if vec is not None:
                    r.set_row(s, vec[j])
                if tx is not None:
                    r.texts[s] = tx[j]
                    r.toks[s] = enc[j]
                if created is not None:
                    r.created[s] = created[j]
                if thr is not None:
                    r.threads[s] = thr[j]
                if pos is not None:
                    r.positions[s] = pos[j]
            if meta is not None:
                self._set_metadata(self._users[u], id_list, meta)
            self._touch()

    def set_metadata(self, user: Hashable, ids: Sequence[ItemId], metadata: Sequence[dict | None]) -> None:
        """Replace the metadata of existing items (vectors and texts unchanged).

        Args:
            user: an existing user key.
            ids: m >= 1 distinct item ids the user holds.
            metadata: m dicts (JSON objects, as in :meth:`add`) or None (clears).

        Searches never read metadata, so neither :attr:`version` nor the snapshot
        changes. Cost: O(m) plus the JSON copy of the dicts.

        Raises:
            KeyError: unknown user, or an id the user does not hold (named).
            TypeError / ValueError: malformed ids or metadata (nothing is written then).
        """
        with self._lock:
            u = self.user_index(user)
            id_list = _check_id_list(ids)
            if not id_list:
                raise ValueError("ids must hold at least one item id")
            meta = _check_metadata(metadata, len(id_list))
            slots = self._rows[u].slots()
            missing = [i for i in id_list if i not in slots]
            if missing:
                raise KeyError(f"ids: user {self._users[u]!r} holds no item id {missing[0]!r}")
            self._set_metadata(self._users[u], id_list, meta)
            self._meta_cache = {}

    def compact(self) -> int:
        """Reclaim the rows of deleted items now (build the snapshot and rebase on it).

        Tombstones are otherwise reclaimed at the next snapshot build (the first read
        after a write). Changes neither :attr:`version` nor any search result.

        Returns:
            int: the number of tombstoned rows dropped.

        Cost: one snapshot build when the bank changed since the last one (O(N d)), else O(U).
        """
        with self._lock:
            dropped = sum(r.n_dead for r in self._rows if r.dirty)
            if self._snap is None:
                self._snap = self._build_snapshot_locked()
            return dropped

    # ------------------------------------------------------------------ persistence
    def save(self, path: Any) -> None:
        """Write the bank to a store directory, atomically (see :mod:`rfmem_fast.store`).

        Args:
            path: directory (created if absent; an existing store there is replaced
                only once the new one is complete and synced).

        Raises:
            StoreError: ``path`` exists but is not a store, or cannot be created or
                written into (permission, a parent that is a file, ...); OSError: I/O
                failure while writing (the previous store stays intact).
        """
        self._save(path)

    def _save(self, path: Any) -> Any:
        """:meth:`save`, returning the committed data directory (a Path)."""
        snap, metadata = self._snapshot_and_metadata()
        return write_store(path, snap, metadata, dim=self.dim, lexical_stemmer=self.lexical_stemmer)

    @classmethod
    def load(cls, path: Any, mmap: bool = False, verify: bool = True) -> "MemoryBank":
        """Read a bank written by :meth:`save`: the arrays :func:`rfmem_fast.store.read_store` reads, as a bank.

        Args:
            path: the store directory.
            mmap: map ``vectors.npy`` (copy-on-write) instead of reading it into memory.
            verify: check every file's sha256 and the rows' finiteness and norms.

        Returns:
            MemoryBank equal to the saved one (users, ids, texts, vectors, version). A
            creation time outside :data:`INSTANT_RANGE` (written by a version that did not
            check it) is read as unknown, NaN, with a warning on the ``rfmem_fast.bank``
            logger: such an item reads, searches and saves as one of an older store.

        Raises:
            StoreError (a ValueError): missing, corrupt, truncated, edited or
                newer-version store; the message names the file.
        """
        c = read_store(path, mmap=mmap, verify=verify)
        snap = BankSnapshot(c.vectors, c.offsets, c.item_ids, c.version, c.users, c.texts, c.scan, c.dtype, c.lexical,
                            c.created_at, c.scan_meta, c.threads, c.positions)  # fmt: skip
        bank = cls(c.dim, dtype=c.dtype, lexical_stemmer=c.lexical_stemmer)
        bank._install(snap, c.metadata)  # a store without a lexical index (format 1 / 2) is indexed here
        bank._store = (c.path, c.mmap)
        return bank

    def astype(self, dtype: Any) -> "MemoryBank":
        """A bank of another scan type holding this bank's current users, items and rows.

        Args:
            dtype: "float32", "float16", "bfloat16" or "int8" (see :class:`MemoryBank`).

        Returns:
            a new MemoryBank of ``dtype`` whose snapshot has this bank's float32 rows,
            offsets, users, item ids, texts and version, and a copy of the items'
            metadata. The float32 rows are SHARED with this bank's current snapshot (no
            copy: snapshots are immutable and neither bank ever writes them); the scan
            copy of a half or int8 type is computed here (O(n d)). Later writes to either bank do
            not affect the other.

        Raises:
            ValueError: an unknown ``dtype``.
        """
        dtype = check_dtype(dtype)
        with self._lock:
            snap = self.snapshot()
            meta = None
            if self._meta:
                meta = [None] * snap.num_items
                for u, user in enumerate(snap.users):
                    store = self._meta.get(user)
                    if store:
                        for r in range(int(snap.offsets[u]), int(snap.offsets[u + 1])):
                            m = store.get(snap.item_ids[r])
                            meta[r] = None if m is None else copy.deepcopy(m)
        scan, scan_meta = scan_copies(snap.vectors, dtype)
        out = MemoryBank(self._dim, dtype=dtype, lexical_stemmer=self.lexical_stemmer)
        out._install(dataclasses.replace(snap, scan=scan, dtype=dtype, scan_meta=scan_meta), meta)
        return out

    # ------------------------------------------------------------------ reading
    @property
    def dim(self) -> int:
        """Vector dimension d."""
        return self._dim

    @property
    def dtype(self) -> str:
        """The type the rows are scanned in: "float32", "float16", "bfloat16" or "int8"."""
        return self._dtype

    @property
    def version(self) -> int:
        """Write counter: increases on every successful add / update / delete."""
        return self._version

    @property
    def users(self) -> list[Hashable]:
        """User keys in segment order (a copy); users are never removed."""
        return list(self._users)

    @property
    def num_users(self) -> int:
        """Number of users U (including users with 0 items)."""
        return len(self._users)

    @property
    def num_items(self) -> int:
        """Number of live items n over all users."""
        return self._n_live

    def __len__(self) -> int:
        return self.num_items

    def __contains__(self, user: object) -> bool:
        try:
            key = _check_user(user)
        except TypeError:
            return False
        return key in self._uindex

    def user_size(self, user: Hashable) -> int:
        """Number of live items of ``user``. Raises KeyError for an unknown user."""
        with self._lock:
            return self._rows[self.user_index(user)].n_live

    def user_index(self, user: Hashable) -> int:
        """Segment index of ``user`` (stable for the bank's lifetime).

        Raises:
            KeyError: unknown user, or a key that is not a str / int (the message names it).
        """
        try:
            key = _check_user(user)
            return self._uindex[key]
        except (KeyError, TypeError):
            raise KeyError(f"user: unknown user {user!r}") from None

    def segments_for(self, users: Iterable[Hashable], snapshot: BankSnapshot | None = None) -> np.ndarray:
        """int64 [b]: the segment index of each user key.

        Args:
            users: b user keys (str or int; numpy scalars accepted).
            snapshot: when given, a user added after that snapshot counts as unknown,
                so the indices are valid for exactly that snapshot (what a search uses).

        Raises:
            TypeError: a key that is not a str or int (bool and float refused), named
                with its position.
            KeyError: an unknown user (the message names it and its position).
        """
        return np.asarray(self.segment_list(users, snapshot), dtype=np.int64)

    def segment_list(self, users: Iterable[Hashable], snapshot: BankSnapshot | None = None) -> list[int]:
        """:meth:`segments_for` as a list of Python ints (same checks and errors).

        Raises:
            TypeError / KeyError: as :meth:`segments_for`.
        """
        limit = snapshot.num_users if snapshot is not None else None
        index = self._uindex
        out = []
        for pos, user in enumerate(users):
            t = type(user)
            key = user if (t is str or t is int) else _check_user(user, f"users[{pos}]")
            u = index.get(key)
            if u is None or (limit is not None and u >= limit):
                raise KeyError(f"users[{pos}]: unknown user {user!r}")
            out.append(u)
        return out

    def snapshot(self) -> BankSnapshot:
        """The current live rows as an immutable CSR snapshot (built once per write, then cached).

        Returns:
            BankSnapshot with vectors float32 [n, d], offsets int64 [U + 1],
            item_ids object [n], texts object [n], users (U keys), version.

        Cost: O(1) when cached; after a write, one build (module docstring) under the
        write lock. Never returns a half-built layout.
        """
        snap = self._snap
        if snap is not None:
            return snap
        with self._lock:
            if self._snap is None:
                self._snap = self._build_snapshot_locked()
            return self._snap

    def texts_of(self, user: Hashable) -> list[str | None]:
        """The texts of ``user``'s live items in row order (None where none was given)."""
        with self._lock:
            return self._rows[self.user_index(user)].live_texts()

    def item_ids_of(self, user: Hashable) -> list[ItemId]:
        """The ids of ``user``'s live items in row order."""
        with self._lock:
            return self._rows[self.user_index(user)].live_ids()

    def has_items(self, user: Hashable, ids: Sequence[ItemId]) -> list[bool]:
        """For each id, whether ``user`` holds a live item with it (all False for a user
        never written). O(len(ids)) once the user's id map is built (O(n_u), cached
        until the user's rows move). Ids are compared as stored (``"1"`` is not ``1``).

        Raises:
            TypeError: ``ids`` not a sequence of str / int.
        """
        with self._lock:
            if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
                raise TypeError(f"ids must be a sequence of str or int item ids, got {type(ids).__name__}")
            id_list = ids if isinstance(ids, list) else list(ids)
            u = self._uindex.get(_check_user(user))
            if u is None:
                return [False] * len(id_list)
            slots = self._rows[u].slots()
            return [i in slots for i in id_list]

    def created_at_of(self, user: Hashable, ids: Sequence[ItemId] | None = None) -> np.ndarray:
        """The creation times of some (or all) of ``user``'s live items.

        Args:
            user: an existing user key.
            ids: item ids the user holds, or None for all its live items in row order.

        Returns:
            float64 [m] seconds since the Unix epoch (UTC), NaN where unknown (an item
            loaded from a store of format < 4, or whose stored time was outside
            :data:`INSTANT_RANGE`: :meth:`load` reads it as NaN), aligned with ``ids``.

        Raises:
            KeyError: unknown user, or an id the user does not hold (named).
        """
        with self._lock:
            u = self.user_index(user)
            r = self._rows[u]
            live = r.live_created()
            if ids is None:
                return np.asarray(live, dtype=np.float64)
            id_list = _check_id_list(ids)
            pos = {i: j for j, i in enumerate(r.live_ids())}
            missing = [i for i in id_list if i not in pos]
            if missing:
                raise KeyError(f"ids: user {self._users[u]!r} holds no item id {missing[0]!r}")
            return np.asarray([live[pos[i]] for i in id_list], dtype=np.float64)

    def _per_item(self, user: Hashable, ids: Sequence[ItemId] | None, live_of: str) -> list:
        """``_UserRows.<live_of>()`` of ``user`` for ``ids`` (None: all live items in row order), under the lock."""
        with self._lock:
            u = self.user_index(user)
            r = self._rows[u]
            live = getattr(r, live_of)()
            if ids is None:
                return live
            id_list = _check_id_list(ids)
            pos = {i: j for j, i in enumerate(r.live_ids())}
            missing = [i for i in id_list if i not in pos]
            if missing:
                raise KeyError(f"ids: user {self._users[u]!r} holds no item id {missing[0]!r}")
            return [live[pos[i]] for i in id_list]

    def threads_of(self, user: Hashable, ids: Sequence[ItemId] | None = None) -> list:
        """The conversation threads of some (or all) of ``user``'s live items (:meth:`add`).

        Args:
            user: an existing user key.
            ids: item ids the user holds, or None for all its live items in row order.

        Returns:
            list [m] of str / int, None for an item without a thread, aligned with ``ids``.

        Raises:
            KeyError: unknown user, or an id the user does not hold (named).
        """
        return self._per_item(user, ids, "live_threads")

    def positions_of(self, user: Hashable, ids: Sequence[ItemId] | None = None) -> list:
        """The positions in their threads of some (or all) of ``user``'s live items (:meth:`add`).

        Args:
            user: an existing user key.
            ids: item ids the user holds, or None for all its live items in row order.

        Returns:
            list [m] of int >= 0, None for an item without a position, aligned with ``ids``.

        Raises:
            KeyError: unknown user, or an id the user does not hold (named).
        """
        return self._per_item(user, ids, "live_positions")

    def metadata_rows(self, user_index: int, snapshot: BankSnapshot) -> list:
        """The metadata of the rows of segment ``user_index`` of ``snapshot``, in row order.

        Read under the lock from the bank's current metadata by the rows' item ids, so a
        row whose item was deleted (or had its metadata cleared) since the snapshot gets
        None. The dicts are the bank's own (shared, not copies): the caller must not
        modify them (:mod:`rfmem_fast.filters` only reads them).

        Args:
            user_index: a segment index of ``snapshot``.
            snapshot: a snapshot of this bank.

        Returns:
            list [n_u] of dict / None.

        Raises:
            IndexError: ``user_index`` outside the snapshot's segments.
        """
        if not 0 <= int(user_index) < snapshot.num_users:
            raise IndexError(f"user_index {user_index} is not a segment of the snapshot (0..{snapshot.num_users - 1})")
        a, b = int(snapshot.offsets[user_index]), int(snapshot.offsets[user_index + 1])
        with self._lock:
            store = self._meta.get(snapshot.users[user_index])
            if not store:
                return [None] * (b - a)
            get = store.get
            return [get(i) for i in snapshot.item_ids[a:b]]

    def metadata_cached(self, snapshot: BankSnapshot, key: Any, build: Any) -> Any:
        """A cache for values derived from ``snapshot`` and the bank's metadata (filter columns).

        An entry lives until the next write or :meth:`set_metadata`; values are cached
        only for the bank's current snapshot (an older snapshot's are built afresh).

        Args:
            snapshot: the snapshot the value belongs to.
            key: hashable key.
            build: zero-argument callable producing the value on a miss.

        Returns:
            the (possibly cached) value.
        """
        cache = self._meta_cache
        hit = cache.get(key)
        if hit is not None and hit[0] is snapshot:
            return hit[1]
        value = build()
        if self._snap is snapshot:
            cache[key] = (snapshot, value)
        return value

    def get_metadata(self, user: Hashable, ids: Sequence[ItemId] | None = None) -> list[dict | None]:
        """The metadata of some (or all) of ``user``'s live items, as deep copies.

        Args:
            user: an existing user key.
            ids: item ids the user holds, or None for all its live items in row order.

        Returns:
            list of dict (None for an item stored without metadata), aligned with ``ids``.

        Raises:
            KeyError: unknown user, or an id the user does not hold (named).
        """
        with self._lock:
            u = self.user_index(user)
            if ids is None:
                id_list = self._rows[u].live_ids()
            else:
                id_list = _check_id_list(ids)
                slots = self._rows[u].slots()
                missing = [i for i in id_list if i not in slots]
                if missing:
                    raise KeyError(f"ids: user {self._users[u]!r} holds no item id {missing[0]!r}")
            store = self._meta.get(self._users[u], {})
            return [copy.deepcopy(store.get(i)) for i in id_list]

    def cached(self, key: Any, build: Any) -> Any:
        """Per-snapshot cache for backends (device copies of the snapshot and the like).

        Args:
            key: hashable cache key.
            build: zero-argument callable producing the value on a miss.

        Returns:
            the cached value; rebuilt whenever the bank's snapshot changes (after any
            write). An entry is tagged with the snapshot it was made from (the value's
            ``snapshot`` attribute when it has one), so a reader racing a writer can
            never be handed a view of an older snapshot than the current one.
        """
        snap = self.snapshot()
        cache = self._cache
        hit = cache.get(key)
        if hit is not None and hit[0] is snap:
            return hit[1]
        value = build()
        made_from = getattr(value, "snapshot", None)
        cache[key] = (made_from if isinstance(made_from, BankSnapshot) else snap, value)
        return value
