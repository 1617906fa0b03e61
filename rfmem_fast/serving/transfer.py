"""``rfmem export`` / ``rfmem import``: a Memory directory to and from JSON lines.

One JSON object per line, one line per item, the fields of :meth:`Memory.add_many`
(:data:`~rfmem_fast.serving.memory.ITEM_FIELDS`)::

    {"id": "a1", "user_id": "alice", "text": "I moved to Lyon", "metadata": {"source": "chat"}}
    {"id": "v7", "user_id": "bob", "text": null, "metadata": {}, "vector": [0.0123, ...]}

* ``id``, ``user_id``: str (an int is read as its decimal str).
* ``text``: str, or null for an item stored as a vector only.
* ``metadata``: a JSON object ({} when none).
* ``vector`` (``export --vectors``, and always for an item without text): the stored
  row, d floats (unit norm; each float32 written as the float64 holding it exactly, so
  it reads back bit for bit). An item whose text is stored in several chunk rows (over
  the encoder's window) has none: import embeds its text again.
* ``created_at`` (optional: an ISO-8601 string, one without an offset read as UTC, or
  a number of seconds since the Unix epoch, as ``Memory.add`` / ``add_many`` take it;
  0001-01-01 .. 9999-12-31 in UTC): the item's creation time, written by export as
  ISO-8601 UTC (absent when unknown:
  an item of a store written before creation times were kept, or one whose stored time
  was no instant, :attr:`~rfmem_fast.serving.memory.Item.created_at`; ``rfmem export``
  counts them) and stored by import (default: the time of the import); filterable
  (``filters={"created_at": {...}}``).
* ``thread`` and ``position`` (optional): the item's conversation thread (a str or an
  int, kept as written: ``"1"`` and ``1`` are different threads) and its position in it
  (an int >= 0; a line with a position needs a thread), as ``Memory.add`` takes them;
  written by export only for an item that has them (so the export of a memory without
  conversations is unchanged) and stored by import (docs "Conversations").

Export: users in the order they were first written, each user's items in insertion
order; one consistent version of the memory. Import: lines in batches of ``--batch``
items, each batch ONE :meth:`Memory.add_many` (all of it or none of it, durable when
it returns); the first bad line stops the import with its line number, every batch
before it stays imported. An id the user already holds is refused (the batch with
it is not written) unless ``--skip-existing`` skips such lines, which also resumes an
interrupted import. Other memory layers' exports: ``--text-field NAME`` reads the text
from another key (mem0: ``memory``), ``--user U`` gives lines without ``user_id`` a
user, ``--ignore-extra`` drops keys that are not item fields (otherwise refused, so a
misspelt field is never lost silently).

Both commands open the directory as ``rfmem serve`` does (one process at a time: stop
the server first; the directory's log is checkpointed when they close it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import uuid
from pathlib import Path
from typing import IO, Any, Iterator

from .cli import add_encoder_args, open_memory
from .memory import ITEM_FIELDS, META_FILE, Memory, MemoryLockedError

__all__ = ["ImportLineError", "export_jsonl", "export_line", "import_jsonl", "line_item", "add_parsers"]

#: the fields a line may carry (those of an added item)
LINE_FIELDS = tuple(f for f, ops in ITEM_FIELDS.items() if "add" in ops)
DEFAULT_BATCH = 1000
_LABEL = re.compile(r"^items\[\d+\](?:\.|: )?")
_ITEM = re.compile(r"items\[(\d+)\]")


class ImportLineError(ValueError):
    """A line that cannot be imported: ``line`` (1-based) and ``imported`` (items written
    by the batches before it) as attributes; the message starts with ``line N:``."""

    def __init__(self, line: int, message: str, imported: int = 0) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line
        self.imported = imported


# ---------------------------------------------------------------------- export
def export_line(item: dict[str, Any]) -> str:
    """One item of :meth:`Memory.export_items` as a JSON line (no newline; module docstring)."""
    if "vector" in item:
        item = dict(item, vector=item["vector"].tolist())  # float64 values holding the float32 ones exactly
    return json.dumps(item, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def export_jsonl(memory: Memory, out: str | os.PathLike[str] | IO[str], user_id: str | None = None,
                 vectors: bool = False) -> dict[str, int]:
    """Write ``memory`` (or one user of it) as JSON lines.

    Args:
        memory: an open Memory.
        out: a path (written to a temporary file, fsynced and renamed into place, so an
            interrupted export leaves no partial file) or an open text file.
        user_id: one user, or None for every user.
        vectors: also write each item's stored vector.

    Returns:
        {"items": lines written, "users": users with at least one item, "unknown_time":
        lines without a ``created_at`` (the item's creation time is unknown)}.

    Raises:
        OSError: the file cannot be written.
    """
    if hasattr(out, "write"):
        return _write_lines(memory, out, user_id, vectors)
    path = Path(os.fspath(out))
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            stats = _write_lines(memory, f, user_id, vectors)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return stats


def _write_lines(memory: Memory, f: IO[str], user_id: str | None, vectors: bool) -> dict[str, int]:
    n, users, unknown, last = 0, 0, 0, None
    for item in memory.export_items(user_id, vectors=vectors):
        f.write(export_line(item))
        f.write("\n")
        n += 1
        unknown += "created_at" not in item
        if item["user_id"] != last:  # a user's items are consecutive
            users, last = users + 1, item["user_id"]
    return {"items": n, "users": users, "unknown_time": unknown}


# ---------------------------------------------------------------------- import
def line_item(obj: Any, line: int, text_field: str = "text", user_id: str | None = None,
              ignore_extra: bool = False) -> dict[str, Any]:
    """One parsed line as an item of :meth:`Memory.add_many`.

    Args:
        obj: the line's JSON value.
        line: its 1-based number (for messages).
        text_field: the key holding the text ("text"; mem0: "memory").
        user_id: the user of a line without ``user_id`` (or None: such a line is refused).
        ignore_extra: drop keys that are not item fields instead of refusing the line.

    Raises:
        ImportLineError: not an object, an unknown key, text under two keys, no user.
    """
    if not isinstance(obj, dict):
        raise ImportLineError(line, f"must be a JSON object (one item), got {type(obj).__name__}")
    item = dict(obj)
    if text_field != "text" and text_field in item:
        if item.get("text") is not None:
            raise ImportLineError(line, f"has both 'text' and the --text-field {text_field!r}")
        item["text"] = item.pop(text_field)
    if item.get("user_id") is None:
        if user_id is None:
            raise ImportLineError(line, "has no user_id (give one per line, or --user U for lines without)")
        item["user_id"] = user_id
    extra = [k for k in item if k not in LINE_FIELDS]
    if extra:
        if not ignore_extra:
            raise ImportLineError(line, f"has the unknown field {extra[0]!r}: a line holds {', '.join(LINE_FIELDS)} "
                                        "(--text-field NAME reads the text from another field, --ignore-extra "
                                        "drops the others)")
        for k in extra:
            del item[k]
    return item


def _read_lines(f: IO[str], text_field: str, user_id: str | None, ignore_extra: bool) -> Iterator[tuple[int, dict]]:
    for no, raw in enumerate(f, 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError as exc:
            raise ImportLineError(no, f"is not JSON: {exc}") from None
        yield no, line_item(obj, no, text_field, user_id, ignore_extra)


def import_jsonl(memory: Memory, src: str | os.PathLike[str] | IO[str], batch: int = DEFAULT_BATCH,
                 skip_existing: bool = False, text_field: str = "text", user_id: str | None = None,
                 ignore_extra: bool = False, progress: Any = None) -> dict[str, int]:
    """Add the items of a JSON-lines file to ``memory``, ``batch`` lines per
    :meth:`Memory.add_many` call (each all-or-nothing; module docstring).

    Args:
        memory: an open Memory.
        src: a path or an open text file (UTF-8).
        batch: items per write (int >= 1; default 1000).
        skip_existing: skip a line whose id its user already holds (default: refuse it).
        text_field, user_id, ignore_extra: as :func:`line_item`.
        progress: None, or ``progress(done_items)`` after each batch.

    Returns:
        {"lines": item lines read, "imported": items written, "skipped": lines skipped,
        "batches": writes made, "created_at": lines that had a ``created_at`` (kept as
        the items' creation times)}.

    Raises:
        ImportLineError: the first bad line (its number, why; ``imported`` items were
            written before it, by earlier batches). OSError: an unreadable file or a
            failed write.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    stats = {"lines": 0, "imported": 0, "skipped": 0, "batches": 0, "created_at": 0}
    if hasattr(src, "read"):
        _import_from(memory, src, batch, skip_existing, text_field, user_id, ignore_extra, progress, stats)
    else:
        with open(src, encoding="utf-8") as f:
            _import_from(memory, f, batch, skip_existing, text_field, user_id, ignore_extra, progress, stats)
    return stats


def _import_from(memory: Memory, f: IO[str], batch: int, skip_existing: bool, text_field: str,
                 user_id: str | None, ignore_extra: bool, progress: Any, stats: dict[str, int]) -> None:
    pending: list[tuple[int, dict]] = []

    def flush() -> None:
        todo = pending
        if skip_existing:
            todo = _drop_held(memory, pending, stats)
        if todo:
            try:
                memory.add_many([it for _, it in todo])
            except (ValueError, TypeError, KeyError) as exc:
                i = getattr(exc, "index", None)
                msg = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
                if i is None:
                    raise ImportLineError(todo[0][0], f"(the batch starting here) {msg}", stats["imported"]) from None
                # "items[2].text is empty" -> "text is empty"; "(also items[0])" -> "(also line 4)"
                msg = _LABEL.sub("", msg, count=1)
                msg = _ITEM.sub(lambda m: f"line {todo[int(m.group(1))][0]}", msg)
                raise ImportLineError(todo[i][0], msg, stats["imported"]) from None
            stats["imported"] += len(todo)
            stats["batches"] += 1
            if progress is not None:
                progress(stats["imported"])
        pending.clear()

    try:
        for no, item in _read_lines(f, text_field, user_id, ignore_extra):
            stats["lines"] += 1
            stats["created_at"] += item.get("created_at") is not None
            pending.append((no, item))
            if len(pending) >= batch:
                flush()
        flush()
    except ImportLineError as exc:
        exc.imported = stats["imported"]
        raise


def _drop_held(memory: Memory, pending: list[tuple[int, dict]], stats: dict[str, int]) -> list[tuple[int, dict]]:
    """``pending`` without the lines whose id their user already holds (counted as skipped)."""
    by_user: dict[Any, list[int]] = {}
    for k, (_, it) in enumerate(pending):
        if it.get("id") is not None:
            by_user.setdefault(it["user_id"], []).append(k)
    held: set[int] = set()
    for user, ks in by_user.items():
        try:
            flags = memory.has_items(user, [pending[k][1]["id"] for k in ks])
        except (TypeError, ValueError):
            continue  # a malformed id or user: add_many names the line
        held.update(k for k, h in zip(ks, flags) if h)
    stats["skipped"] += len(held)
    return [p for k, p in enumerate(pending) if k not in held]


# ---------------------------------------------------------------------- the commands
def add_parsers(subparsers: Any) -> None:
    """Register ``export`` and ``import`` on the ``rfmem`` sub-command parser."""
    ex = subparsers.add_parser(
        "export", help="write a memory directory's items as JSON lines (id, user_id, text, metadata[, vector])",
        description="Write every item of a Memory directory (or one user's) as one JSON object per line: "
        "id, user_id, text, metadata, created_at, thread and position (when the item has them) and, with --vectors, "
        "the stored vector. The directory must not be open "
        "elsewhere (stop `rfmem serve` first).",
    )
    ex.add_argument("--memory-dir", required=True, help="the Memory directory (rfmem serve --path)")
    ex.add_argument("--out", required=True, help="the JSON-lines file to write ('-': standard output)")
    ex.add_argument("--user", default=None, help="export this user only")
    ex.add_argument("--vectors", action="store_true",
                    help="also write each item's stored vector (float32, exact), so an import needs no encoder and "
                    "stores the same rows bit for bit (without it, import embeds the texts again: equal to the "
                    "stored vectors to the encoder's run-to-run tolerance, ~1e-7 per component, with the same "
                    "encoder)")
    ex.set_defaults(func=run_export)

    im = subparsers.add_parser(
        "import", help="add the items of a JSON-lines file to a memory directory, in all-or-nothing batches",
        description="Add one item per JSON line (id?, user_id, text and / or vector, metadata?, created_at?, "
        "thread?, position?) "
        "to a Memory directory (created if absent), --batch lines per write, each all or nothing. The first bad "
        "line stops the import with its number; earlier batches stay. Texts without a vector are embedded by "
        "the encoder (--encoder ...): with the encoder that wrote them, vectors equal to the exported memory's "
        "to its run-to-run tolerance (~1e-7 per component), not bit for bit; export --vectors for that.",
    )
    im.add_argument("--memory-dir", required=True, help="the Memory directory (created if absent)")
    im.add_argument("--in", dest="src", required=True, help="the JSON-lines file to read ('-': standard input)")
    im.add_argument("--batch", type=int, default=DEFAULT_BATCH,
                    help=f"items per all-or-nothing write (default {DEFAULT_BATCH})")
    im.add_argument("--skip-existing", action="store_true",
                    help="skip lines whose id their user already holds (default: such a line stops the import); "
                    "resumes an interrupted import")
    im.add_argument("--text-field", default="text",
                    help="the key holding each line's text (default 'text'; mem0 exports: 'memory')")
    im.add_argument("--user", default=None, help="the user of lines without a user_id")
    im.add_argument("--ignore-extra", action="store_true",
                    help="drop keys that are not item fields (default: such a line stops the import)")
    add_encoder_args(im)
    im.add_argument("--dim", type=int, default=None, help="vector dimension of a new vectors-only memory (--encoder none)")
    im.set_defaults(func=run_import)


def _err(cmd: str, msg: Any) -> int:
    print(f"rfmem {cmd}: error: {msg}", file=sys.stderr)
    return 2


def run_export(args: argparse.Namespace) -> int:
    """``rfmem export``: returns the exit code (2: the directory cannot be opened)."""
    path = Path(args.memory_dir)
    if not (path / META_FILE).is_file():
        return _err("export", f"{str(path)!r} is not a Memory directory (no {META_FILE})")
    try:
        memory = Memory(path, encoder=False, batching=False)
    except (ValueError, OSError, MemoryLockedError) as exc:
        return _err("export", exc)
    try:
        stats = export_jsonl(memory, sys.stdout if args.out == "-" else args.out, args.user, args.vectors)
    except OSError as exc:
        return _err("export", exc)
    finally:
        memory.close()
    where = "standard output" if args.out == "-" else args.out
    note = ""
    if stats["unknown_time"]:
        note = (f"; {stats['unknown_time']} of them without a created_at (creation time unknown: stored before "
                "creation times were kept, or stored as no valid instant; an import gives them the time of the import)")
    print(f"rfmem export: {stats['items']} items of {stats['users']} users to {where}{note}", file=sys.stderr)
    return 0


def run_import(args: argparse.Namespace) -> int:
    """``rfmem import``: returns the exit code (1: a bad line, after the batches before it
    were written; 2: the directory or the file cannot be opened, a bad option)."""
    if args.batch < 1:
        return _err("import", f"--batch must be >= 1, got {args.batch}")
    try:
        memory = open_memory(args.memory_dir, encoder=args.encoder, encoder_dtype=args.encoder_dtype,
                             encoder_backend=args.encoder_backend, dim=args.dim, batching=False)
    except (ValueError, TypeError, OSError, MemoryLockedError) as exc:
        return _err("import", exc)
    try:
        stats = import_jsonl(memory, sys.stdin if args.src == "-" else args.src, batch=args.batch,
                             skip_existing=args.skip_existing, text_field=args.text_field, user_id=args.user,
                             ignore_extra=args.ignore_extra)
    except ImportLineError as exc:
        print(f"rfmem import: error: {exc}", file=sys.stderr)
        print(f"rfmem import: {exc.imported} items were imported before that line (whole batches); fix the line "
              "and run again with --skip-existing to go on", file=sys.stderr)
        return 1
    except OSError as exc:
        return _err("import", exc)
    finally:
        memory.close()
    note = f"; {stats['created_at']} lines kept their created_at" if stats["created_at"] else ""
    print(f"rfmem import: {stats['imported']} items from {stats['lines']} lines in {stats['batches']} writes, "
          f"{stats['skipped']} skipped (already held){note}", file=sys.stderr)
    return 0
