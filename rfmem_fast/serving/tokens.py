"""Per-user bearer tokens of the HTTP service (hashed at rest; minted / revoked by the admin).

A token is bound to ONE user id: a request carrying it may read and write that user's
memories only (every other user's routes answer 403, admin routes too). The admin
token (``rfmem serve --api-key`` / ``RFMEM_API_KEY``) reaches every route and mints /
revokes user tokens over HTTP (``/v1/admin/tokens``).

At rest only the sha256 of each token is kept, in ``tokens.json`` of the server's
data directory (the Memory directory), written atomically (temp file, fsync, rename,
fsync of the directory) with mode 0600: a token is durable once its mint returns, and a
revocation once it returns. A presented token is hashed and compared with every stored
hash by :func:`hmac.compare_digest` (constant time; no early exit on the first match).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["TokenStore", "TokenInfo", "TOKENS_FILE", "TOKEN_PREFIX"]

#: the token store's file name inside the server's data directory
TOKENS_FILE = "tokens.json"
#: every minted token starts with it (so a leaked one is easy to grep for)
TOKEN_PREFIX = "rfm_"
_FORMAT = "rfmem_fast.tokens"


@dataclass(frozen=True)
class TokenInfo:
    """A stored token, without its secret.

    Attributes:
        token_id: public id of the token (str; used to revoke it).
        user_id: the one user the token may access (str).
        label: free text given at mint time (str or None).
        created: Unix time of the mint (float).
    """

    token_id: str
    user_id: str
    label: str | None
    created: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return asdict(self)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


class TokenStore:
    """Hashed per-user tokens, durable under ``path`` (None: in memory only).

    Args:
        path: the JSON file of the store (created on the first mint), or None.

    Raises:
        ValueError: ``path`` holds a file that is not a token store.

    Thread-safe.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self._path = None if path is None else Path(os.fspath(path))
        self._lock = threading.Lock()
        self._entries: list[dict[str, Any]] = []
        if self._path is not None and self._path.is_file():
            try:
                doc = json.loads(self._path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ValueError(f"token store {str(self._path)!r} cannot be read: {exc}") from None
            if not isinstance(doc, dict) or doc.get("format") != _FORMAT or not isinstance(doc.get("tokens"), list):
                raise ValueError(f"{str(self._path)!r} is not an {_FORMAT} file")
            self._entries = doc["tokens"]

    @property
    def path(self) -> Path | None:
        """The store's file (None for an in-memory store)."""
        return self._path

    def mint(self, user_id: str, label: str | None = None) -> tuple[str, TokenInfo]:
        """A new token for ``user_id``; durable once it returns.

        Returns:
            (token, info): the secret (shown once: only its sha256 is kept) and its
            :class:`TokenInfo`.

        Raises:
            TypeError: ``user_id`` not a str, ``label`` not a str or None.
            OSError: the store could not be written (no token is minted then).
        """
        if not isinstance(user_id, str) or not user_id:
            raise TypeError(f"user_id must be a non-empty str, got {user_id!r}")
        if label is not None and not isinstance(label, str):
            raise TypeError(f"label must be a str or None, got {type(label).__name__}")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        info = TokenInfo(uuid.uuid4().hex[:16], user_id, label, time.time())
        with self._lock:
            entries = self._entries + [{**info.to_dict(), "sha256": _digest(token)}]
            self._save(entries)
            self._entries = entries
        return token, info

    def revoke(self, token_id: str) -> bool:
        """Revoke a token by its id; durable once it returns. False when unknown."""
        with self._lock:
            entries = [e for e in self._entries if e["token_id"] != token_id]
            if len(entries) == len(self._entries):
                return False
            self._save(entries)
            self._entries = entries
            return True

    def revoke_user(self, user_id: str) -> int:
        """Revoke every token of ``user_id``; returns how many."""
        with self._lock:
            entries = [e for e in self._entries if e["user_id"] != user_id]
            n = len(self._entries) - len(entries)
            if n:
                self._save(entries)
                self._entries = entries
            return n

    def user_of(self, token: str) -> str | None:
        """The user a presented token is bound to, or None (unknown / revoked).

        Compares the token's sha256 with EVERY stored hash by :func:`hmac.compare_digest`."""
        digest = _digest(token).encode()
        found = None
        for e in self._entries:  # a snapshot: writers replace the list, never mutate it
            if hmac.compare_digest(digest, e["sha256"].encode()):
                found = e["user_id"]
        return found

    def list(self, user_id: str | None = None) -> list[TokenInfo]:
        """Stored tokens (without secrets), of one user or all."""
        return [TokenInfo(e["token_id"], e["user_id"], e.get("label"), e["created"])
                for e in self._entries if user_id is None or e["user_id"] == user_id]

    def _save(self, entries: list[dict[str, Any]]) -> None:
        if self._path is None:
            return
        from ..store import _fsync_dir

        doc = {"format": _FORMAT, "format_version": 1, "tokens": entries}
        self._path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._path.with_name(f".{self._path.name}.tmp-{uuid.uuid4().hex[:12]}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self._path.parent)
