"""The items of a bulk write (:meth:`Memory.add_many`, :meth:`Memory.update_many`,
:meth:`Memory.delete_many`, and the lines of ``rfmem export`` / ``rfmem import``): their
fields (:data:`ITEM_FIELDS`), the per-field checks, the parse of a list of items, the
held / new id checks per user, and the one encoder call for their texts. ``_BulkItems``
is a mixin of :class:`~rfmem_fast.serving.memory.Memory`, whose public bulk methods call
it; errors name ``items[i]`` / ``items[i].<field>`` and carry ``index`` / ``field``.
"""
from __future__ import annotations

import re
import time
import uuid
from typing import Any, Callable, Mapping

import numpy as np

from .validate import _canon_id, _check_meta1, _check_pairs, _check_position1, _check_text, _check_thread1, _instant

__all__ = ["ITEM_FIELDS"]


# ---------------------------------------------------------------------- bulk items
#: The fields of one item of :meth:`Memory.add_many` / :meth:`Memory.update_many` /
#: :meth:`Memory.delete_many`, which are also the keys of a line of ``rfmem export`` /
#: ``rfmem import``: field -> the bulk operations that take it. ``created_at`` (what
#: :meth:`Memory.add` takes: epoch seconds, an aware datetime or an ISO-8601 string; a
#: string without an offset read as UTC: :func:`_instant`; default: the time of the write)
#: is stored as seconds since the epoch and filterable (:mod:`rfmem_fast.filters`).
#: ``thread`` (a str or an int) and ``position`` (an int >= 0) are the item's
#: conversation (:meth:`Memory.add`'s ``thread`` / ``position``: a position needs a
#: thread; in an update, a None value clears the field, and a field left out is kept).
#: A new per-item field is one entry here, its checker in ``_FIELD_CHECKS`` and, to be
#: stored, its column in ``_RECORD_COLUMNS``.
ITEM_FIELDS: dict[str, tuple[str, ...]] = {
    "user_id": ("add", "update", "delete"),
    "id": ("add", "update", "delete"),
    "text": ("add", "update"),
    "vector": ("add", "update"),
    "metadata": ("add", "update"),
    "created_at": ("add",),
    "thread": ("add", "update"),
    "position": ("add", "update"),
}
#: item field -> the key of the logged add record holding it per item (``Memory._apply``
#: hands each to the bank)
_RECORD_COLUMNS = {"text": "texts", "metadata": "metadata", "created_at": "created_at", "thread": "threads",
                   "position": "positions"}
#: the fields an update may clear with a None value (any other None counts as not given)
_CLEARABLE = ("metadata", "thread", "position")
_ITEM_LABEL = re.compile(r"^items\[(\d+)\](?:\.(\w+))?")


def _check_vector1(mem: Any, value: Any, label: str) -> np.ndarray:
    """One item's vector: float32 [d] as given (not yet normalised; NaN / Inf / zero
    refused). A list of ints is taken as floats (as JSON numbers are). ``mem``: the Memory."""
    arr = value
    if not (isinstance(arr, np.ndarray) or hasattr(arr, "detach")):
        if isinstance(arr, (str, bytes, dict)):
            raise TypeError(f"{label} must be a list of {mem.dim} floats, got {type(arr).__name__}")
        try:
            arr = np.asarray(arr)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{label} must be a list of {mem.dim} floats: {exc}") from None
        if arr.dtype.kind in "iu":
            arr = arr.astype(np.float64)
    if getattr(arr, "ndim", None) != 1:
        raise ValueError(f"{label} must be a 1-D vector of {mem.dim} floats, got shape {tuple(getattr(arr, 'shape', ()))}")
    return mem._vectors(arr, label)[0]


#: field -> checker(memory, value, label) -> the value as stored (raises naming ``label``)
_FIELD_CHECKS: dict[str, Callable[[Any, Any, str], Any]] = {
    "user_id": lambda mem, v, label: _canon_id(v, label),
    "id": lambda mem, v, label: _canon_id(v, label),
    "text": lambda mem, v, label: _check_text(v, label),
    "vector": _check_vector1,
    "metadata": lambda mem, v, label: _check_meta1(v, label),
    "created_at": lambda mem, v, label: _instant(v, label, offsetless_utc=True),
    "thread": lambda mem, v, label: _check_thread1(v, label),
    "position": lambda mem, v, label: _check_position1(v, label),
}


def _tag_item_error(exc: BaseException) -> None:
    """Give an error whose message names ``items[i]`` (or ``items[i].field``) the
    attributes ``index`` (int) and ``field`` (str or None), for callers that map it
    back to their own numbering (HTTP 422 locations, line numbers of an import)."""
    msg = exc.args[0] if exc.args and isinstance(exc.args[0], str) else ""
    m = _ITEM_LABEL.match(msg)
    if m:
        exc.index = int(m.group(1))  # type: ignore[attr-defined]
        exc.field = m.group(2)  # type: ignore[attr-defined]


class _BulkItems:
    """Bulk writes' items (a mixin of :class:`~rfmem_fast.serving.memory.Memory`)."""


    def _parse_items(self, items: Any, op: str) -> list[dict[str, Any]]:
        """The items of a bulk ``op`` ("add", "update", "delete") checked field by field
        (:data:`ITEM_FIELDS`), as dicts of the fields given (a None value counts as not
        given, except ``metadata``, ``thread`` and ``position`` in an update, where it
        clears). Reads no state (an update's position without a thread is checked
        against the items' stored threads later, :meth:`_conversation_of`).

        Raises:
            TypeError / ValueError: naming ``items[i]`` or ``items[i].<field>``.
        """
        if isinstance(items, (str, bytes, Mapping)) or not hasattr(items, "__iter__"):
            raise TypeError(f"items must be a sequence of dicts (one per item), got {type(items).__name__}")
        items = list(items)
        if not items:
            raise ValueError(f"{op}_many needs at least one item")
        allowed = [f for f, ops in ITEM_FIELDS.items() if op in ops]
        out: list[dict[str, Any]] = []
        first: dict[tuple[str, str], int] = {}
        for i, it in enumerate(items):
            if not isinstance(it, Mapping):
                raise TypeError(f"items[{i}] must be a dict, got {type(it).__name__}")
            unknown = [k for k in it if k not in allowed]
            if unknown:
                raise ValueError(f"items[{i}] has the unknown field {unknown[0]!r}: {op}_many takes "
                                 f"{', '.join(allowed)}")
            row: dict[str, Any] = {}
            for f in allowed:
                if f not in it:
                    continue
                v = it[f]
                if v is None:
                    if f in _CLEARABLE and op == "update":
                        row[f] = None  # clears
                    continue
                row[f] = _FIELD_CHECKS[f](self, v, f"items[{i}].{f}")
            if "user_id" not in row:
                raise ValueError(f"items[{i}].user_id is required")
            if op != "add" and "id" not in row:
                raise ValueError(f"items[{i}].id is required")
            if op == "add" and "text" not in row and "vector" not in row:
                raise ValueError(f"items[{i}]: an item needs a text or a vector")
            if op == "add":
                _check_pairs([row.get("thread")], [row.get("position")],
                             lambda j: (f"items[{i}].position", f"items[{i}].thread"))
            if op == "update" and not any(f in row for f in ("text", "vector", "metadata", "thread", "position")):
                raise ValueError(f"items[{i}]: an update needs a text, a vector, metadata, a thread or a position")
            if "id" in row:
                key = (row["user_id"], row["id"])
                if key in first:
                    raise ValueError(f"items[{i}].id: item {row['id']!r} of user {row['user_id']!r} is given twice "
                                     f"in this call (also items[{first[key]}])")
                first[key] = i
            out.append(row)
        return out

    @staticmethod
    def _by_user(parsed: list[dict[str, Any]]) -> dict[str, list[int]]:
        """{user: indices of its items}, users in order of first appearance."""
        out: dict[str, list[int]] = {}
        for i, it in enumerate(parsed):
            out.setdefault(it["user_id"], []).append(i)
        return out

    def _check_held(self, parsed: list[dict[str, Any]], by_user: dict[str, list[int]], op: str) -> None:
        """The ids of an add are new to their users; those of an update / delete are held.

        Raises:
            ValueError (add) / KeyError (update, delete: unknown user or item), naming
                ``items[i].id`` (or ``.user_id``).
        """
        for user, idx in by_user.items():
            if op != "add" and user not in self.bank:
                raise KeyError(f"items[{idx[0]}].user_id: unknown user {user!r}")
            ids = [parsed[i]["id"] for i in idx]
            for i, h in zip(idx, self.bank.has_items(user, ids)):
                if op == "add" and h:
                    raise ValueError(f"items[{i}].id: user {user!r} already holds item id {parsed[i]['id']!r}")
                if op != "add" and not h:
                    raise KeyError(f"items[{i}].id: user {user!r} holds no item id {parsed[i]['id']!r}")

    def _embed_items(self, parsed: list[dict[str, Any]], need: list[int]) -> dict[int, np.ndarray]:
        """{item index: its chunk rows [c, d]} for the items ``need`` (their texts, in ONE
        encoder call; long texts chunked)."""
        if not need:
            return {}
        if not self._has_encoder:
            raise ValueError(f"items[{need[0]}].text: this Memory has no text encoder (encoder=False); "
                             "give each item a vector")
        rows = self._embed_chunks([parsed[i]["text"] for i in need], labels=[f"items[{i}].text" for i in need])
        return dict(zip(need, rows))

    def _bulk(self, fn: Callable[[Any], Any], items: Any) -> Any:
        try:
            return fn(items)
        except (TypeError, ValueError, KeyError) as exc:
            _tag_item_error(exc)
            raise

    def _add_many(self, items: Any) -> list[str]:
        self._check_open()
        parsed = self._parse_items(items, "add")
        now = time.time()
        for it in parsed:
            it.setdefault("id", uuid.uuid4().hex)
            it.setdefault("created_at", now)
        by_user = self._by_user(parsed)
        with self._wmutex:  # fail before the encoder runs
            self._check_held(parsed, by_user, "add")
        chunks = self._embed_items(parsed, [i for i, it in enumerate(parsed) if "vector" not in it])
        with self._wmutex:
            self._check_held(parsed, by_user, "add")  # again: another write may have come in
            records = []
            for user, idx in by_user.items():
                ids = [parsed[i]["id"] for i in idx]
                vec, extra_ids, extra = self._chunk_layout(ids, [chunks[i] if i in chunks else parsed[i]["vector"][None]
                                                                 for i in idx])
                cols = {col: [parsed[i].get(f) for i in idx] for f, col in _RECORD_COLUMNS.items()}
                records.append(self._add_record(user, ids, vec, extra_ids, extra, cols))
            self._commit(records)
        return [it["id"] for it in parsed]

    def _update_many(self, items: Any) -> None:
        self._check_open()
        parsed = self._parse_items(items, "update")
        by_user = self._by_user(parsed)
        with self._wmutex:
            self._check_held(parsed, by_user, "update")
        chunks = self._embed_items(parsed, [i for i, it in enumerate(parsed) if "text" in it and "vector" not in it])
        with self._wmutex:
            self._check_held(parsed, by_user, "update")
            records = []
            for user, idx in by_user.items():
                kinds: dict[tuple[bool, ...], list[int]] = {}  # one record per set of fields changed
                for i in idx:
                    it = parsed[i]
                    kinds.setdefault(("text" in it, "text" in it or "vector" in it, "metadata" in it,
                                      "thread" in it, "position" in it), []).append(i)
                for (has_text, has_vec, has_meta, has_thr, has_pos), g in kinds.items():
                    ids = [parsed[i]["id"] for i in g]
                    vec, extra_ids, extra = None, [], None
                    if has_vec:
                        vec, extra_ids, extra = self._chunk_layout(
                            ids, [chunks[i] if i in chunks else parsed[i]["vector"][None] for i in g])
                    conv = self._conversation_of(
                        user, ids, [parsed[i]["thread"] for i in g] if has_thr else None,
                        [parsed[i]["position"] for i in g] if has_pos else None,
                        lambda j, g=g: (f"items[{g[j]}].position", f"items[{g[j]}].thread"))
                    records.append(self._update_record(
                        user, ids, [parsed[i]["text"] for i in g] if has_text else None, vec,
                        [parsed[i]["metadata"] for i in g] if has_meta else None, extra_ids, extra, conv))
            self._commit(records)

    def _delete_many(self, items: Any) -> None:
        self._check_open()
        parsed = self._parse_items(items, "delete")
        by_user = self._by_user(parsed)
        with self._wmutex:
            self._check_held(parsed, by_user, "delete")
            self._commit([self._delete_record(user, [parsed[i]["id"] for i in idx]) for user, idx in by_user.items()])
