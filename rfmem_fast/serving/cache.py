"""Hot-query cache of the serving layer (the paper's advice: a repeated query skips the
encoder and the probe; RF-Mem paper, section on efficiency / caching).

Two thread-safe LRU maps with hit counters:

* ``embeddings``: query text -> its unit query vector (float32 [d]); user-independent,
  so the same question from many users is encoded once.
* ``results``: (user, that user's write version, query key, mode, k) -> the query's
  answer (hits with texts / metadata / scores and the probe's mean, entropy, route,
  rule). The query key is ``("text", text)`` or ``("vector", blake2b of the unit
  float32 vector)``. Every write to a user bumps its version (so an older entry can
  never be returned) and drops that user's entries at once (:meth:`QueryCache.invalidate`);
  writes to other users leave them alone: a user's answer depends on its own items only.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable

import numpy as np

__all__ = ["LRUCache", "QueryCache", "vector_key"]

_MISSING = object()


class LRUCache:
    """A bounded least-recently-used map with hit / miss counters; thread-safe.

    Args:
        maxsize: the most entries kept (int >= 0); 0 disables the cache (nothing is
            stored, lookups miss without being counted).
        on_evict: optional ``f(key)`` called (under the cache's lock) for each entry
            dropped by eviction, :meth:`pop` or :meth:`clear`.

    Raises:
        ValueError: ``maxsize`` not an int >= 0.
    """

    def __init__(self, maxsize: int, on_evict: Callable[[Hashable], None] | None = None) -> None:
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 0:
            raise ValueError(f"maxsize must be an int >= 0, got {maxsize!r}")
        self.maxsize = maxsize
        self._data: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self._on_evict = on_evict
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value under ``key`` (now most recently used), or ``default``; counts a hit / miss."""
        if not self.maxsize:
            return default
        with self._lock:
            value = self._data.get(key, _MISSING)
            if value is _MISSING:
                self.misses += 1
                return default
            self._data.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: Hashable, value: Any) -> None:
        """Store ``value`` under ``key``, evicting the least recently used entries beyond ``maxsize``."""
        if not self.maxsize:
            return
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                old, _ = self._data.popitem(last=False)
                if self._on_evict is not None:
                    self._on_evict(old)

    def pop(self, key: Hashable) -> None:
        """Drop ``key`` if present."""
        with self._lock:
            if self._data.pop(key, _MISSING) is not _MISSING and self._on_evict is not None:
                self._on_evict(key)

    def clear(self) -> None:
        """Drop every entry (the counters stay)."""
        with self._lock:
            keys = list(self._data)
            self._data.clear()
            if self._on_evict is not None:
                for k in keys:
                    self._on_evict(k)

    def __len__(self) -> int:
        return len(self._data)

    def stats(self) -> dict[str, Any]:
        """{"hits", "misses", "hit_rate" (hits / lookups, 0.0 before any), "size", "maxsize"}."""
        with self._lock:
            n = self.hits + self.misses
            return {
                "hits": self.hits,
                "misses": self.misses,
                "hit_rate": self.hits / n if n else 0.0,
                "size": len(self._data),
                "maxsize": self.maxsize,
            }


def vector_key(vec: np.ndarray) -> tuple[str, str]:
    """The cache key of a query vector: ("vector", blake2b-128 hex of its float32 bytes).

    Args:
        vec: float32 [d] unit vector (what the search will use).
    """
    data = np.ascontiguousarray(vec, dtype=np.float32).tobytes()
    return ("vector", hashlib.blake2b(data, digest_size=16).hexdigest())


class QueryCache:
    """The serving layer's embedding and result caches (module docstring).

    Args:
        maxsize: entries of each of the two LRU maps (0 disables both).

    Thread-safe. :meth:`stats` gives both maps' counters and hit rates.
    """

    def __init__(self, maxsize: int = 4096) -> None:
        self._index_lock = threading.Lock()
        self._by_user: dict[Hashable, set] = {}
        self.embeddings = LRUCache(maxsize)
        self.results = LRUCache(maxsize, on_evict=self._forget)

    def _forget(self, key: tuple) -> None:
        with self._index_lock:
            keys = self._by_user.get(key[0])
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_user[key[0]]

    @staticmethod
    def result_key(user: Hashable, version: int, qkey: tuple, mode: str, k: int) -> tuple:
        """The result-cache key of one query: (user, version, query key, mode, k)."""
        return (user, version, qkey, mode, k)

    def get_result(self, key: tuple) -> Any:
        """The cached answer under ``key`` (from :meth:`result_key`) or None."""
        return self.results.get(key)

    def put_result(self, key: tuple, value: Any) -> None:
        """Cache an answer under ``key`` (indexed by its user for :meth:`invalidate`)."""
        if not self.results.maxsize:
            return
        with self._index_lock:
            self._by_user.setdefault(key[0], set()).add(key)
        self.results.put(key, value)

    def invalidate(self, user: Hashable) -> None:
        """Drop every cached answer of ``user`` (called on each write to that user)."""
        with self._index_lock:
            keys = list(self._by_user.get(user, ()))
        for k in keys:
            self.results.pop(k)

    def stats(self) -> dict[str, Any]:
        """{"results": LRU stats, "embeddings": LRU stats}."""
        return {"results": self.results.stats(), "embeddings": self.embeddings.stats()}
