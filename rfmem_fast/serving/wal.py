"""The write-ahead log of a persistent :class:`rfmem_fast.Memory` (durable writes).

``bank.save()`` writes a whole snapshot (O(N d)), far too costly per write. A
:class:`rfmem_fast.Memory` opened on a directory therefore logs every write here
BEFORE applying it and acknowledges it only after the log line is on disk (write +
flush + fsync); a checkpoint (``Memory.save()``) folds the log into a bank store and
truncates it.

Format: one line per record, ``<crc32 of the JSON, 8 hex digits> <JSON object>\\n``.
Every record has ``seq`` (int, increasing) and ``op``: ``add`` / ``update`` /
``delete`` / ``delete_user`` (the arguments, vectors as exact float32 bytes in
base64), ``group`` (a bulk write, ``Memory.add_many`` and co.: ``"ops"`` holds its
records, each an ``add`` / ``update`` / ``delete`` record without a ``seq`` of its
own; being ONE line, a group is on disk whole or, torn, cut off whole, and it is
replayed all-or-nothing) or ``abort`` (the write with that ``seq`` failed validation
and was not applied). Logs without ``group`` records are those of earlier versions,
read unchanged.

Reading (:meth:`WriteAheadLog.replay`): a torn last line (a crash in the middle of an
append: the write was never acknowledged) is cut off; a bad line followed by a good
one is corruption and raises :class:`rfmem_fast.StoreError` naming the file and line.
"""
from __future__ import annotations

import base64
import json
import os
import zlib
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..store import StoreError

__all__ = ["WriteAheadLog", "encode_array", "decode_array"]


def encode_array(a: np.ndarray) -> dict[str, Any]:
    """An exact JSON form of a float32 matrix: {"shape", "f32le": base64 bytes}."""
    a = np.ascontiguousarray(a, dtype="<f4")
    return {"shape": list(a.shape), "f32le": base64.b64encode(a.tobytes()).decode("ascii")}


def decode_array(d: dict[str, Any]) -> np.ndarray:
    """Inverse of :func:`encode_array` (float32, bit for bit).

    Raises:
        ValueError: a malformed entry.
    """
    shape = tuple(int(x) for x in d["shape"])
    a = np.frombuffer(base64.b64decode(d["f32le"], validate=True), dtype="<f4")
    return a.reshape(shape).astype(np.float32)


def _line(record: dict[str, Any]) -> bytes:
    body = json.dumps(record, ensure_ascii=True, separators=(",", ":"), allow_nan=False).encode("ascii")
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _parse(line: bytes) -> dict[str, Any] | None:
    """The record of one complete line, or None when it is damaged."""
    if len(line) < 10 or line[8:9] != b" " or not line.endswith(b"\n"):
        return None
    body = line[9:-1]
    try:
        if int(line[:8], 16) != zlib.crc32(body):
            return None
        rec = json.loads(body.decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("seq"), int) or not isinstance(rec.get("op"), str):
        return None
    return rec


class WriteAheadLog:
    """An append-only, fsynced log of JSON records (module docstring).

    Args:
        path: the log file (created if absent).
        fsync: fsync after each append (default True; False only for throwaway data:
            an acknowledged write may then be lost on power failure, not on a process kill).

    Use :meth:`replay` once (it also repairs a torn tail), then :meth:`append`.
    """

    def __init__(self, path: str | os.PathLike[str], fsync: bool = True) -> None:
        self.path = Path(path)
        self.fsync = bool(fsync)
        self._f: Any = None

    def replay(self) -> Iterator[dict[str, Any]]:
        """Yield the log's records in order; cut a torn tail off the file.

        Raises:
            StoreError: a damaged line followed by an intact one (corruption), naming
                the file and the line number.
        """
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StoreError(self.path, f"cannot be read: {exc}") from None
        lines = data.splitlines(keepends=True)
        good_end = 0
        records = []
        bad_at: int | None = None
        for no, line in enumerate(lines, 1):
            rec = _parse(line)
            if rec is None:
                if bad_at is None:
                    bad_at = no
                continue
            if bad_at is not None:
                raise StoreError(self.path, f"line {bad_at} is damaged but later lines are intact (corrupt log)")
            records.append(rec)
            good_end += len(line)
        if good_end != len(data):  # a torn append: never acknowledged, drop it
            with open(self.path, "r+b") as f:
                f.truncate(good_end)
                f.flush()
                os.fsync(f.fileno())
        yield from records

    def append(self, record: dict[str, Any]) -> None:
        """Write one record durably (write, flush, fsync) before returning.

        Raises:
            OSError: the write failed (the caller must not acknowledge).
            ValueError: a record that is not JSON (NaN, non-str keys, ...).
        """
        line = _line(record)
        if self._f is None:
            self._f = open(self.path, "ab")
        self._f.write(line)
        self._f.flush()
        if self.fsync:
            os.fsync(self._f.fileno())

    def reset(self) -> None:
        """Empty the log (after a checkpoint made its records redundant), durably."""
        if self._f is not None:
            self._f.close()
            self._f = None
        with open(self.path, "wb") as f:
            f.flush()
            os.fsync(f.fileno())

    @property
    def nbytes(self) -> int:
        """Current size of the log file in bytes (0 when absent)."""
        if self._f is not None:
            return self._f.tell()
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def close(self) -> None:
        """Close the file handle (appends reopen it)."""
        if self._f is not None:
            self._f.close()
            self._f = None
