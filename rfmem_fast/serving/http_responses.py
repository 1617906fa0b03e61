"""What the HTTP service answers besides its models: the memory's errors mapped to HTTP
statuses (:func:`_http_errors`, :func:`_bulk_errors`, the 422 of a malformed body) and
the JSON rendering of answers (orjson, with the standard library as the fallback; a
search answer built from a query's hits, :func:`_search_doc`).
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Iterator

import orjson
from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ..filters import FilterTypeError
from .batcher import BatcherClosedError, QueueFullError, RequestTimeoutError
from .hits import Hits


@contextmanager
def _http_errors() -> Iterator[None]:
    """Map the memory's errors to HTTP statuses (module docstring)."""
    try:
        yield
    except QueueFullError as e:
        raise HTTPException(503, str(e), headers={"Retry-After": "1"}) from None
    except RequestTimeoutError as e:
        raise HTTPException(504, str(e)) from None
    except BatcherClosedError as e:
        raise HTTPException(503, str(e)) from None
    except KeyError as e:
        raise HTTPException(404, str(e.args[0]) if e.args else "not found") from None
    except FilterTypeError as e:  # a filter whose range type the user's values never have
        raise HTTPException(422, str(e)) from None
    except (ValueError, TypeError) as e:
        raise HTTPException(400, str(e)) from None


@contextmanager
def _bulk_errors() -> Iterator[None]:
    """:func:`_http_errors`, but a bad item (an error with an ``index``, from
    :meth:`Memory.add_many` and co.) is a 422 in pydantic's form, located at the item."""
    with _http_errors():
        try:
            yield
        except (ValueError, TypeError) as e:
            index = getattr(e, "index", None)
            if index is None:
                raise
            field = getattr(e, "field", None)
            loc = ["body", "items", index] + ([field] if field else [])
            raise HTTPException(422, [{"type": "value_error", "loc": loc, "msg": str(e)}]) from None



class FastJSONResponse(JSONResponse):
    """A JSON response serialised by orjson (~15x faster than the standard library on a
    search answer: 3 us instead of 44 us); falls back to the standard library for what
    orjson refuses (an int beyond 64 bits in metadata)."""

    def render(self, content: Any) -> bytes:
        return _dumps(content)


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 with pydantic's errors (type, loc naming the field, msg), without echoing the
    input: a NaN in it cannot be written as JSON, and a vector would be echoed whole."""
    errors = [{"type": e.get("type"), "loc": list(e.get("loc", ())), "msg": e.get("msg")} for e in exc.errors()]
    return FastJSONResponse({"detail": errors}, status_code=422)


def _search_json(hits: Hits) -> dict[str, Any]:
    """One query's answer as the search routes send it (:class:`SearchResponse`)."""
    return _search_doc(hits.user_id, hits.route, hits.rule, hits.mean, hits.entropy, hits.rounds, hits.cached, hits)


def _search_doc(user: Any, route: str | None, rule: str, mean: float, entropy: float, rounds: int, cached: bool,
                hits: Any) -> dict[str, Any]:
    """The JSON object of :class:`SearchResponse` from a query's signals and its
    :class:`~rfmem_fast.serving.memory.Hit` objects (only read)."""
    return {
        "user_id": str(user), "route": route, "rule": rule, "mean": mean,
        "entropy": entropy, "rounds": rounds, "cached": cached,
        "hits": [{"id": h.id, "text": h.text, "score": h.score, "metadata": h.metadata, "rank": h.rank,
                  "dense_score": h.dense_score, "lexical_score": h.lexical_score,
                  "created_at": h.created_at,  # a datetime: ISO-8601 as isoformat() (_dumps)
                  "thread": h.thread, "position": h.position, "context_score": h.context_score} for h in hits],
    }


def _dumps(content: Any) -> bytes:
    """``content`` as JSON bytes: orjson, or the standard library for what orjson
    refuses (an int beyond 64 bits in metadata), as :class:`FastJSONResponse`. A
    timezone-aware ``datetime`` (a hit's ``created_at``) is written as its
    ``isoformat()`` by both (orjson in Rust: ~10x cheaper than ``isoformat()`` per hit)."""
    try:
        return orjson.dumps(content)
    except orjson.JSONEncodeError:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"),
                          default=_iso).encode()


def _iso(o: Any) -> str:
    """``json.dumps``' ``default``: a datetime as its ISO-8601 string (as orjson writes it)."""
    if isinstance(o, datetime):
        return o.isoformat()
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")
