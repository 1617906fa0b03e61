"""The manifest of a sharded store: the shard map, written atomically.

Layout of a sharded store directory ``ROOT``::

    ROOT/rfmem_sharded.json          this manifest
    ROOT/shard-0000/store/           shard 0's bank store (rfmem_fast.store format)
    ROOT/shard-0000/wal.sqlite       shard 0's write-ahead log (rfmem_fast.distributed.wal)
    ROOT/shard-0001/...

Manifest keys: ``format`` ("rfmem_fast.sharded"), ``format_version`` (1), ``dim``,
``num_shards``, ``hash_scheme`` (:data:`rfmem_fast.distributed.sharding.HASH_SCHEME`:
how a user key maps to a shard), ``shards`` (one ``{"index", "dir"}`` per shard, in
order), ``rfmem_fast`` (the writer's version) and, after a save, ``stats`` (users,
items and bank version of each shard when it was saved; informative only).

The manifest is written to a temporary file, fsynced and swapped in with
``os.replace``; the directory is fsynced after. A store without a manifest, with a
manifest of another format, a newer format version or another hash scheme is refused
with :class:`rfmem_fast.StoreError` naming the file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..store import StoreError, _fsync_dir, check_format_header
from .sharding import HASH_SCHEME

MANIFEST_FILE = "rfmem_sharded.json"
FORMAT_NAME = "rfmem_fast.sharded"
FORMAT_VERSION = 1


def shard_dir_name(index: int) -> str:
    """Directory name of shard ``index`` inside a sharded store (``shard-0007``)."""
    return f"shard-{int(index):04d}"


def make_manifest(num_shards: int, dim: int, stats: list[dict] | None = None) -> dict:
    """The manifest dict of a store of ``num_shards`` shards of dimension ``dim``."""
    from .. import __version__

    man: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "dim": int(dim),
        "num_shards": int(num_shards),
        "hash_scheme": HASH_SCHEME,
        "shards": [{"index": i, "dir": shard_dir_name(i)} for i in range(num_shards)],
        "rfmem_fast": __version__,
    }
    if stats is not None:
        man["stats"] = stats
    return man


def write_manifest(root: str | os.PathLike, manifest: dict) -> Path:
    """Write ``manifest`` into ``root`` atomically (module docstring).

    Returns:
        Path of the manifest file.

    Raises:
        OSError: I/O failure (a previous manifest stays intact).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / MANIFEST_FILE
    tmp = root / f".{MANIFEST_FILE}.tmp-{os.getpid()}"
    data = json.dumps(manifest, ensure_ascii=True, indent=1).encode("ascii")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(root)
    return path


def read_manifest(root: str | os.PathLike) -> dict:
    """Read and check the manifest of the sharded store at ``root``.

    Returns:
        the manifest dict (keys in the module docstring).

    Raises:
        StoreError: no manifest, not JSON, another format, a newer format version,
            another hash scheme, or malformed ``dim`` / ``num_shards`` / ``shards``.
    """
    path = Path(root) / MANIFEST_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise StoreError(path, "missing file (not a sharded store)") from None
    except OSError as exc:
        raise StoreError(path, f"cannot be read ({exc})") from None
    try:
        man = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise StoreError(path, f"is not valid JSON ({exc})") from None
    check_format_header(path, man, FORMAT_NAME, FORMAT_VERSION)
    if man.get("hash_scheme") != HASH_SCHEME:
        raise StoreError(path, f"hash_scheme {man.get('hash_scheme')!r} is not {HASH_SCHEME!r} (another shard map)")
    for key in ("dim", "num_shards"):
        v = man.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise StoreError(path, f"{key} must be an int >= 1, got {v!r}")
    expect = [{"index": i, "dir": shard_dir_name(i)} for i in range(man["num_shards"])]
    shards = man.get("shards")
    if not isinstance(shards, list) or [{"index": s.get("index"), "dir": s.get("dir")} for s in shards if isinstance(s, dict)] != expect:
        raise StoreError(path, f"shards must list {man['num_shards']} entries {{'index': i, 'dir': 'shard-%04d'}} in order")
    return man
