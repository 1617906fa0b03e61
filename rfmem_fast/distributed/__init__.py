"""Scale-out: users sharded over Ray actors, the same results as one process.

A memory service outgrows one machine by its number of users long before one user's
memory outgrows it, and RF-Mem's work is per user, so users are sharded:

* :mod:`.sharding`: the stable user -> shard hash (blake2b + jump consistent hash);
* :mod:`.shard`: :class:`ShardServer`, one shard's MemoryBank, backend and durable
  home (checkpoint store + write-ahead log, :mod:`.wal`), run as a Ray actor;
* :mod:`.sharded`: :class:`ShardedMemory`, the driver: writes to the owning shard, a
  search batch split by shard, searched in parallel, gathered back (:mod:`.gather`);
* :mod:`.manifest`: the shard map of a sharded store on disk.

Ray is optional (``pip install "rfmem_fast[ray]"``): this package imports without it;
creating a :class:`ShardedMemory` raises an ImportError naming the extra when Ray is
missing. The README ("Scale-out over many machines") shows how to start a cluster.
"""
from __future__ import annotations

from .manifest import MANIFEST_FILE
from .shard import ShardServer
from .sharded import ShardedMemory, ShardedMemoryClosedError, ShardError, ShardTimeoutError, ShardUnavailableError
from .sharding import HASH_SCHEME, shard_of

__all__ = [
    "HASH_SCHEME",
    "MANIFEST_FILE",
    "ShardError",
    "ShardServer",
    "ShardTimeoutError",
    "ShardedMemoryClosedError",
    "ShardUnavailableError",
    "ShardedMemory",
    "shard_of",
]
