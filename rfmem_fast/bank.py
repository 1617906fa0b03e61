"""MemoryBank: many users' memory vectors in one CSR layout (RFMEM_SPEC.md, "Vectors and scores").

The rows of all users are stored in one float32 matrix ``vectors[n, d]``; user ``u``
owns the contiguous rows ``offsets[u] : offsets[u + 1]`` (CSR segments). Every row
is L2-normalised on the way in, so that the inner product is the cosine score.
Each row carries the caller's item id (str or int, unique within its user) and an
optional text.

Writes (``add``) go to per-user blocks; the CSR arrays are rebuilt lazily on the
next read, once, and cached until the next write. Reads never see a half-built
layout: the cached snapshot is replaced whole.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Sequence

import numpy as np

from ._validate import as_float_matrix, l2_normalize_rows

ItemId = Hashable


@dataclass(frozen=True)
class BankSnapshot:
    """An immutable CSR view of a bank, as the backends consume it.

    Attributes:
        vectors: float32 [n, d], C-contiguous, unit rows.
        offsets: int64 [U + 1], non-decreasing, ``offsets[0] == 0``, ``offsets[U] == n``.
        item_ids: object ndarray [n], the caller's item id of each row.
        version: the bank's write counter when the snapshot was taken.
    """

    vectors: np.ndarray
    offsets: np.ndarray
    item_ids: np.ndarray
    version: int

    @property
    def num_users(self) -> int:
        """Number of user segments U."""
        return int(self.offsets.shape[0] - 1)

    @property
    def segment_lengths(self) -> np.ndarray:
        """int64 [U]: rows per user."""
        return np.diff(self.offsets)


def _check_user(user: Any) -> Hashable:
    if isinstance(user, bool) or not isinstance(user, (str, int, np.integer)):
        raise TypeError(f"user must be a str or an int, got {type(user).__name__}")
    return int(user) if isinstance(user, np.integer) else user


def _check_ids(ids: Any, n: int, name: str = "ids") -> list[ItemId]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
        raise TypeError(f"{name} must be a sequence of str or int item ids, got {type(ids).__name__}")
    out: list[ItemId] = []
    for i in ids:
        if isinstance(i, np.integer):
            i = int(i)
        elif isinstance(i, np.str_):
            i = str(i)
        if isinstance(i, bool) or not isinstance(i, (str, int)):
            raise TypeError(f"{name} must hold str or int item ids, got {type(i).__name__}")
        out.append(i)
    if len(out) != n:
        raise ValueError(f"{name} has {len(out)} entries but vectors has {n} rows")
    if len(set(out)) != len(out):
        seen: set = set()
        dup = next(i for i in out if i in seen or seen.add(i))
        raise ValueError(f"{name} holds the duplicate item id {dup!r}")
    return out


def _check_texts(texts: Any, n: int) -> list[str | None]:
    if texts is None:
        return [None] * n
    if isinstance(texts, (str, bytes)):
        raise TypeError("texts must be a sequence of str (or None), got a single string")
    out = list(texts)
    if len(out) != n:
        raise ValueError(f"texts has {len(out)} entries but vectors has {n} rows")
    for t in out:
        if t is not None and not isinstance(t, str):
            raise TypeError(f"texts must hold str or None, got {type(t).__name__}")
    return out


class MemoryBank:
    """Many users' memory items in one CSR layout.

    Args:
        dim: vector dimension d (int >= 1).

    Raises:
        ValueError: ``dim`` < 1.

    Thread safety: writes take an internal lock; a read (``snapshot``) returns an
    immutable :class:`BankSnapshot`, so searches running while another thread adds
    see either the old or the new bank, never a mix.
    """

    def __init__(self, dim: int) -> None:
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
            raise ValueError(f"dim must be an int >= 1, got {dim!r}")
        self._dim = int(dim)
        self._lock = threading.Lock()
        self._users: list[Hashable] = []
        self._uindex: dict[Hashable, int] = {}
        self._blocks: list[list[np.ndarray]] = []
        self._ids: list[list[ItemId]] = []
        self._idsets: list[set] = []
        self._texts: list[list[str | None]] = []
        self._version = 0
        self._snap: BankSnapshot | None = None
        self._cache: dict[Any, Any] = {}

    # ------------------------------------------------------------------ building
    @classmethod
    def from_arrays(
        cls,
        vectors: Any,
        offsets: Any,
        users: Sequence[Hashable] | None = None,
        item_ids: Sequence[ItemId] | None = None,
        texts: Sequence[str | None] | None = None,
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

        Returns:
            MemoryBank.

        Raises:
            TypeError / ValueError: as :meth:`add`, or malformed ``offsets`` / ``users``.
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
        if len(set(map(_check_user, users))) != len(users):
            raise ValueError("users holds duplicate user keys")
        if item_ids is not None and len(item_ids) != vec.shape[0]:
            raise ValueError(f"item_ids has {len(item_ids)} entries but vectors has {vec.shape[0]} rows")
        if texts is not None and len(texts) != vec.shape[0]:
            raise ValueError(f"texts has {len(texts)} entries but vectors has {vec.shape[0]} rows")
        bank = cls(vec.shape[1])
        for u, user in enumerate(users):
            a, b = int(off[u]), int(off[u + 1])
            ids = list(item_ids[a:b]) if item_ids is not None else list(range(b - a))
            tx = list(texts[a:b]) if texts is not None else None
            bank._add_unlocked(user, vec[a:b], ids, tx, allow_empty=True)
        return bank

    def add(
        self,
        user: Hashable,
        vectors: Any,
        ids: Sequence[ItemId],
        texts: Sequence[str | None] | None = None,
    ) -> None:
        """Append items to a user's memory (creating the user if new).

        Args:
            user: user key, str or int.
            vectors: [m, d] floating array (float16/32/64, any strides, numpy or torch);
                each row is L2-normalised before it is stored.
            ids: m item ids (str or int), unique within the user, including the
                items the user already has.
            texts: m optional texts (str or None).

        Raises:
            TypeError: wrong type of user, ids, texts or a non-floating dtype.
            ValueError: wrong shape or dimension, NaN / Inf, a zero vector, mismatched
                lengths, or an id the user already holds.
        """
        with self._lock:
            self._add_unlocked(user, vectors, ids, texts, allow_empty=False)

    def _add_unlocked(self, user, vectors, ids, texts, allow_empty: bool) -> None:
        user = _check_user(user)
        vec = as_float_matrix(vectors, "vectors", self._dim)
        if vec.shape[0] == 0 and not allow_empty:
            raise ValueError("vectors must hold at least one row")
        vec = l2_normalize_rows(vec, "vectors")
        id_list = _check_ids(ids, vec.shape[0])
        tx = _check_texts(texts, vec.shape[0])
        u = self._uindex.get(user)
        if u is not None:
            clash = [i for i in id_list if i in self._idsets[u]]
            if clash:
                raise ValueError(f"ids: user {user!r} already holds item id {clash[0]!r}")
        else:
            u = len(self._users)
            self._users.append(user)
            self._uindex[user] = u
            self._blocks.append([])
            self._ids.append([])
            self._idsets.append(set())
            self._texts.append([])
        if vec.shape[0]:
            self._blocks[u].append(vec)
            self._ids[u].extend(id_list)
            self._idsets[u].update(id_list)
            self._texts[u].extend(tx)
        self._version += 1
        self._snap = None
        self._cache = {}

    # ------------------------------------------------------------------ reading
    @property
    def dim(self) -> int:
        """Vector dimension d."""
        return self._dim

    @property
    def version(self) -> int:
        """Write counter: changes on every successful write."""
        return self._version

    @property
    def users(self) -> list[Hashable]:
        """User keys in segment order (a copy)."""
        return list(self._users)

    @property
    def num_users(self) -> int:
        """Number of users U."""
        return len(self._users)

    @property
    def num_items(self) -> int:
        """Total number of rows n over all users."""
        return sum(len(i) for i in self._ids)

    def __len__(self) -> int:
        return self.num_items

    def __contains__(self, user: object) -> bool:
        return user in self._uindex

    def user_size(self, user: Hashable) -> int:
        """Number of items of ``user``. Raises KeyError for an unknown user."""
        return len(self._ids[self.user_index(user)])

    def user_index(self, user: Hashable) -> int:
        """Segment index of ``user``.

        Raises:
            KeyError: unknown user (the message names it).
        """
        try:
            return self._uindex[user]
        except (KeyError, TypeError):
            raise KeyError(f"users: unknown user {user!r}") from None

    def segments_for(self, users: Iterable[Hashable]) -> np.ndarray:
        """int64 [b]: the segment index of each user key.

        Raises:
            KeyError: an unknown user (the message names it and its position).
        """
        out = []
        for pos, user in enumerate(users):
            if isinstance(user, np.integer):
                user = int(user)
            elif isinstance(user, np.str_):
                user = str(user)
            u = self._uindex.get(user) if isinstance(user, Hashable) else None
            if u is None:
                raise KeyError(f"users[{pos}]: unknown user {user!r}")
            out.append(u)
        return np.asarray(out, dtype=np.int64)

    def snapshot(self) -> BankSnapshot:
        """The current CSR layout (built once per write, then cached).

        Returns:
            BankSnapshot with vectors float32 [n, d], offsets int64 [U + 1],
            item_ids object [n].
        """
        snap = self._snap
        if snap is not None:
            return snap
        with self._lock:
            if self._snap is None:
                lengths = [len(i) for i in self._ids]
                offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
                np.cumsum(lengths, out=offsets[1:])
                blocks = [b for bl in self._blocks for b in bl]
                vectors = (
                    np.concatenate(blocks, axis=0)
                    if blocks
                    else np.zeros((0, self._dim), dtype=np.float32)
                )
                item_ids = np.empty(int(offsets[-1]), dtype=object)
                item_ids[:] = [i for ids in self._ids for i in ids]
                self._snap = BankSnapshot(vectors, offsets, item_ids, self._version)
                self._blocks = [[vectors[offsets[u] : offsets[u + 1]]] if lengths[u] else [] for u in range(len(lengths))]
            return self._snap

    def texts_of(self, user: Hashable) -> list[str | None]:
        """The texts of ``user``'s items in row order (None where none was given)."""
        return list(self._texts[self.user_index(user)])

    def item_ids_of(self, user: Hashable) -> list[ItemId]:
        """The item ids of ``user`` in row order."""
        return list(self._ids[self.user_index(user)])

    def cached(self, key: Any, build: Any) -> Any:
        """Per-version cache for backends (device copies of the snapshot and the like).

        Args:
            key: hashable cache key.
            build: zero-argument callable producing the value on a miss.

        Returns:
            the cached value, rebuilt after any write to the bank.
        """
        version = self._version
        hit = self._cache.get(key)
        if hit is not None and hit[0] == version:
            return hit[1]
        value = build()
        self._cache[key] = (version, value)
        return value
