"""Whose memories an ``rfmem mcp`` client reaches: a fixed user (``--user``), or the user of
its bearer token in a token map (``--tokens``, kept as sha256 digests: :func:`hash_token`,
:class:`TokenMap`, which is also the SDK's token verifier), as an :class:`McpScope` built
from the command's options by :func:`scope_from_options`. Each name is re-exported by
:mod:`rfmem_fast.serving.mcp_server`, whose module docstring describes the scopes.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .mcp_sdk import AccessToken

#: environment variable read for the token map when ``--tokens`` is not given
TOKENS_ENV = "RFMEM_MCP_TOKENS"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def hash_token(token: str) -> str:
    """The sha256 hex digest a token map stores for ``token``.

    Args:
        token: the bearer token (str, non-empty).

    Returns:
        64 lowercase hex characters.

    Raises:
        ValueError: an empty or non-str token.
    """
    if not isinstance(token, str) or not token:
        raise ValueError("token must be a non-empty str")
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class TokenMap:
    """Bearer token -> user, kept as sha256 digests of the tokens (never the tokens).

    Also the SDK's ``TokenVerifier``: :meth:`verify_token` gives an ``AccessToken`` whose
    ``client_id`` is the user.

    Args:
        entries: (sha256 hex digest, user) pairs; a user may have several tokens.

    Raises:
        ValueError: a digest that is not 64 hex characters, an empty user, a digest
            listed twice, or no entries.
    """

    def __init__(self, entries: list[tuple[str, str]]) -> None:
        seen: set[str] = set()
        out: list[tuple[bytes, str]] = []
        for i, (digest, user) in enumerate(entries):
            d = str(digest).strip().lower().removeprefix("sha256:")
            if len(d) != 64 or any(c not in "0123456789abcdef" for c in d):
                raise ValueError(f"tokens[{i}].sha256 must be 64 hex characters (hash_token / sha256sum of the token)")
            if not isinstance(user, str) or not user:
                raise ValueError(f"tokens[{i}].user must be a non-empty str")
            if d in seen:
                raise ValueError(f"tokens[{i}]: this token hash is listed twice")
            seen.add(d)
            out.append((d.encode("ascii"), user))
        if not out:
            raise ValueError("the token map holds no tokens")
        self._entries = out

    @classmethod
    def from_json(cls, obj: Any) -> "TokenMap":
        """A map from parsed JSON: ``{"tokens": [{"user": U, "sha256": HEX}, ...]}`` (or the list alone).

        Raises:
            ValueError: any other shape (the bad part named).
        """
        items = obj.get("tokens") if isinstance(obj, dict) else obj
        if not isinstance(items, list):
            raise ValueError('the token map must be {"tokens": [{"user": ..., "sha256": ...}, ...]}')
        entries = []
        for i, e in enumerate(items):
            if not isinstance(e, dict) or set(e) != {"user", "sha256"}:
                raise ValueError(f'tokens[{i}] must be an object with exactly the keys "user" and "sha256"')
            entries.append((e["sha256"], e["user"]))
        return cls(entries)

    @classmethod
    def load(cls, spec: str) -> "TokenMap":
        """A map from a JSON file's path, or from the JSON text itself (``spec`` starting with ``{`` or ``[``).

        Raises:
            OSError: the file cannot be read. ValueError: not JSON, or a bad map.
        """
        text = spec if spec.lstrip()[:1] in ("{", "[") else Path(spec).read_text(encoding="utf-8")
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the token map is not JSON: {exc}") from None
        return cls.from_json(obj)

    def __len__(self) -> int:
        return len(self._entries)

    def user_for(self, token: str) -> str | None:
        """The user of ``token``, or None when it is not in the map.

        Every entry is compared (with :func:`hmac.compare_digest`), so the time taken does
        not depend on which entry matched, or how much of a digest did.
        """
        if not isinstance(token, str) or not token:
            return None
        digest = hashlib.sha256(token.encode("utf-8")).hexdigest().encode("ascii")
        found = None
        for d, user in self._entries:
            if hmac.compare_digest(digest, d) and found is None:
                found = user
        return found

    async def verify_token(self, token: str) -> AccessToken | None:
        """The SDK's ``TokenVerifier`` hook: an ``AccessToken`` (``client_id`` = the user) or None."""
        user = self.user_for(token)
        return None if user is None else AccessToken(token=token, client_id=user, scopes=[])


@dataclass(frozen=True)
class McpScope:
    """Whose memories a server's clients reach: a fixed ``user``, or the user of each
    client's bearer token in ``tokens`` (exactly one of the two)."""

    user: str | None = None
    tokens: TokenMap | None = None

    def __post_init__(self) -> None:
        if (self.user is None) == (self.tokens is None):
            raise ValueError("give exactly one of user (a fixed user) or tokens (bearer token -> user)")
        if self.user is not None and (not isinstance(self.user, str) or not self.user):
            raise ValueError("user must be a non-empty str")


def scope_from_options(transport: str, user: str | None = None, tokens: str | None = None,
                       host: str = "127.0.0.1", environ: Mapping[str, str] | None = None) -> McpScope:
    """The scope of ``rfmem mcp`` from its options.

    Args:
        transport: "stdio" or "http".
        user: ``--user`` (a fixed user), or None.
        tokens: ``--tokens`` (a token map file, or its JSON), or None: then
            ``$RFMEM_MCP_TOKENS`` over HTTP when no user is given.
        host: ``--host`` (a fixed user over HTTP has no authentication: loopback only).
        environ: the environment (default ``os.environ``).

    Returns:
        the McpScope.

    Raises:
        ValueError: stdio without --user, stdio with --tokens, HTTP with neither a
            user nor tokens, HTTP with --user on a non-loopback host, both given, or a
            bad token map. OSError: an unreadable token file.
    """
    env = os.environ if environ is None else environ
    if user is not None and tokens is not None:
        raise ValueError("--user and --tokens exclude each other")
    if transport == "stdio":
        if tokens is not None:
            raise ValueError("--tokens is for --transport http; a stdio server serves one --user")
        if not user:
            raise ValueError("--transport stdio needs --user USER (the one user this server process serves)")
        return McpScope(user=user)
    if transport != "http":
        raise ValueError(f"--transport must be 'stdio' or 'http', got {transport!r}")
    if user is not None:
        if host not in _LOOPBACK:
            raise ValueError(f"--user over HTTP serves without authentication; only on a loopback --host "
                             f"({', '.join(_LOOPBACK)}), not {host!r}: use --tokens")
        return McpScope(user=user)
    spec = tokens if tokens is not None else (env.get(TOKENS_ENV) or None)
    if spec is None:
        raise ValueError(f"--transport http needs --tokens FILE (or ${TOKENS_ENV}) or a fixed --user")
    return McpScope(tokens=TokenMap.load(spec))
