"""The durable side of a :class:`~rfmem_fast.serving.memory.Memory` (the glue between it
and :mod:`rfmem_fast.serving.wal`): opening a memory directory (``memory.json``, the
``LOCK`` flock, the last checkpoint's bank store, the log replayed), logging then applying
each write (one record, or a bulk write as ONE group record, all or nothing), and
checkpoints. ``_Durable`` is a mixin of Memory; the directory layout is in
:mod:`rfmem_fast.serving.memory`.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from ..bank import INSTANT_RANGE, MemoryBank, instants_known
from ..lexical import CHUNK_SEP
from ..store import StoreError, _fsync_dir
from .batcher import BatcherClosedError
from .encoding import DEFAULT_DIM
from .wal import WriteAheadLog, decode_array, encode_array

log = logging.getLogger("rfmem_fast.serving")


META_FILE = "memory.json"
WAL_FILE = "wal.jsonl"
LOCK_FILE = "LOCK"
FORMAT_NAME = "rfmem_fast.memory"
FORMAT_VERSION = 1
_STORE_PREFIX = "store-"


class MemoryLockedError(RuntimeError):
    """A Memory directory already open in another process or Memory (its lock file is
    held): one open Memory per directory."""



def default_stemmer() -> str | None:
    """The lexical stemmer of a new Memory's bank: "english" (PyStemmer's Snowball English,
    what ``RFMemConfig.recommended()`` was tuned with) when PyStemmer is installed (the
    ``text`` / ``serve`` / ``mcp`` / ``lexical`` extras bring it), else None (no stemming).
    A bank keeps its stemmer in its store, so a reopened Memory scores as it did."""
    try:
        import Stemmer  # noqa: F401  (PyStemmer)
    except ImportError:
        return None
    return "english"


def _logged_times(created_at: list | None) -> list | None:
    """A logged add record's ``created_at`` as the bank takes it: a value outside
    :data:`rfmem_fast.bank.INSTANT_RANGE` (logged before the range was checked) is an
    unknown time, NaN, so that the acknowledged write still replays."""
    if created_at is None:
        return None
    out = [v if v is None or instants_known(v) else math.nan for v in created_at]
    odd = sum(1 for v, w in zip(created_at, out) if v is not w)
    if odd:
        log.warning("a logged add holds %d creation times outside %s (e.g. %r): replayed as unknown (NaN)",
                    odd, INSTANT_RANGE, next(v for v, w in zip(created_at, out) if v is not w))
    return out


class _Durable:
    """Opening, logging, applying and checkpointing (a mixin of
    :class:`~rfmem_fast.serving.memory.Memory`: the methods read its bank, log, locks and
    counters)."""

    # ------------------------------------------------------------------ opening
    @staticmethod
    def _resolve_dim(dim: int | None, enc_dim: Any, stored: int | None) -> int:
        """The memory's dimension from the stored memory, ``dim`` and the encoder's."""
        for name, val in (("dim", dim), ("encoder.dim", enc_dim)):
            if val is not None and stored is not None and int(val) != stored:
                raise ValueError(f"{name}={val} does not match the stored memory's dimension {stored}")
        if dim is not None and enc_dim is not None and int(enc_dim) != dim:
            raise ValueError(f"dim={dim} does not match encoder.dim={enc_dim}")
        if stored is not None:
            return stored
        return int(dim if dim is not None else enc_dim if enc_dim is not None else DEFAULT_DIM)

    def _open(self, path: Path, dim: int | None, enc_dim: Any, fsync: bool) -> None:
        if path.exists() and not path.is_dir():
            raise ValueError(f"path {str(path)!r} is a file, expected a Memory directory")
        meta_path = path / META_FILE
        self._path = path
        if meta_path.is_file():
            self._take_lock(path)
            meta = self._read_meta(meta_path)
            stored_dim = meta["dim"]
            self._dim_defaulted = False  # the stored memory's dimension
            self._resolve_dim(dim, enc_dim, stored_dim)
            store = meta["store"]
            self.bank = MemoryBank.load(path / store) if store else MemoryBank(stored_dim, lexical_stemmer=default_stemmer())
            if self.bank.dim != stored_dim:
                raise StoreError(path / store, f"holds dimension {self.bank.dim}, {META_FILE} says {stored_dim}")
            self._store_gen = int(store[len(_STORE_PREFIX):]) if store else 0
            self._seq = meta["wal_seq"]
        else:
            if path.is_dir() and any(p.name != LOCK_FILE for p in path.iterdir()):
                raise ValueError(
                    f"path {str(path)!r} is a non-empty directory without {META_FILE} (not a Memory); "
                    "use an empty or new directory"
                )
            path.mkdir(parents=True, exist_ok=True)
            self._take_lock(path)
            self.bank = MemoryBank(self._resolve_dim(dim, enc_dim, None), lexical_stemmer=default_stemmer())
            self._write_meta(None)
            store = None
        for entry in path.iterdir():  # leftovers of an interrupted checkpoint
            if entry.name.startswith(_STORE_PREFIX) and entry.name != store and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            elif entry.name.startswith(f".{META_FILE}.tmp-"):
                entry.unlink(missing_ok=True)
        self._index_chunks()
        self._wal = WriteAheadLog(path / WAL_FILE, fsync=fsync)
        self._replay(self._seq)

    def _take_lock(self, path: Path) -> None:
        """Hold ``path/LOCK`` (an exclusive flock) while open: a second process (or a
        second Memory in this one) on the same directory would interleave log appends.

        Raises:
            MemoryLockedError (a RuntimeError): the directory is open elsewhere.
        """
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not on POSIX: no cross-process guard
            return
        f = open(path / LOCK_FILE, "a+b")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            raise MemoryLockedError(
                f"the memory at {str(path)!r} is open in another process or Memory (its {LOCK_FILE} is held); "
                "close that one first"
            ) from None
        self._lock_file = f

    def _read_meta(self, meta_path: Path) -> dict[str, Any]:
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise StoreError(meta_path, f"cannot be read: {exc}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
            raise StoreError(meta_path, f"is not an {FORMAT_NAME} file")
        if meta.get("format_version") != FORMAT_VERSION:
            raise StoreError(meta_path, f"format_version {meta.get('format_version')!r} is not {FORMAT_VERSION}")
        d, store, seq = meta.get("dim"), meta.get("store"), meta.get("wal_seq")
        if not isinstance(d, int) or isinstance(d, bool) or d < 1:
            raise StoreError(meta_path, f"dim must be an int >= 1, got {d!r}")
        if store is not None and (not isinstance(store, str) or not store.startswith(_STORE_PREFIX) or "/" in store):
            raise StoreError(meta_path, f"invalid store name {store!r}")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise StoreError(meta_path, f"wal_seq must be an int >= 0, got {seq!r}")
        return meta

    def _write_meta(self, store: str | None) -> None:
        """Replace memory.json atomically (temp file, fsync, rename, fsync dir)."""
        assert self._path is not None
        doc = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "dim": self.bank.dim,
               "store": store, "wal_seq": self._seq}
        tmp = self._path / f".{META_FILE}.tmp-{uuid.uuid4().hex[:12]}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path / META_FILE)
        _fsync_dir(self._path)

    def _replay(self, done_seq: int) -> None:
        """Apply the log's records with seq > done_seq that were not aborted."""
        assert self._wal is not None
        records = list(self._wal.replay())
        aborted = {r["seq"] for r in records if r["op"] == "abort"}
        for rec in records:
            seq = rec["seq"]
            self._seq = max(self._seq, seq)
            if rec["op"] == "abort" or seq <= done_seq or seq in aborted:
                continue
            try:
                if rec["op"] == "group":  # a bulk write: all its records, or none
                    subs = rec.get("ops")
                    if not isinstance(subs, list) or not all(isinstance(r, dict) for r in subs):
                        raise ValueError("a group record without a list of records")
                    self._check_group(subs)
                    for sub in subs:
                        self._apply(sub)
                else:
                    self._apply(rec)
                self._counters["replayed"] += 1
            except (ValueError, TypeError, KeyError) as exc:  # it failed the same way when logged
                self._counters["replay_skipped"] += 1
                log.warning("skipping logged write seq=%s that does not apply: %s", seq, exc)

    def _check_open(self) -> None:
        if self._closed:
            raise BatcherClosedError("this Memory is closed")
        if self._broken is not None:
            raise RuntimeError(f"this Memory stopped accepting writes after a log failure: {self._broken}")

    def _write(self, record: dict[str, Any]) -> None:
        """Log (durably), then apply one write; an apply that fails is logged as aborted."""
        self._commit([record])

    @staticmethod
    def _log_form(rec: dict[str, Any]) -> dict[str, Any]:
        """A record as logged: its arrays as exact base64 float32 (a group's records too)."""
        line = dict(rec)
        for key in ("vectors", "extra_vectors"):
            if isinstance(line.get(key), np.ndarray):
                line[key] = encode_array(line[key])
        if line.get("op") == "group":
            line["ops"] = [_Durable._log_form(r) for r in line["ops"]]
        return line

    def _commit(self, records: list[dict[str, Any]]) -> None:
        """Log (durably), then apply writes: one record, or several as ONE group record.

        A group (``{"seq", "op": "group", "ops": [records]}``, :mod:`rfmem_fast.serving.wal`)
        is one log line, so it is durable or absent as a whole (a torn line is cut off on
        replay), and it is applied all-or-nothing: :meth:`_check_group` proves every
        record applies (ids held / new, in order) before anything is logged, and the
        records are applied under one hold of the write lock, so no search sees a part
        of it. A record that fails anyway after the check (a bug, or MemoryError)
        leaves the in-memory bank partly written: the group is logged as aborted and
        the Memory refuses further writes (reopening a durable one restores the state
        before the group). Raises what the check or the apply raises.
        """
        with self._wmutex:
            self._check_open()
            if not records:
                raise ValueError("nothing to write")
            group = len(records) > 1
            if group:
                self._check_group(records)  # before anything is logged: a refusal writes nothing
            seq = self._seq + 1
            rec = {"seq": seq, "op": "group", "ops": records} if group else {"seq": seq, **records[0]}
            if self._wal is not None:
                try:
                    self._wal.append(self._log_form(rec))
                except (TypeError, ValueError, RecursionError) as exc:  # not JSON: nothing was written
                    raise ValueError(f"cannot log this write: {exc}") from None
                except OSError as exc:  # a partial line may be on disk: stop writing
                    self._broken = exc
                    raise
            self._seq = seq
            applied = 0
            try:
                with self._rw.write():
                    for r in (records if group else [rec]):
                        self._apply(r)
                        applied += 1
            except BaseException as exc:
                if applied:  # a group stopped half-way (cannot happen after _check_group)
                    self._broken = RuntimeError(f"a bulk write (log seq {seq}) failed after {applied} of its "
                                                f"{len(records)} records were applied: {exc!r}")
                if self._wal is not None:
                    try:
                        self._wal.append({"seq": seq, "op": "abort"})
                    except OSError as exc2:  # replay re-fails the same write: still consistent
                        self._broken = exc2
                raise
            with self._stats_lock:
                self._counters["writes"] += 1
            if self._wal is not None and self._checkpoint_bytes is not None and self._wal.nbytes > self._checkpoint_bytes:
                self._checkpoint_locked()

    def _check_group(self, records: list[dict[str, Any]]) -> None:
        """Prove that ``records`` apply in order to the bank as it is (read only): the
        ids of an ``add`` are not held, those of an ``update`` (and its dropped chunk
        rows) and of a ``delete`` are; later records see earlier ones' changes.

        Raises:
            KeyError: an id not held (named with its user). ValueError: an id already
                held, or an unknown operation.
        """
        seen: dict[str, dict[Any, bool]] = {}  # user -> {row id: held after the records so far}
        cleared: set[str] = set()

        def held(user: str, ids: list) -> list[bool]:
            known = seen.setdefault(user, {})
            ask = [i for i in ids if i not in known]
            if ask:
                known.update(zip(ask, [False] * len(ask) if user in cleared else self.bank.has_items(user, ask)))
            return [known[i] for i in ids]

        for rec in records:
            op, user, ids = rec.get("op"), rec.get("user"), list(rec.get("ids") or [])
            if len(set(ids)) != len(ids):
                raise ValueError(f"ids: a record of user {user!r} names an item id twice")
            if op == "add":
                for i, h in zip(ids, held(user, ids)):
                    if h:
                        raise ValueError(f"ids: user {user!r} already holds item id {i!r}")
                seen[user].update(dict.fromkeys(ids, True))
            elif op in ("update", "delete"):
                drop = list(rec.get("drop") or []) if op == "update" else []
                for i, h in zip(ids + drop, held(user, ids + drop)):
                    if not h:
                        raise KeyError(f"ids: user {user!r} holds no item id {i!r}")
                gone = ids if op == "delete" else drop
                seen[user].update(dict.fromkeys(gone, False))
                extra = list(rec.get("extra_ids") or []) if op == "update" else []
                for i, h in zip(extra, held(user, extra)):
                    if h:
                        raise ValueError(f"ids: user {user!r} already holds item id {i!r}")
                seen[user].update(dict.fromkeys(extra, True))
            elif op == "delete_user":
                cleared.add(user)
                seen[user] = {}
            else:
                raise ValueError(f"unknown operation {op!r} in a group of writes")

    def _apply(self, rec: dict[str, Any]) -> None:
        """Apply one logged write to the bank (live or replayed); bump the user's version."""
        op, user = rec["op"], rec["user"]
        if isinstance(user, int):  # a record of an older version (int keys): the id model's str
            user = str(user)
        if rec.get("ids") is not None and any(isinstance(i, int) for i in rec["ids"]):
            rec = dict(rec, ids=[str(i) if isinstance(i, int) else i for i in rec["ids"]])
        vec = rec.get("vectors")
        if isinstance(vec, dict):
            vec = decode_array(vec)
        chunks = self._chunks.setdefault(user, {})
        # (a record of an older version has no created_at: the time of the replay; none
        # has threads / positions: no conversation, or kept by an update)
        threads, positions = rec.get("threads"), rec.get("positions")
        if op == "add":
            self.bank.add(user, vec, rec["ids"], texts=rec["texts"], metadata=rec["metadata"],
                          created_at=_logged_times(rec.get("created_at")), threads=threads, positions=positions)
            self._note_chunks(chunks, rec["ids"])
        elif op == "update" and vec is None:  # metadata / conversation only (a new text comes with its vector)
            cids = self._chunk_ids_of(user, rec["ids"])
            parents = [c.rpartition(CHUNK_SEP)[0] for c in cids]
            if threads is not None or positions is not None:  # the rows kept bit for bit
                self.bank.update(user, rec["ids"], None, threads=threads, positions=positions)
                if cids:  # the chunk rows keep their item's thread and position (filters, context)
                    of = {i: j for j, i in enumerate(rec["ids"])}
                    self.bank.update(user, cids, None,
                                     threads=None if threads is None else [threads[of[p]] for p in parents],
                                     positions=None if positions is None else [positions[of[p]] for p in parents])
            if rec["metadata"] is not None:
                self.bank.set_metadata(user, rec["ids"], rec["metadata"])
                if cids:  # the chunk rows keep their item's metadata (filters)
                    of = dict(zip(rec["ids"], rec["metadata"]))
                    self.bank.set_metadata(user, cids, [of[p] for p in parents])
        elif op == "update":
            drop, extra = rec.get("drop") or [], rec.get("extra_ids") or []
            if drop or extra:  # check first: the update must not fail after its old chunks went
                held = set(self.bank.item_ids_of(user)) if user in self.bank else set()
                missing = [i for i in rec["ids"] if i not in held]
                if missing:
                    raise KeyError(f"ids: user {user!r} holds no item id {missing[0]!r}")
            if drop:
                self.bank.delete(user, drop)
            self.bank.update(user, rec["ids"], vec, texts=rec["texts"], metadata=rec["metadata"], threads=threads,
                             positions=positions)
            for i in rec["ids"]:
                chunks.pop(i, None)
            if extra:
                ev = rec["extra_vectors"]
                parents = [x.rpartition(CHUNK_SEP)[0] for x in extra]  # chunk rows: their item's metadata, time,
                uniq = list(dict.fromkeys(parents))  # thread, position (an item's several chunks: one lookup)
                pmeta = dict(zip(uniq, self.bank.get_metadata(user, uniq)))
                ptime = dict(zip(uniq, self.bank.created_at_of(user, uniq).tolist()))
                pthr = dict(zip(uniq, self.bank.threads_of(user, uniq)))
                ppos = dict(zip(uniq, self.bank.positions_of(user, uniq)))
                self.bank.add(user, decode_array(ev) if isinstance(ev, dict) else ev, extra,
                              metadata=[pmeta[p] for p in parents],
                              created_at=[ptime[p] for p in parents],
                              threads=[pthr[p] for p in parents], positions=[ppos[p] for p in parents])
                self._note_chunks(chunks, extra)
        elif op == "delete":
            self.bank.delete(user, rec["ids"])
            for i in rec["ids"]:
                if CHUNK_SEP not in i:
                    chunks.pop(i, None)
        elif op == "delete_user":  # every live item of the user ("forget me")
            if user in self.bank and self.bank.user_size(user):
                self.bank.delete(user, self.bank.item_ids_of(user))
            chunks.clear()
        else:
            raise ValueError(f"unknown logged operation {op!r}")
        self._uver[user] = self._uver.get(user, 0) + 1
        self._cache.invalidate(user)

    def _checkpoint_locked(self) -> None:
        assert self._path is not None and self._wal is not None
        gen = self._store_gen + 1
        name = f"{_STORE_PREFIX}{gen:08d}"
        self.bank.save(self._path / name)
        self._write_meta(name)
        self._wal.reset()
        for entry in self._path.iterdir():
            if entry.name.startswith(_STORE_PREFIX) and entry.name != name and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
        self._store_gen = gen
        with self._stats_lock:
            self._counters["checkpoints"] += 1
