"""Who an HTTP request is, and which user's memories it may reach: the admin token (every
route), a user token (its own user only: 403 otherwise; :mod:`rfmem_fast.serving.tokens`),
or anyone when the app runs without auth; a missing or wrong bearer token is 401. The
FastAPI dependencies ``Who`` and ``User`` (the path's user, decoded and scope-checked),
and the scope check of a bulk request's items.
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request
from pydantic import BaseModel

from .http_middleware import _segment
from .http_models import UserSeg
from .tokens import TokenStore


@dataclass(frozen=True)
class _Principal:
    """Who a request is: the admin (every route) or the holder of one user's token."""

    admin: bool
    user: str | None = None


_UNAUTHORISED = "missing or invalid bearer token (Authorization: Bearer <token>)"


def _principal_of(key: bytes | None, tokens: TokenStore, authorization: str) -> _Principal | None:
    """Who sent a request with this ``Authorization`` header value ("" when absent):
    the admin (``key``, or anyone when ``key`` is None: no auth), the user of a user
    token, or None (no valid bearer token: 401)."""
    if key is None:
        return _Principal(admin=True)
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    if hmac.compare_digest(token.encode("utf-8", "surrogatepass"), key):
        return _Principal(admin=True)
    user = tokens.user_of(token)
    return None if user is None else _Principal(admin=False, user=user)


def _may_access(who: _Principal, user: str) -> bool:
    """Whether ``who`` may read / write ``user``'s memories (the admin: every user)."""
    return who.admin or hmac.compare_digest(user.encode("utf-8"), (who.user or "").encode("utf-8"))


async def _principal(request: Request) -> _Principal:  # async: no hop to the thread pool per request
    """Who sent the request: the admin token, a user token (bound to its user), or
    anyone when the app runs without auth; 401 otherwise."""
    who = _principal_of(request.app.state.admin_key, request.app.state.tokens,
                        request.headers.get("authorization", ""))
    if who is None:
        raise HTTPException(401, _UNAUTHORISED, headers={"WWW-Authenticate": "Bearer"})
    return who


Who = Annotated[_Principal, Depends(_principal)]


def _admin_only(who: Who) -> _Principal:
    """403 unless the request carries the admin token (or auth is off)."""
    if not who.admin:
        raise HTTPException(403, "this route needs the admin token")
    return who


def _token_admin(request: Request, who: Who) -> _Principal:
    """The token routes: the admin token only, and never without auth (a token minted by
    anyone on an unauthenticated server would stay valid once auth is switched on): 403."""
    if request.app.state.admin_key is None:
        raise HTTPException(403, "token administration needs the admin token: this server runs without "
                                 "authentication (--no-auth); restart it with --api-key to mint or revoke tokens")
    return _admin_only(who)


async def _scoped_user(user_id: UserSeg, who: Who) -> str:  # async: no hop to the thread pool per request
    """The path's user id, decoded; a user token may name its own user only (403)."""
    user = _segment(user_id, "user_id")
    if not _may_access(who, user):
        raise HTTPException(403, "this token may not access this user's memories")
    return user


User = Annotated[str, Depends(_scoped_user)]


def _bulk_items(who: "_Principal", items: list[BaseModel]) -> list[dict[str, Any]]:
    """The items of a bulk request as :meth:`Memory.add_many` takes them (the fields
    sent, an explicit null included), after the scope check: a user token may write
    its own user only (403 naming the first item of another user)."""
    out = []
    for i, it in enumerate(items):
        if not _may_access(who, it.user_id):
            raise HTTPException(403, f"items[{i}].user_id: this token may not access this user's memories "
                                     "(a user token writes its own user only)")
        out.append({k: getattr(it, k) for k in it.model_fields_set})
    return out
