"""Write-ahead log of one shard: every acknowledged write is durable before it is acknowledged.

A shard's directory holds a bank store (:mod:`rfmem_fast.store`, the last checkpoint)
and ``wal.sqlite``, an SQLite database (the standard library's ``sqlite3``) in WAL
journal mode with ``synchronous=FULL``: a committed transaction is fsynced to disk
before ``COMMIT`` returns, and a torn or partial transaction is rolled back by SQLite on
the next open. SQLite does the framing, checksumming and crash recovery; this module
only defines the record.

One row per write (:class:`WalRecord`)::

    wal(version INTEGER PRIMARY KEY,   -- the bank's version AFTER the write
        op TEXT,                       -- "add" | "delete" | "update"
        user TEXT,                     -- JSON of the user key (keeps str vs int)
        ids TEXT,                      -- JSON list of item ids
        texts TEXT,                    -- JSON list of str / null, or NULL (update: keep)
        rows INTEGER, dim INTEGER,
        vectors BLOB,                  -- float32 [rows, dim] C order (NULL for delete, and
                                       -- for an update keeping the vectors)
        threads TEXT,                  -- JSON list of str / int / null, or NULL (none / keep)
        positions TEXT)                -- JSON list of int / null, or NULL (none / keep)

A log written before the conversation columns existed gets them on open (``ALTER TABLE``,
NULL in its rows: writes without threads or positions).

Protocol (:class:`rfmem_fast.distributed.shard.ShardServer`): a write is applied to the
in-memory bank (which validates it and writes nothing on error), then appended here and
committed; only then is it acknowledged. A checkpoint saves the bank store atomically
and then drops the records whose version the store already holds; recovery loads the
store and replays the records with a higher version, in order. A crash between the two
steps of a checkpoint replays nothing twice (versions at or below the store's are
skipped).
"""
from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Hashable, Iterator

import numpy as np

from ..store import StoreError

WAL_FILE = "wal.sqlite"
OPS = ("add", "delete", "update")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS wal (
    version INTEGER PRIMARY KEY,
    op TEXT NOT NULL,
    user TEXT NOT NULL,
    ids TEXT NOT NULL,
    texts TEXT,
    rows INTEGER NOT NULL,
    dim INTEGER NOT NULL,
    vectors BLOB,
    threads TEXT,
    positions TEXT
)
"""
#: columns added after the first version of the table (added to an older log on open)
_ADDED_COLUMNS = (("threads", "TEXT"), ("positions", "TEXT"))
_COLUMNS = "version, op, user, ids, texts, rows, dim, vectors, threads, positions"


@dataclass(frozen=True)
class WalRecord:
    """One logged write.

    Attributes:
        version: the bank's version after the write (int >= 1, strictly increasing).
        op: "add", "delete" or "update".
        user: the user key (str or int).
        ids: the item ids (list of str / int).
        texts: list of str / None per item, or None (update keeping the texts; delete).
        vectors: float32 [m, d] rows as given to the bank, or None (delete; an update
            keeping the vectors).
        threads: the items' conversation threads (str / int / None per item), or None
            (an add without threads; an update keeping them; delete).
        positions: the items' positions in their threads (int / None per item), or None.
    """

    version: int
    op: str
    user: Hashable
    ids: list
    texts: list | None
    vectors: np.ndarray | None
    threads: list | None = None
    positions: list | None = None


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=True, separators=(",", ":"))


class WriteAheadLog:
    """The write-ahead log of one shard (module docstring).

    Args:
        path: the SQLite file (created with its table when absent).

    Raises:
        StoreError: the file exists but is not a readable log of this format.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            # autocommit mode: transactions are opened explicitly in append()
            self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute(_SCHEMA)
            have = {row[1] for row in self._db.execute("PRAGMA table_info(wal)")}
            for name, kind in _ADDED_COLUMNS:
                if name not in have:  # a log of a version without this column: its rows read NULL
                    self._db.execute(f"ALTER TABLE wal ADD COLUMN {name} {kind}")
        except sqlite3.DatabaseError as exc:
            raise StoreError(self.path, f"is not a readable write-ahead log ({exc})") from None

    def append(self, rec: WalRecord) -> None:
        """Append one record and commit it durably (fsync) before returning.

        Raises:
            ValueError: ``rec.op`` unknown. StoreError: the commit failed (disk full,
                I/O error, a version already logged); nothing of the record is kept then.
        """
        if rec.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {rec.op!r}")
        vec = None
        rows, dim = len(rec.ids), 0
        if rec.vectors is not None:
            v = np.ascontiguousarray(rec.vectors, dtype=np.float32)
            rows, dim = v.shape
            vec = v.tobytes()
        row = (
            int(rec.version), rec.op, _dumps(rec.user), _dumps(list(rec.ids)),
            None if rec.texts is None else _dumps(list(rec.texts)), rows, dim, vec,
            None if rec.threads is None else _dumps(list(rec.threads)),
            None if rec.positions is None else _dumps(list(rec.positions)),
        )  # fmt: skip
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(f"INSERT INTO wal ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise StoreError(self.path, f"cannot log write version {rec.version} ({exc})") from None

    def records(self, after_version: int) -> Iterator[WalRecord]:
        """The logged writes with a version above ``after_version``, in version order.

        Raises:
            StoreError: a record that cannot be decoded (named by its version).
        """
        try:
            cur = self._db.execute(
                f"SELECT {_COLUMNS} FROM wal "
                "WHERE version > ? ORDER BY version",
                (int(after_version),),
            )
            rows = cur.fetchall()
        except sqlite3.Error as exc:
            raise StoreError(self.path, f"cannot read the log ({exc})") from None
        for version, op, user, ids, texts, n, dim, blob, threads, positions in rows:
            try:
                vec = None
                if blob is not None:
                    vec = np.frombuffer(blob, dtype=np.float32).reshape(n, dim).copy()
                rec = WalRecord(
                    int(version), str(op), json.loads(user), json.loads(ids),
                    None if texts is None else json.loads(texts), vec,
                    None if threads is None else json.loads(threads),
                    None if positions is None else json.loads(positions),
                )  # fmt: skip
            except (ValueError, TypeError) as exc:
                raise StoreError(self.path, f"record version {version} is corrupt ({exc})") from None
            if rec.op not in OPS:
                raise StoreError(self.path, f"record version {version} has the unknown op {rec.op!r}")
            yield rec

    def truncate(self, upto_version: int) -> int:
        """Drop the records with a version at or below ``upto_version`` (after a checkpoint).

        Returns:
            int: the number of records dropped.

        Raises:
            StoreError: the delete could not be committed.
        """
        try:
            cur = self._db.execute("DELETE FROM wal WHERE version <= ?", (int(upto_version),))
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            return int(cur.rowcount)
        except sqlite3.Error as exc:
            raise StoreError(self.path, f"cannot truncate the log ({exc})") from None

    def __len__(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM wal").fetchone()[0])

    def close(self) -> None:
        """Close the database (idempotent)."""
        if self._db is not None:
            self._db.close()
            self._db = None  # type: ignore[assignment]
