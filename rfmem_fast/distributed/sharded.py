"""ShardedMemory: users sharded over Ray actors, each owning a MemoryBank (the driver side).

The driver hashes each user to a shard (:mod:`rfmem_fast.distributed.sharding`), sends
writes to the owning shard's actor (:class:`~rfmem_fast.distributed.shard.ShardServer`)
and splits a search batch by shard: every shard searches its part in parallel with
:func:`rfmem_fast.search`, the driver gathers the parts back into the caller's order
(:func:`rfmem_fast.distributed.gather.gather_results`). Since RF-Mem's work is per user
(a query only ever sees its own user's items; every score, route and recollection
round depends on that user's items alone), the gathered result equals the
single-process ``search`` over one bank holding all users, field for field, except
``rows`` (shard-local rows; see the gather module).

Ray is an optional dependency (``pip install "rfmem_fast[ray]"``), imported when a
ShardedMemory is created. Nothing here opens a socket: all traffic is Ray's.

Faults: a shard whose actor died, or that cannot be reached, makes the call raise
:class:`ShardUnavailableError` naming the shard; a call never returns a partial result.
A shard with a durable home (``path=...``) logs every write before acknowledging it
(see :mod:`rfmem_fast.distributed.shard`), so a restarted actor (automatically by Ray,
``max_restarts``, or by :meth:`ShardedMemory.restart_shard`) holds every acknowledged
write.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Hashable, Sequence

import numpy as np

from .._validate import as_float_matrix, l2_normalize_rows
from ..bank import NO_POSITION, MemoryBank
from ..config import RFMemConfig
from ..search import DEFAULT_MAX_BATCH, SearchResult, check_search_args
from ..store import StoreError
from .gather import gather_results
from .manifest import make_manifest, read_manifest, shard_dir_name, write_manifest
from .shard import ShardServer
from .._optional import require
from .sharding import _check_num_shards, canonical_key, shard_of, shards_of

def _ray() -> Any:
    """Import Ray, or raise an ImportError that names the extra to install (``[ray]``)."""
    return require("ray", "ray", "rfmem_fast.distributed.ShardedMemory")


class ShardError(RuntimeError):
    """A shard failed a call in a way that is not the caller's input error.

    Attributes:
        shard: the shard's index (int), also in the message.
    """

    def __init__(self, shard: int, message: str) -> None:
        self.shard = int(shard)
        super().__init__(message)

    def __reduce__(self):  # picklable despite the two-argument constructor
        return (type(self), (self.shard, self.args[0]))


class ShardUnavailableError(ShardError):
    """A shard's actor died (killed, crashed, its node lost) or cannot be reached.

    The call that hit it returned nothing (no partial result). A shard with a durable
    home is brought back by Ray (``max_restarts``) or :meth:`ShardedMemory.restart_shard`.
    """


class ShardTimeoutError(ShardError, TimeoutError):
    """A shard did not answer within the call's ``timeout_s``."""


class ShardedMemoryClosedError(RuntimeError):
    """A call on a :class:`ShardedMemory` after :meth:`ShardedMemory.close`."""


class _ClosedActors:
    """Stands in for the actor list after close: any use raises ShardedMemoryClosedError,
    so every method fails the same clear way (not with an AttributeError on None)."""

    def _closed(self, *_: Any) -> Any:
        raise ShardedMemoryClosedError("this ShardedMemory is closed (its shard actors were stopped); "
                                       "open it again with ShardedMemory.load(path) or create a new one")

    __getitem__ = __setitem__ = __iter__ = __len__ = _closed


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


class ShardedMemory:
    """A MemoryBank whose users are spread over ``num_shards`` Ray actors.

    The calls mirror :class:`~rfmem_fast.MemoryBank` (``add`` / ``delete`` / ``update``
    / ``save`` / ``load``, ``users``, ``num_items``, ...) and :func:`~rfmem_fast.search`.
    User ``u`` lives on shard :func:`~rfmem_fast.distributed.sharding.shard_of` ``(u,
    num_shards)`` (blake2b + jump consistent hash, stable across processes and
    machines); its items never span shards.

    Args:
        num_shards: number of shards N (int >= 1); one Ray actor each.
        dim: vector dimension d (int >= 1).
        path: durable home of the sharded store (a directory that does not exist or is
            empty; on a filesystem every Ray node that may run a shard can reach): each
            shard keeps a checkpoint store and a write-ahead log under it, and every write
            is logged (fsync) before it is acknowledged. None: shards live in memory
            only (faster writes; nothing survives an actor's death).
        address: Ray cluster to connect to when Ray is not initialised yet in this
            process ("auto": the cluster started by ``ray start`` on this machine;
            "ray://host:10001": Ray Client; None: a local cluster started here).
            Ignored when ``ray.init`` was already called.
        backend: each shard's default backend name ("auto" resolves inside the shard:
            triton / torch on a GPU actor, native on a CPU one).
        device: torch device for device-capable backends (default: the backend's).
        num_cpus: CPUs reserved for each shard actor (float >= 0; Ray sets the actor's
            OMP_NUM_THREADS from it).
        num_gpus: GPUs per shard actor; None: 1 when the cluster has GPUs, else 0.
        threads_per_shard: torch intra-op threads inside each actor (None: Ray's default).
        max_restarts: how often Ray restarts a crashed shard actor (re-opening its home);
            None: 3 with a ``path``, 0 without (a restarted in-memory shard would come
            back empty, so it stays dead and calls raise).
        ready_timeout_s: seconds to wait for the actors to start (float > 0).
        ray_init: extra keyword arguments for ``ray.init`` when this call starts Ray.

    Raises:
        ImportError: Ray is not installed (the message names the ``[ray]`` extra).
        ValueError: bad ``num_shards`` / ``dim`` / resources / timeout, an unknown
            backend, or shards the cluster can never hold (``num_shards x num_cpus`` /
            ``num_gpus`` over ``ray.cluster_resources()``: raised at once, with the
            numbers, instead of waiting ``ready_timeout_s``).
        StoreError: ``path`` is not empty, or a shard cannot open its home.
        ShardTimeoutError: an actor did not start in time (not enough free CPUs / GPUs
            in the cluster for N actors of ``num_cpus`` / ``num_gpus``).

    Example::

        from rfmem_fast.distributed import ShardedMemory
        mem = ShardedMemory(num_shards=4, dim=384, path="memstore")
        mem.add("alice", vectors, ids=["m1", "m2"])
        res = mem.search(queries, users=["alice", "bob"], mode="rfmem")
    """

    def __init__(
        self,
        num_shards: int,
        dim: int,
        *,
        path: str | Path | None = None,
        address: str | None = None,
        backend: str = "auto",
        device: str | None = None,
        num_cpus: float = 1,
        num_gpus: float | None = None,
        threads_per_shard: int | None = None,
        max_restarts: int | None = None,
        ready_timeout_s: float = 300.0,
        ray_init: dict | None = None,
    ) -> None:
        num_shards = _check_num_shards(num_shards)
        if not _is_int(dim) or dim < 1:
            raise ValueError(f"dim must be an int >= 1, got {dim!r}")
        _ray()  # before touching the filesystem: no Ray, nothing created
        root = None
        if path is not None:
            root = Path(path).absolute()  # actors run in other working directories (and nodes)
            if root.exists() and (not root.is_dir() or any(root.iterdir())):
                raise StoreError(root, "exists and is not an empty directory; use ShardedMemory.load to open a sharded store")
            root.mkdir(parents=True, exist_ok=True)
        try:
            self._start(
                num_shards, int(dim), root, address, backend, device, num_cpus, num_gpus,
                threads_per_shard, max_restarts, ready_timeout_s, ray_init,
            )  # fmt: skip
        except BaseException:
            if root is not None:  # leave the directory as empty as it was
                for i in range(num_shards):
                    shutil.rmtree(root / shard_dir_name(i), ignore_errors=True)
            raise
        if root is not None:
            write_manifest(root, make_manifest(num_shards, int(dim)))  # last: a store without it is never opened

    # ------------------------------------------------------------------ construction
    def _start(
        self, num_shards, dim, path, address, backend, device, num_cpus, num_gpus,
        threads_per_shard, max_restarts, ready_timeout_s, ray_init,
    ) -> None:  # fmt: skip
        ray = _ray()
        if not isinstance(num_cpus, (int, float)) or isinstance(num_cpus, bool) or num_cpus < 0:
            raise ValueError(f"num_cpus must be a number >= 0, got {num_cpus!r}")
        if num_gpus is not None and (not isinstance(num_gpus, (int, float)) or isinstance(num_gpus, bool) or num_gpus < 0):
            raise ValueError(f"num_gpus must be None or a number >= 0, got {num_gpus!r}")
        if threads_per_shard is not None and (not _is_int(threads_per_shard) or threads_per_shard < 1):
            raise ValueError(f"threads_per_shard must be None or an int >= 1, got {threads_per_shard!r}")
        if max_restarts is not None and (not _is_int(max_restarts) or max_restarts < -1):
            raise ValueError(f"max_restarts must be None, -1 (forever) or an int >= 0, got {max_restarts!r}")
        if not isinstance(ready_timeout_s, (int, float)) or not ready_timeout_s > 0:
            raise ValueError(f"ready_timeout_s must be a number > 0, got {ready_timeout_s!r}")
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a backend name (str), got {type(backend).__name__}")
        if not ray.is_initialized():
            ray.init(address=address, **(ray_init or {}))
        total = ray.cluster_resources()
        if num_gpus is None:
            num_gpus = 1 if total.get("GPU", 0) >= 1 else 0
        for name, per in (("CPU", num_cpus), ("GPU", num_gpus)):
            need = per * num_shards
            if need > total.get(name, 0) + 1e-9:  # can never be met: fail now, not after ready_timeout_s
                raise ValueError(
                    f"the Ray cluster can never hold {num_shards} shard actors of num_{name.lower()}s={per}: they need "
                    f"{need:g} {name} in all and the whole cluster has {total.get(name, 0):g} "
                    f"(ray.cluster_resources() = {total}); lower num_shards or num_{name.lower()}s, "
                    "or add nodes to the cluster"
                )
        self._num_shards, self._dim = num_shards, dim
        self._root = Path(path) if path is not None else None
        self._args = dict(backend=backend, device=device, threads=threads_per_shard, defer_errors=True)
        self._options = dict(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            max_restarts=(3 if path is not None else 0) if max_restarts is None else int(max_restarts),
            max_task_retries=0,  # a call in flight when a shard dies fails; it is never re-run silently
        )
        self._ready_timeout_s = float(ready_timeout_s)
        self._remote = ray.remote(ShardServer)
        self._actors: list[Any] = [None] * num_shards
        try:
            for i in range(num_shards):
                self._actors[i] = self._spawn(i)
            self._call_all({i: a.info.remote() for i, a in enumerate(self._actors)}, self._ready_timeout_s, "start")
        except BaseException:
            self.close()
            raise

    def _spawn(self, i: int) -> Any:
        home = None if self._root is None else str(self._root / shard_dir_name(i))
        return self._remote.options(**self._options).remote(i, self._num_shards, self._dim, home, **self._args)

    @classmethod
    def load(cls, path: str | Path, **kwargs: Any) -> "ShardedMemory":
        """Open the sharded store at ``path`` (its manifest, and each shard's store + log).

        ``path`` becomes the memory's durable home: later writes are logged there.

        Args:
            path: a directory written by :meth:`save` (or the ``path`` of a
                ShardedMemory): manifest ``rfmem_sharded.json`` plus ``shard-XXXX/``.
            **kwargs: the keyword arguments of :class:`ShardedMemory` but ``path``
                (``address``, ``backend``, ``num_cpus``, ...).

        Returns:
            ShardedMemory with the saved shard map, users, items and versions.

        Raises:
            StoreError: missing / invalid manifest, another hash scheme or format
                version, a corrupt shard store or log (named), a shard holding a user
                that does not hash to it, or a store in use by another ShardedMemory.
            ImportError, ShardTimeoutError: as the constructor.
        """
        opts = dict(
            address=None, backend="auto", device=None, num_cpus=1, num_gpus=None, threads_per_shard=None,
            max_restarts=None, ready_timeout_s=300.0, ray_init=None,
        )  # fmt: skip
        unknown = sorted(set(kwargs) - set(opts))
        if unknown:
            raise TypeError(f"load() got unexpected keyword arguments {unknown} (the store is its first argument)")
        opts.update(kwargs)
        man = read_manifest(path)
        self = cls.__new__(cls)
        self._start(man["num_shards"], man["dim"], Path(path).absolute(), *opts.values())
        return self

    @classmethod
    def from_bank(cls, bank: MemoryBank, num_shards: int, **kwargs: Any) -> "ShardedMemory":
        """Spread an existing single-process bank over ``num_shards`` new shards.

        Each shard receives its users' CSR rows in one call
        (:meth:`MemoryBank.from_arrays` inside the actor; a durable shard checkpoints
        them before acknowledging). Users, item ids, texts, vectors and the items'
        threads and positions are kept exactly (users with 0 items included).

        Args:
            bank: the MemoryBank to copy (its current snapshot).
            num_shards: int >= 1.
            **kwargs: the keyword arguments of :class:`ShardedMemory`.

        Returns:
            ShardedMemory.

        Raises:
            TypeError: ``bank`` is not a MemoryBank. As the constructor otherwise.
        """
        if not isinstance(bank, MemoryBank):
            raise TypeError(f"bank must be a MemoryBank, got {type(bank).__name__}")
        snap = bank.snapshot()
        mem = cls(num_shards, bank.dim, **kwargs)
        try:
            users = list(snap.users)
            _, owner = shards_of(users, mem.num_shards)
            off = snap.offsets
            calls = {}
            for s in range(mem.num_shards):
                us = np.flatnonzero(owner == s)
                if us.size == 0:
                    continue
                rows = np.concatenate([np.arange(off[u], off[u + 1]) for u in us])
                lens = (off[us + 1] - off[us]).astype(np.int64)
                offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
                texts = None if snap.texts is None else list(snap.texts[rows])
                threads = None if snap.threads is None else snap.threads[rows].tolist()
                positions = (None if snap.positions is None
                             else [None if p == NO_POSITION else p for p in snap.positions[rows].tolist()])
                calls[s] = mem._actors[s].import_arrays.remote(
                    snap.vectors[rows], offsets, [users[u] for u in us], list(snap.item_ids[rows]), texts, threads,
                    positions,
                )
            mem._call_all(calls, None, "import")
        except BaseException:
            mem.close()
            raise
        return mem

    # ------------------------------------------------------------------ calls
    def _call_all(self, calls: dict[int, Any], timeout_s: float | None, what: str) -> dict[int, Any]:
        """Wait for one call per shard; raise on the first failure (no partial result).

        Raises:
            ShardUnavailableError / ShardTimeoutError / ShardError naming the shard; a
            caller error raised inside a shard (TypeError, ValueError, KeyError and
            their subclasses) is re-raised with the same type.
        """
        ray = _ray()
        pending = {ref: s for s, ref in calls.items()}
        out: dict[int, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + float(timeout_s)
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not ready:
                late = sorted(pending.values())
                raise ShardTimeoutError(
                    late[0],
                    f"{what}: shard(s) {late} did not answer within {timeout_s} s"
                    + (self._resource_hint() if what == "start" else ""),
                )
            for ref in ready:
                s = pending.pop(ref)
                try:
                    out[s] = ray.get(ref)
                except ray.exceptions.ActorUnavailableError as exc:
                    raise ShardUnavailableError(
                        s, f"{what}: shard {s} is unavailable (restarting or unreachable; wait_ready() waits for it): {_first_line(exc)}"
                    ) from None
                except ray.exceptions.RayActorError as exc:
                    hint = "; restart_shard() re-opens it from its store" if self._root is not None else ""
                    raise ShardUnavailableError(s, f"{what}: shard {s} is unavailable (its actor died{hint}): {_first_line(exc)}") from None
                except ray.exceptions.RayTaskError as exc:
                    raise _shard_exception(s, what, exc) from None
                except ray.exceptions.RayError as exc:
                    raise ShardError(s, f"{what}: shard {s} failed: {type(exc).__name__}: {_first_line(exc)}") from None
        return out

    def _resource_hint(self) -> str:
        ray = _ray()
        o = self._options
        return (
            f"; each of the {self._num_shards} shard actors needs num_cpus={o['num_cpus']}, num_gpus={o['num_gpus']}"
            f" (cluster resources now available: {ray.available_resources()})"
        )

    def _call(self, shard: int, method: str, *args: Any) -> Any:
        return self._call_all({shard: getattr(self._actors[shard], method).remote(*args)}, None, method)[shard]

    def _owner(self, user: Any) -> tuple[Hashable, int]:
        key = canonical_key(user)
        return key, shard_of(key, self._num_shards)

    # ------------------------------------------------------------------ properties
    @property
    def num_shards(self) -> int:
        """Number of shards N."""
        return self._num_shards

    @property
    def dim(self) -> int:
        """Vector dimension d."""
        return self._dim

    @property
    def path(self) -> Path | None:
        """The durable home directory (None for an in-memory sharded memory)."""
        return self._root

    def shard_of(self, user: Any) -> int:
        """The shard that owns ``user`` (:func:`rfmem_fast.distributed.sharding.shard_of`).

        Raises:
            TypeError: a key that is not a str / int.
        """
        return self._owner(user)[1]

    # ------------------------------------------------------------------ writes
    def add(self, user: Hashable, vectors: Any, ids: Sequence[Hashable], texts: Sequence[str | None] | None = None,
            threads: Any = None, positions: Any = None) -> None:  # fmt: skip
        """Append items to a user's memory on its shard (:meth:`MemoryBank.add`).

        Args:
            user: str or int key. vectors: [m, d] floating array (m >= 1). ids: m item
            ids unique within the user. texts: m optional texts.
            threads, positions: the items' conversation threads (one str / int for
                every item, or m of them / None) and positions (m ints >= 0 / None), as
                :meth:`MemoryBank.add` takes them; logged with the write. A search with
                ``config.context_weight`` / ``thread_weight`` > 0 ranks each shard's
                users by the context score (a user's threads live on its shard).

        Returns when the write is applied on the shard and, with a ``path``, durable.

        Raises:
            TypeError / ValueError: as :meth:`MemoryBank.add` (nothing written).
            ShardUnavailableError: the shard is down (the write was not acknowledged).
        """
        key, s = self._owner(user)
        self._call(s, "add", key, as_float_matrix(vectors, "vectors", self._dim), ids, texts, threads, positions)

    def delete(self, user: Hashable, ids: Sequence[Hashable], missing_ok: bool = False) -> None:
        """Delete items of a user (:meth:`MemoryBank.delete`); durable as :meth:`add`.

        Args:
            user: the user key. ids: item ids to delete.
            missing_ok: False (default): an id the user does not hold is a KeyError and
                nothing is deleted; True: such ids are skipped.

        Raises:
            KeyError: unknown user, or (``missing_ok=False``) an id the user does not hold.
            TypeError / ValueError: bad ids or ``missing_ok``.
            ShardUnavailableError: the shard is down.
        """
        key, s = self._owner(user)
        self._call(s, "delete", key, ids, missing_ok)

    def update(
        self, user: Hashable, ids: Sequence[Hashable], vectors: Any, texts: Sequence[str | None] | None = None,
        threads: Any = None, positions: Any = None,
    ) -> None:
        """Replace items' vectors (and texts, threads, positions) keeping their ids
        (:meth:`MemoryBank.update`: ``vectors`` None keeps the rows, ``texts`` /
        ``threads`` / ``positions`` None keep the items').

        Raises:
            KeyError / TypeError / ValueError: as :meth:`MemoryBank.update`.
            ShardUnavailableError: the shard is down.
        """
        key, s = self._owner(user)
        vec = None if vectors is None else as_float_matrix(vectors, "vectors", self._dim)
        self._call(s, "update", key, ids, vec, texts, threads, positions)

    # ------------------------------------------------------------------ search
    def search(
        self,
        queries: Any,
        users: Sequence[Hashable],
        config: RFMemConfig | None = None,
        mode: str = "rfmem",
        backend: str | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        timeout_s: float | None = None,
    ) -> SearchResult:
        """RF-Mem retrieval for a batch whose users live on many shards.

        The batch is split by shard, each part searched by its shard with
        :func:`rfmem_fast.search` (all shards in parallel), and the parts gathered back
        into the caller's order: the result equals the single-process ``search`` over one
        bank holding every user, except ``rows``, which are shard-local rows (-1 padding;
        see :mod:`rfmem_fast.distributed.gather`).

        Args:
            queries: [b, d] floating array (float16/32/64, numpy or torch); sent to the
                shards as float32 and L2-normalised there, as ``search`` does.
            users: b user keys.
            config: RFMemConfig (default: the spec's defaults); with the context score
                on (``context_weight`` / ``thread_weight`` > 0) each shard ranks its
                users' items by it (a user's threads live on its shard), and the
                gathered ``context_scores`` equal the single-process ones.
            mode: "rfmem", "dense" or "recollection".
            backend: a backend name for this call, or None for each shard's default.
            max_batch: queries per internal chunk inside each shard (int >= 1).
            timeout_s: give up after this many seconds (None: wait).

        Returns:
            SearchResult over the b queries, in the caller's order.

        Raises:
            ValueError: unknown mode, bad queries (shape, dimension, NaN / Inf, zero
                row), ``users`` not of length b, ``max_batch`` < 1, or every shard empty.
            TypeError: non-floating queries, a config that is not an RFMemConfig, a
                user key that is not a str / int (named ``users[i]``).
            KeyError: an unknown user, named ``users[i]`` with its caller position.
            ShardUnavailableError: a shard holding some of the batch's users is down
                (the message names it; no partial result is returned).
            ShardTimeoutError: ``timeout_s`` passed.
        """
        config, max_batch = check_search_args(mode, config, max_batch)
        if backend is not None and not isinstance(backend, str):
            raise TypeError(f"backend must be None or a backend name (str), got {type(backend).__name__}")
        q = as_float_matrix(queries, "queries", self._dim)
        l2_normalize_rows(q, "queries")  # zero rows are refused here, named by their caller position
        keys, owner = shards_of(users, self._num_shards)
        b = q.shape[0]
        if len(keys) != b:
            raise ValueError(f"users has {len(keys)} entries but queries has {b} rows")
        groups = {int(s): np.flatnonzero(owner == s) for s in np.unique(owner)} if b else {0: np.zeros(0, np.int64)}
        calls = {
            s: self._actors[s].search.remote(q[idx], [keys[i] for i in idx], idx, config, mode, backend, max_batch)
            for s, idx in groups.items()
        }
        out = self._call_all(calls, timeout_s, "search")
        if b and sum(n for _, n in out.values()) == 0 and self.num_items == 0:
            raise ValueError("bank is empty: add items before searching")
        return gather_results(b, [(groups[s], res) for s, (res, _) in sorted(out.items())])

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path | None = None) -> Path:
        """Persist every shard (one store directory per shard plus the manifest).

        Args:
            path: None or the memory's own home: a checkpoint (each shard saves its bank
                into ``shard-XXXX/store`` atomically and drops the log records it now
                holds). Another directory (that does not exist or is empty): a complete
                copy (``shard-XXXX/store`` per shard, then the manifest, written last),
                which :meth:`load` opens; the memory's home stays where it was.

        Returns:
            Path of the store directory.

        Raises:
            ValueError: ``path`` None for an in-memory ShardedMemory.
            StoreError: ``path`` is not empty (and not this memory's home).
            ShardUnavailableError / OSError: a shard could not save (a copy without its
                manifest is never opened by :meth:`load`).
        """
        home = self._root
        if path is None and home is None:
            raise ValueError("path is required: this ShardedMemory has no home directory (created with path=None)")
        target = Path(path).absolute() if path is not None else home
        assert target is not None
        if home is not None and target.resolve() == home.resolve():
            infos = self._call_all({i: a.checkpoint.remote() for i, a in enumerate(self._actors)}, None, "checkpoint")
            stats = [{k: infos[i][k] for k in ("users", "items", "version")} for i in range(self._num_shards)]
        else:
            if target.exists() and (not target.is_dir() or any(target.iterdir())):
                raise StoreError(target, "exists and is not an empty directory; save a copy into a new directory")
            stats_by = self._call_all(
                {i: a.save_copy.remote(str(target / shard_dir_name(i))) for i, a in enumerate(self._actors)}, None, "save"
            )
            stats = [stats_by[i] for i in range(self._num_shards)]
        write_manifest(target, make_manifest(self._num_shards, self._dim, stats))
        return target

    # ------------------------------------------------------------------ reads
    def _all(self, method: str, *args: Any) -> list:
        out = self._call_all({i: getattr(a, method).remote(*args) for i, a in enumerate(self._actors)}, None, method)
        return [out[i] for i in range(self._num_shards)]

    def stats(self) -> list[dict]:
        """Per shard: index, pid, host, users, items, bank version, backend, home, log records.

        Raises:
            ShardUnavailableError: a shard is down.
        """
        return self._all("info")

    @property
    def users(self) -> list[Hashable]:
        """Every user key, shard by shard (each shard's in segment order)."""
        return [u for part in self._all("users") for u in part]

    @property
    def num_users(self) -> int:
        """Number of users over all shards (users with 0 items included)."""
        return sum(s["users"] for s in self.stats())

    @property
    def num_items(self) -> int:
        """Number of live items over all shards."""
        return sum(s["items"] for s in self.stats())

    def __len__(self) -> int:
        return self.num_items

    def __contains__(self, user: object) -> bool:
        try:
            key, s = self._owner(user)
        except TypeError:
            return False
        return bool(self._call(s, "has_user", key))

    def _per_user(self, method: str, user: Any) -> Any:
        key, s = self._owner(user)
        return self._call(s, method, key)

    def user_size(self, user: Hashable) -> int:
        """Live items of ``user`` (:meth:`MemoryBank.user_size`). KeyError: unknown user."""
        return self._per_user("user_size", user)

    def item_ids_of(self, user: Hashable) -> list[Hashable]:
        """Ids of ``user``'s live items in row order. KeyError: unknown user."""
        return self._per_user("item_ids_of", user)

    def texts_of(self, user: Hashable) -> list[str | None]:
        """Texts of ``user``'s live items in row order. KeyError: unknown user."""
        return self._per_user("texts_of", user)

    # ------------------------------------------------------------------ lifecycle
    def restart_shard(self, shard: int) -> dict:
        """Replace shard ``shard``'s actor by a new one that re-opens its home.

        The old actor is killed first if it still runs. The new one loads the shard's
        checkpoint store and replays its write-ahead log: every acknowledged write is
        back.

        Args:
            shard: index in [0, num_shards).

        Returns:
            dict: the new actor's :meth:`stats` entry.

        Raises:
            ValueError: bad index, or no home (an in-memory shard cannot be restored).
            StoreError / ShardError: the home cannot be opened.
        """
        if isinstance(self._actors, _ClosedActors):
            self._actors._closed()
        if not _is_int(shard) or not 0 <= shard < self._num_shards:
            raise ValueError(f"shard must be an int in [0, {self._num_shards}), got {shard!r}")
        if self._root is None:
            raise ValueError(f"shard {shard} has no home directory to restart from (ShardedMemory(path=None))")
        ray = _ray()
        old = self._actors[shard]
        ray.kill(old, no_restart=True)
        # ray.kill is asynchronous: the old process may still hold the home's lock
        _wait_until_dead(ray, old, self._ready_timeout_s, shard)
        self._actors[shard] = self._spawn(int(shard))
        return self._call_all({shard: self._actors[shard].info.remote()}, self._ready_timeout_s, "start")[shard]

    def wait_ready(self, timeout_s: float | None = None) -> list[dict]:
        """Wait until every shard answers (e.g. after Ray restarted a crashed actor).

        Args:
            timeout_s: give up after this many seconds (None: the constructor's
                ``ready_timeout_s``).

        Returns:
            :meth:`stats` of every shard.

        Raises:
            ShardUnavailableError: a shard died for good (no Ray restart left; see
                :meth:`restart_shard`). ShardTimeoutError: still restarting at the deadline.
        """
        timeout = self._ready_timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.stats()
            except ShardUnavailableError as exc:
                if "restarting or unreachable" not in str(exc):
                    raise
                if time.monotonic() >= deadline:
                    raise ShardTimeoutError(exc.shard, f"shard {exc.shard} did not come back within {timeout} s: {exc}") from None
                time.sleep(0.1)

    def _actor(self, shard: int) -> Any:
        """The Ray actor handle of a shard (for tests and operators)."""
        return self._actors[shard]

    def close(self) -> None:
        """Stop every shard actor (their homes stay on disk). Idempotent; afterwards
        every call raises :class:`ShardedMemoryClosedError`."""
        actors = getattr(self, "_actors", [])
        if isinstance(actors, _ClosedActors):
            return
        ray = _ray()
        for a in actors:
            if a is not None:
                try:
                    ray.kill(a, no_restart=True)
                except Exception:  # pragma: no cover - already gone
                    pass
        self._actors = _ClosedActors()  # type: ignore[assignment]

    def __enter__(self) -> "ShardedMemory":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _wait_until_dead(ray: Any, actor: Any, timeout_s: float, shard: int) -> None:
    """Block until calls on a killed actor fail (its process is gone, its store unlocked).

    Raises:
        ShardTimeoutError: the actor still answers after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + float(timeout_s)
    while time.monotonic() < deadline:
        try:
            ray.get(actor.info.remote(), timeout=max(0.1, min(10.0, deadline - time.monotonic())))
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
            pass  # going down or busy: ask again
        except ray.exceptions.RayActorError:
            return  # dead for good
        time.sleep(0.05)
    raise ShardTimeoutError(shard, f"restart_shard: the old actor of shard {shard} still ran {timeout_s} s after it was killed")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _shard_exception(shard: int, what: str, exc: Any) -> BaseException:
    """The exception to raise for an error raised inside a shard's call."""
    cause = getattr(exc, "cause", None)
    if type(cause) in (ValueError, TypeError, KeyError, IndexError):
        msg = cause.args[0] if cause.args else ""
        return type(cause)(f"shard {shard}: {msg}")
    if isinstance(cause, (ValueError, TypeError, KeyError)):  # e.g. StoreError: its own message names the file
        return cause
    name = type(cause).__name__ if cause is not None else type(exc).__name__
    return ShardError(shard, f"{what}: shard {shard} failed: {name}: {_first_line(cause or exc)}")
