"""What a :class:`~rfmem_fast.serving.memory.Memory` read returns: :class:`Hit` (one
retrieved item), :class:`Hits` (a query's hits plus its routing signals), :class:`Item`
(a stored item), their JSON-ready dict forms, and the cached form of an answer
(``_Answer``, one immutable copy per query shared with the hot-query cache).
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from typing import Any, Hashable, Sequence

from ..bank import INSTANT_END, INSTANT_MIN

__all__ = ["Hit", "Hits", "Item"]


@dataclass(frozen=True)
class Hit:
    """One retrieved memory item.

    Attributes:
        id: the item id (str; an int given at add time is its decimal str).
        text: the item's text (None when it was added as a vector without text).
        score: float; the inner product (cosine) on the Familiarity path, the
            (MMR-adjusted) discovery score on the Recollection path (RFMEM_SPEC.md 3-4).
        metadata: the item's metadata dict ({} when none); the caller's own copy.
        rank: 0-based position in the query's result.
        user_id: the user whose memory it came from (always the query's user).
        route: the query's path, "familiarity" or "recollection" (spec section 2).
        rule: the router rule that fired (``rfmem_fast.routing.base.RULE_NAMES``).
        mean: mean of the probe's top-``probe_k`` scores (spec section 1).
        entropy: the probe's softmax entropy (spec section 1).
        rounds: recollection rounds used (0 on the Familiarity path).
        dense_score: the item's exact cosine to the query (float; None when unknown).
        lexical_score: the item's BM25 score for the query's text within its user's
            memory (float, 0.0 for no lexical hit; None when the search was dense-only or
            the query a vector). With a lexical channel (``RFMemConfig.lexical_weight >
            0``, docs "Hybrid retrieval") ``score`` is the fused score of the two.
        created_at: when the item was added, as :attr:`Item.created_at` (a timezone-aware
            UTC ``datetime``; None when unknown), read from the snapshot the search ran on.
        thread: the item's conversation thread (str or int, as given to
            ``Memory.add(thread=...)``; None when it has none), as :attr:`Item.thread`.
        position: the item's position in its thread (int >= 0; None when it has none).
        context_score: the item's context score ``c`` (float) when the search ran with
            the context score on (``RFMemConfig.context_weight`` / ``thread_weight`` > 0,
            :mod:`rfmem_fast.context`, docs "Conversations"): the hits are then ranked by
            it, ``score`` holding the item's base score (its cosine, or its fused score
            with a lexical channel). None when the context score is off, and for a query
            that took the Recollection path.
    """

    id: Hashable
    text: str | None
    score: float
    metadata: dict
    rank: int
    user_id: Hashable
    route: str | None
    rule: str
    mean: float
    entropy: float
    rounds: int
    dense_score: float | None = None
    lexical_score: float | None = None
    created_at: datetime | None = None
    thread: str | int | None = None
    position: int | None = None
    context_score: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (``created_at`` as an ISO-8601 string, or None)."""
        out = asdict(self)
        out["created_at"] = None if self.created_at is None else self.created_at.isoformat()
        return out


class Hits(list):
    """The hits of one query (a ``list[Hit]``, best first) plus the query's own signals.

    Attributes:
        user_id: the query's user.
        route: "familiarity" / "recollection", or None when the user has no memory.
        rule: the router rule (``RULE_NAMES``), "unknown_user" for a user never seen,
            "no_hits" when the whole bank is empty.
        mean, entropy: the probe's familiarity signals (0.0 without items).
        rounds: recollection rounds used.
        cached: True when the answer came from the hot-query cache.
    """

    def __init__(self, hits: Sequence[Hit] = (), *, user_id: Hashable, route: str | None, rule: str,
                 mean: float, entropy: float, rounds: int, cached: bool = False) -> None:
        super().__init__(hits)
        self.user_id = user_id
        self.route = route
        self.rule = rule
        self.mean = mean
        self.entropy = entropy
        self.rounds = rounds
        self.cached = cached

    def to_dict(self) -> dict[str, Any]:
        """{"user_id", "route", "rule", "mean", "entropy", "rounds", "cached", "hits": [...]}."""
        return {
            "user_id": self.user_id, "route": self.route, "rule": self.rule, "mean": self.mean,
            "entropy": self.entropy, "rounds": self.rounds, "cached": self.cached,
            "hits": [h.to_dict() for h in self],
        }


@dataclass(frozen=True)
class Item:
    """A stored memory item: id, text (or None), metadata ({} when none), creation time
    and conversation.

    Attributes:
        created_at: when the item was added (``Memory.add(created_at=...)``, default the
            time of the add), a timezone-aware UTC ``datetime``; None when unknown (an
            item of a store written before creation times were kept, or one whose stored
            time is no instant: outside :data:`rfmem_fast.bank.INSTANT_RANGE`, written
            before that range was checked).
        thread: the conversation thread the item belongs to (``Memory.add(thread=...)``:
            a str or an int, kept as given; ``"1"`` and ``1`` are different threads), or
            None when it has none.
        position: its position in that thread (``Memory.add(position=...)``, an int >=
            0), or None when it has none.
    """

    id: Hashable
    text: str | None
    metadata: dict
    created_at: datetime | None = None
    thread: str | int | None = None
    position: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (``created_at`` as an ISO-8601 string, or None)."""
        out = asdict(self)
        out["created_at"] = None if self.created_at is None else self.created_at.isoformat()
        return out


def _utc(t: float) -> datetime | None:
    """Stored epoch seconds as a UTC datetime; None when unknown: NaN, or a value outside
    the instants a datetime can hold (:data:`rfmem_fast.bank.INSTANT_RANGE`), which only
    a store written before the range was checked can hold (a reader never raises)."""
    return datetime.fromtimestamp(float(t), tz=timezone.utc) if INSTANT_MIN <= t < INSTANT_END else None


@dataclass(frozen=True)
class _Answer:
    """A query's answer as cached: immutable hits plus the query's signals."""

    user: Hashable
    hits: tuple
    route: str | None
    rule: str
    mean: float
    entropy: float
    rounds: int

    def materialise(self, cached: bool) -> Hits:
        # every caller gets its own metadata dicts (an empty one included): a caller
        # mutating its hits never changes the cached answer or another caller's hits
        hits = [replace(h, metadata=copy.deepcopy(h.metadata)) for h in self.hits]
        return Hits(hits, user_id=self.user, route=self.route, rule=self.rule, mean=self.mean,
                    entropy=self.entropy, rounds=self.rounds, cached=cached)
