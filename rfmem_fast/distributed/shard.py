"""One shard: a :class:`~rfmem_fast.MemoryBank`, its backend and its durable home.

:class:`ShardServer` is a plain Python class (no Ray import): :class:`ShardedMemory`
runs one instance per shard as a Ray actor (``ray.remote(ShardServer)``), and tests can
drive it in-process. An actor runs one call at a time (Ray's default
``max_concurrency=1``), so a search never sees a half-applied write.

Durable home (``home`` given; the layout of one shard of a sharded store)::

    home/store/       the bank store of the last checkpoint (rfmem_fast.store format)
    home/wal.sqlite   the write-ahead log of every write since (rfmem_fast.distributed.wal)
    home/LOCK         held (flock) by the process serving the shard

Write protocol (what "acknowledged" means): a write is applied to the in-memory bank
(which validates it and writes nothing on error), appended to the log and committed
with fsync; only then does the call return. A process killed at any point therefore
loses no acknowledged write: a restart loads ``store`` and replays the log. If the
commit itself fails (disk full, I/O error) the shard reloads its durable state (so the
unlogged write is gone from memory too) and the call raises. Without a home the shard
lives in memory only: nothing survives its process.

Searches call :func:`rfmem_fast.search` on the shard's bank, never a backend's
internals. A shard whose bank holds no live item cannot be searched by ``search``
(``ValueError: bank is empty``), yet its users exist with 0 items; their queries get the
engine's own empty-user answer from a scratch bank holding those users plus one
sentinel item of another user (see :meth:`ShardServer.search`).
"""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any, Hashable, Sequence

import numpy as np

from .._validate import as_float_matrix
from ..backends import Backend, get_backend
from ..bank import MemoryBank, _check_id_list, _check_user, check_positions, check_threads
from ..config import RFMemConfig
from ..search import SearchResult, search
from ..store import CURRENT, StoreError
from .sharding import shard_of
from .wal import WAL_FILE, WalRecord, WriteAheadLog

STORE_DIR = "store"
LOCK_FILE = "LOCK"

try:  # POSIX advisory lock on the shard's home; absent on Windows (no lock there)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


def _apply(bank: MemoryBank, op: str, user: Hashable, ids: list, vectors: Any, texts: Any, threads: Any = None,
           positions: Any = None) -> None:  # fmt: skip
    """Apply one write to ``bank`` (the live path and log replay share this)."""
    if op == "add":
        bank.add(user, vectors, ids, texts=texts, threads=threads, positions=positions)
    elif op == "delete":
        bank.delete(user, ids)
    elif op == "update":
        bank.update(user, ids, vectors, texts=texts, threads=threads, positions=positions)
    else:  # pragma: no cover - the log refuses unknown ops
        raise ValueError(f"unknown write op {op!r}")


class ShardServer:
    """Shard ``index`` of ``num_shards``: a MemoryBank, a backend and an optional durable home.

    Args:
        index: this shard's number in [0, num_shards).
        num_shards: the number of shards (users are checked to hash here, see
            :func:`rfmem_fast.distributed.sharding.shard_of`).
        dim: vector dimension d.
        home: directory of the shard's store and write-ahead log (module docstring);
            opened (store loaded, log replayed) when it holds them, created otherwise.
            None: in memory only.
        backend: default backend of :meth:`search` ("auto" resolves here, in the
            shard's process: triton / torch on a GPU actor, native on a CPU one).
        device: torch device for device-capable backends (default: the backend's).
        threads: torch intra-op threads of this process (None: leave as is).
        defer_errors: if True, a home that cannot be opened does not make the
            constructor raise: every later call raises that error instead (a Ray actor
            whose ``__init__`` raises loses the exception's type; this keeps it).

    Raises:
        StoreError: the home is locked by another live process, its store or log is
            corrupt, its dimension differs from ``dim``, or it holds a user that does
            not hash to ``index``.
        ValueError: bad ``index`` / ``num_shards`` / ``dim`` or an unknown backend.
    """

    def __init__(
        self,
        index: int,
        num_shards: int,
        dim: int,
        home: str | None = None,
        backend: str = "auto",
        device: str | None = None,
        threads: int | None = None,
        defer_errors: bool = False,
    ) -> None:
        if not 0 <= int(index) < int(num_shards):
            raise ValueError(f"index must lie in [0, {num_shards}), got {index}")
        self.index, self.num_shards, self.dim = int(index), int(num_shards), int(dim)
        self._device = device
        self.home = Path(home) if home is not None else None
        self._wal: WriteAheadLog | None = None
        self._lock_fd: int | None = None
        self._pause_s, self._pause_flag = 0.0, None
        self._failed: BaseException | None = None
        self.bank = MemoryBank(self.dim)
        try:
            if threads is not None:
                import torch

                torch.set_num_threads(int(threads))
            self._backend: Backend = get_backend(backend, device)
            if self.home is not None:
                self._lock_home()
                self._open_home()
        except Exception as exc:
            self.close()  # release the lock: the home is not ours after all
            if not defer_errors:
                raise
            self._failed = exc

    # ------------------------------------------------------------------ home
    def _lock_home(self) -> None:
        assert self.home is not None
        self.home.mkdir(parents=True, exist_ok=True)
        if fcntl is None:  # pragma: no cover - Windows
            return
        fd = os.open(self.home / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StoreError(self.home, "is in use by another process (its LOCK is held); one ShardedMemory per store") from None
        self._lock_fd = fd

    def _open_home(self) -> None:
        """Load the checkpoint store (if any) and replay the log over it."""
        assert self.home is not None
        if self._wal is not None:
            self._wal.close()
            self._wal = None
        store = self.home / STORE_DIR
        bank = MemoryBank.load(store) if (store / CURRENT).is_file() else MemoryBank(self.dim)
        if bank.dim != self.dim:
            raise StoreError(store, f"holds vectors of dimension {bank.dim}, the sharded memory has {self.dim}")
        self._check_users(bank.users, store)
        wal = WriteAheadLog(self.home / WAL_FILE)
        try:
            for rec in wal.records(bank.version):
                self._check_users([rec.user], wal.path)
                try:
                    _apply(bank, rec.op, rec.user, rec.ids, rec.vectors, rec.texts, rec.threads, rec.positions)
                except (KeyError, TypeError, ValueError) as exc:
                    raise StoreError(wal.path, f"record version {rec.version} does not apply ({exc})") from None
                if bank.version != rec.version:
                    raise StoreError(
                        wal.path, f"record version {rec.version} follows bank version {bank.version - 1} (a gap: lost records)"
                    )
        except BaseException:
            wal.close()
            raise
        self.bank, self._wal = bank, wal

    def _usable(self) -> None:
        if self._failed is not None:
            raise self._failed

    def _check_users(self, users: Sequence[Hashable], where: Any) -> None:
        for u in users:
            s = shard_of(u, self.num_shards)
            if s != self.index:
                raise StoreError(
                    where, f"holds user {u!r}, which hashes to shard {s} of {self.num_shards}, not to shard {self.index}"
                )

    # ------------------------------------------------------------------ writes
    def _write(self, op: str, user: Hashable, ids: Any, vectors: Any, texts: Any, threads: Any = None,
               positions: Any = None) -> int:  # fmt: skip
        self._usable()
        # canonical forms first (what the log stores is exactly what the bank applies)
        user = _check_user(user)
        self._check_owner(user)
        ids = _check_id_list(ids)
        if vectors is not None:
            vectors = as_float_matrix(vectors, "vectors", self.dim)
        if texts is not None and not isinstance(texts, (str, bytes)) and hasattr(texts, "__iter__"):
            texts = list(texts)  # a generator is read once, here
        if threads is not None:  # one thread id for every item, or one per item (numpy scalars as int / str)
            threads = check_threads(threads, len(ids))
        if positions is not None:
            positions = check_positions(positions, len(ids))
        _apply(self.bank, op, user, ids, vectors, texts, threads, positions)  # validates; writes nothing on error
        if self._wal is not None:
            rec = WalRecord(self.bank.version, op, user, ids, texts, vectors, threads, positions)
            try:
                self._wal.append(rec)
            except BaseException as exc:
                try:
                    self._open_home()  # drop the unlogged write: memory = durable state again
                except Exception as again:
                    self._failed = RuntimeError(
                        f"shard {self.index} is unusable: the log failed ({exc}) and its home could not be re-opened "
                        f"({again}); restart it"
                    )
                raise
        return self.bank.version

    def _check_owner(self, user: Hashable) -> None:
        s = shard_of(user, self.num_shards)
        if s != self.index:
            raise ValueError(f"user {user!r} belongs to shard {s}, not to shard {self.index}")

    def add(self, user: Hashable, vectors: np.ndarray, ids: list, texts: list | None = None, threads: Any = None,
            positions: Any = None) -> int:  # fmt: skip
        """:meth:`MemoryBank.add`, durable before it returns (module docstring).

        Args:
            user: a key owned by this shard. vectors: float32 [m, d]. ids: m item ids.
            texts: m texts (str / None) or None.
            threads, positions: the items' conversation threads and positions, as
                :meth:`MemoryBank.add` takes them (None: none).

        Returns:
            int: the shard bank's version after the write.

        Raises:
            as :meth:`MemoryBank.add`; ValueError: a user of another shard;
            StoreError: the log commit failed (the write is not kept).
        """
        return self._write("add", user, ids, vectors, texts, threads, positions)

    def delete(self, user: Hashable, ids: list, missing_ok: bool = False) -> int:
        """:meth:`MemoryBank.delete`, durable before it returns. Returns the bank version.

        With ``missing_ok=True`` the ids the user does not hold are dropped first, so the
        log records only the deletes that happened (its replay never needs the flag).
        """
        if not isinstance(missing_ok, (bool, np.bool_)):
            raise TypeError(f"missing_ok must be a bool, got {type(missing_ok).__name__}")
        if missing_ok:
            held = set(self.bank.item_ids_of(user))  # KeyError for an unknown user, as the bank
            ids = [i for i in ids if i in held]
            if not ids:
                return self.bank.version
        return self._write("delete", user, ids, None, None)

    def update(self, user: Hashable, ids: list, vectors: np.ndarray | None, texts: list | None = None,
               threads: Any = None, positions: Any = None) -> int:  # fmt: skip
        """:meth:`MemoryBank.update` (``vectors`` None keeps the rows; ``threads`` /
        ``positions`` None keep the items'), durable before it returns. Returns the bank version."""
        return self._write("update", user, ids, vectors, texts, threads, positions)

    def import_arrays(
        self, vectors: np.ndarray, offsets: np.ndarray, users: list, item_ids: list, texts: list,
        threads: list | None = None, positions: list | None = None,
    ) -> int:
        """Fill an empty shard from a CSR layout (:meth:`MemoryBank.from_arrays`) in one call
        (``threads`` / ``positions``: the rows' conversation threads and positions, or None).

        Durable before it returns when the shard has a home (one checkpoint).

        Returns:
            int: the bank version.

        Raises:
            ValueError: the shard already holds users, or a user of another shard;
            TypeError / ValueError: as :meth:`MemoryBank.from_arrays`.
        """
        self._usable()
        if self.bank.num_users:
            raise ValueError(f"shard {self.index} already holds {self.bank.num_users} users; import needs an empty shard")
        for u in users:
            self._check_owner(u)
        bank = MemoryBank.from_arrays(vectors, offsets, users=users, item_ids=item_ids, texts=texts, threads=threads,
                                      positions=positions)
        self.bank = bank
        if self._wal is not None:
            try:
                self.checkpoint()
            except BaseException:
                self.bank = MemoryBank(self.dim)  # not durable: not acknowledged, not kept
                raise
        return bank.version

    # ------------------------------------------------------------------ persistence
    def checkpoint(self) -> dict:
        """Save the bank into ``home/store`` (atomic) and drop the log records it holds.

        Returns:
            dict: the shard's :meth:`info` after the checkpoint.

        Raises:
            ValueError: the shard has no home. StoreError / OSError: the save failed
                (the previous checkpoint and the log stay intact).
        """
        self._usable()
        if self.home is None or self._wal is None:
            raise ValueError(f"shard {self.index} has no home directory to checkpoint into")
        version = self.bank.snapshot().version
        self.bank.save(self.home / STORE_DIR)
        self._wal.truncate(version)
        return self.info()

    def save_copy(self, path: str) -> dict:
        """Write the bank as a store at ``path`` (``path/store``; no log: a fresh home).

        Returns:
            dict: {"version", "users", "items"} of the copy.

        Raises:
            StoreError / OSError: as :meth:`MemoryBank.save`.
        """
        self._usable()
        snap = self.bank.snapshot()
        self.bank.save(Path(path) / STORE_DIR)
        return {"version": snap.version, "users": snap.num_users, "items": snap.num_items}

    # ------------------------------------------------------------------ reads
    def search(
        self,
        queries: np.ndarray,
        users: list,
        positions: np.ndarray,
        config: RFMemConfig,
        mode: str,
        backend: str | None,
        max_batch: int,
    ) -> tuple[SearchResult, int]:
        """:func:`rfmem_fast.search` over this shard's bank.

        Args:
            queries: float32 [b, d] (this shard's rows of the caller's batch).
            users: b user keys of this shard.
            positions: int64 [b], each query's position in the caller's batch (only
                used to name an unknown user as ``users[position]``).
            config, mode, max_batch: as :func:`rfmem_fast.search`.
            backend: a backend name, or None for the shard's default.

        Returns:
            (SearchResult over the b queries, the shard's live item count). When the
            shard holds no live item, the queries (all of users with 0 items) are
            searched in a scratch bank made of those users plus one item of a sentinel
            user, which gives exactly the engine's empty-user rows.

        Raises:
            KeyError: an unknown user, named by its position in the caller's batch.
            as :func:`rfmem_fast.search` otherwise.
        """
        if self._pause_s:
            pause, self._pause_s = self._pause_s, 0.0
            if self._pause_flag:
                Path(self._pause_flag).touch()
            time.sleep(pause)
        self._usable()
        be = self._backend if backend is None else get_backend(backend, self._device)
        bank = self.bank
        for j, u in enumerate(users):
            if u not in bank:
                raise KeyError(f"users[{int(positions[j])}]: unknown user {u!r}")
        if bank.num_items == 0:
            bank = self._scratch_bank(users)
        return search(bank, queries, users, config=config, mode=mode, backend=be, max_batch=max_batch), self.bank.num_items

    def _scratch_bank(self, users: list) -> MemoryBank:
        uniq = list(dict.fromkeys(users))
        taken = set(uniq)
        sentinel = "\x00rfmem-empty-shard"
        while sentinel in taken:
            sentinel += "\x00"
        vec = np.zeros((1, self.dim), dtype=np.float32)
        vec[0, 0] = 1.0
        offsets = np.zeros(len(uniq) + 2, dtype=np.int64)
        offsets[-1] = 1
        return MemoryBank.from_arrays(vec, offsets, users=uniq + [sentinel])

    def users(self) -> list:
        """The shard's user keys in segment order."""
        self._usable()
        return self.bank.users

    def has_user(self, user: Hashable) -> bool:
        """Whether the shard holds ``user`` (with or without items)."""
        self._usable()
        return user in self.bank

    def user_size(self, user: Hashable) -> int:
        """:meth:`MemoryBank.user_size`."""
        self._usable()
        return self.bank.user_size(user)

    def item_ids_of(self, user: Hashable) -> list:
        """:meth:`MemoryBank.item_ids_of`."""
        self._usable()
        return self.bank.item_ids_of(user)

    def texts_of(self, user: Hashable) -> list:
        """:meth:`MemoryBank.texts_of`."""
        self._usable()
        return self.bank.texts_of(user)

    def info(self) -> dict:
        """The shard's state: index, pid, host, users, items, bank version, backend, home, log length."""
        self._usable()
        return {
            "shard": self.index,
            "pid": os.getpid(),
            "host": platform.node(),
            "users": self.bank.num_users,
            "items": self.bank.num_items,
            "version": self.bank.version,
            "backend": self._backend.name,
            "home": None if self.home is None else str(self.home),
            "wal_records": None if self._wal is None else len(self._wal),
        }

    def close(self) -> None:
        """Close the log and release the home's lock (the in-memory bank stays readable). Idempotent."""
        if self._wal is not None:
            self._wal.close()
            self._wal = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    # ------------------------------------------------------------------ testing hook
    def _pause_next_search(self, seconds: float, flag_path: str | None = None) -> None:
        """Testing hook: the next :meth:`search` sleeps ``seconds`` first, after creating
        the file ``flag_path`` (if given), so a test can kill this process while a batch
        is in flight."""
        self._pause_s = float(seconds)
        self._pause_flag = flag_path
