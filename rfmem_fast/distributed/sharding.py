"""The user -> shard map: a stable, documented hash (never Python's salted ``hash()``).

A user key (str or int, exactly as :class:`rfmem_fast.MemoryBank` stores it) is mapped
to a shard in two steps, both defined here byte for byte so that any process, any
Python version and any machine computes the same assignment:

1. **canonical bytes**: ``b"s:" + key.encode("utf-8", "surrogatepass")`` for a str,
   ``b"i:" + str(key).encode("ascii")`` (decimal, with a minus sign if negative) for an
   int. The prefix keeps ``"1"`` and ``1`` apart, as the bank does;
2. **64-bit digest**: the first 8 bytes of ``blake2b(canonical, digest_size=8)`` read as
   a little-endian unsigned integer;
3. **jump consistent hash** (Lamping & Veach 2014, "A Fast, Minimal Memory, Consistent
   Hash Algorithm") of that digest over ``num_shards`` buckets.

The scheme is named :data:`HASH_SCHEME` in a sharded store's manifest; a store written
under another scheme is refused on load. Jump hashing balances users evenly (each shard
gets ``1 / num_shards`` of them up to sampling noise) and is *consistent*: going from N
to N + 1 shards moves only the ~1 / (N + 1) of the users that land on the new shard, all
others keep their shard (the property a future re-sharding step relies on).

A user's items never span shards: every write and every query of a user goes to
``shard_of(user, num_shards)``.
"""
from __future__ import annotations

import hashlib
from typing import Any, Hashable, Sequence

import numpy as np

from ..bank import _check_user

#: name of the user -> shard scheme, recorded in the manifest of a sharded store
HASH_SCHEME = "blake2b64-jump-v1"

_MASK64 = (1 << 64) - 1
_JUMP_MULT = 2862933555777941757  # the 64-bit LCG multiplier of the jump hash paper

__all__ = ["HASH_SCHEME", "canonical_key", "user_digest", "jump_hash", "shard_of", "shards_of"]


def canonical_key(user: Any, name: str = "user") -> Hashable:
    """The user key as the bank stores it (str or int; numpy scalars converted).

    Args:
        user: a user key.
        name: the argument's name for the error message (e.g. ``"users[3]"``).

    Returns:
        str or int.

    Raises:
        TypeError: a key that is not a str / int (bool and float refused), named.
    """
    return _check_user(user, name)


def user_digest(user: Any) -> int:
    """64-bit blake2b digest of a user key's canonical bytes (module docstring, steps 1-2).

    Args:
        user: a user key (str or int; numpy scalars accepted).

    Returns:
        int in [0, 2**64).

    Raises:
        TypeError: a key that is not a str / int.
    """
    key = canonical_key(user)
    if isinstance(key, str):
        raw = b"s:" + key.encode("utf-8", "surrogatepass")
    else:
        raw = b"i:" + str(int(key)).encode("ascii")
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def jump_hash(digest: int, num_buckets: int) -> int:
    """Jump consistent hash of a 64-bit key (Lamping & Veach 2014, Figure 1).

    Args:
        digest: unsigned 64-bit key (int in [0, 2**64)).
        num_buckets: number of buckets (int >= 1).

    Returns:
        bucket in [0, num_buckets).

    Raises:
        ValueError: ``num_buckets`` < 1 or ``digest`` outside [0, 2**64).
    """
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    if not 0 <= digest <= _MASK64:
        raise ValueError(f"digest must be an unsigned 64-bit int, got {digest}")
    key, b, j = digest, -1, 0
    while j < num_buckets:
        b = j
        key = (key * _JUMP_MULT + 1) & _MASK64
        j = int((b + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return b


def _check_num_shards(num_shards: Any) -> int:
    if isinstance(num_shards, (bool, np.bool_)) or not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
        raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
    return int(num_shards)


def shard_of(user: Any, num_shards: int) -> int:
    """The shard that owns ``user`` among ``num_shards`` (module docstring).

    Args:
        user: a user key (str or int; numpy scalars accepted; ``"1"`` != ``1``).
        num_shards: int >= 1.

    Returns:
        int in [0, num_shards).

    Raises:
        TypeError: a key that is not a str / int. ValueError: ``num_shards`` < 1.
    """
    return jump_hash(user_digest(user), _check_num_shards(num_shards))


def shards_of(users: Sequence[Any], num_shards: int) -> tuple[list[Hashable], np.ndarray]:
    """Canonical keys and shards of a sequence of user keys (each distinct key hashed once).

    Args:
        users: b user keys.
        num_shards: int >= 1.

    Returns:
        (list of b canonical keys, int64 [b] shard of each).

    Raises:
        TypeError: ``users`` is not a sequence, or a key that is not a str / int (named
            with its position, ``users[i]``). ValueError: ``num_shards`` < 1.
    """
    n = _check_num_shards(num_shards)
    if isinstance(users, (str, bytes)) or not hasattr(users, "__len__") or not hasattr(users, "__iter__"):
        raise TypeError(f"users must be a sequence of user keys, got {type(users).__name__}")
    keys: list[Hashable] = []
    out = np.empty(len(users), dtype=np.int64)
    memo: dict[Hashable, int] = {}
    for pos, user in enumerate(users):
        t = type(user)
        key = user if (t is str or t is int) else canonical_key(user, f"users[{pos}]")
        s = memo.get(key)
        if s is None:
            s = memo[key] = jump_hash(user_digest(key), n)
        keys.append(key)
        out[pos] = s
    return keys, out
