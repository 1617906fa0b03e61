"""Router files: a fitted router as a small versioned JSON document.

Layout (``ROUTER_FORMAT``, version ``ROUTER_VERSION``)::

    {
      "format": "rfmem_fast.router",
      "version": 1,
      "kind": "threshold" | "logistic" | "mlp",
      "probe": {"probe_k": 10, "temperature": 20.0, "entropy": "mean"},
      "params": {...},                # the router's own parameters (Router.params())
      "meta": {...}                   # free-form: what it was fitted on, CV scores, ...
    }

``RFMemConfig(router="file.json")`` and ``search(..., router=...)`` load it with
:func:`load_router`; a file that is not JSON, lacks a key, has another format tag, a
newer version, an unknown kind or malformed parameters raises :class:`RouterFileError`
naming the file and the problem. Files are written atomically (temporary file +
rename). Loaded routers are cached per (path, modification time, size).
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from .base import ROUTER_KINDS, ProbeSettings, Router

__all__ = ["ROUTER_FORMAT", "ROUTER_VERSION", "RouterFileError", "save_router", "load_router", "router_document"]

ROUTER_FORMAT = "rfmem_fast.router"
ROUTER_VERSION = 1
_cache: dict[tuple[str, int, int], tuple[Router, dict[str, Any]]] = {}
_lock = threading.Lock()


class RouterFileError(ValueError):
    """A router file is unreadable, corrupt, of another format or version, or malformed."""


def router_document(router: Router, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document of a router (see the module docstring)."""
    if not isinstance(router, Router):
        raise TypeError(f"router must be a rfmem_fast.routing.Router, got {type(router).__name__}")
    return {
        "format": ROUTER_FORMAT,
        "version": ROUTER_VERSION,
        "kind": router.kind,
        "probe": router.probe.to_dict(),
        "params": router.params(),
        "meta": dict(meta or {}),
    }


def save_router(router: Router, path: str | os.PathLike[str], meta: dict[str, Any] | None = None) -> str:
    """Write a router file atomically.

    Args:
        router: a fitted router.
        path: the JSON file to write (its folder must exist).
        meta: JSON-serialisable facts to store with it (training data, CV scores, ...).

    Returns:
        the path written (str).

    Raises:
        TypeError: not a Router, or ``meta`` not JSON-serialisable.
        OSError: the file cannot be written.
    """
    doc = router_document(router, meta)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return str(path)


def _parse(doc: Any, where: str) -> tuple[Router, dict[str, Any]]:
    if not isinstance(doc, dict):
        raise RouterFileError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    if doc.get("format") != ROUTER_FORMAT:
        raise RouterFileError(f"{where}: not a router file (format {doc.get('format')!r}, expected {ROUTER_FORMAT!r})")
    version = doc.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise RouterFileError(f"{where}: bad version {version!r}")
    if version > ROUTER_VERSION:
        raise RouterFileError(
            f"{where}: router file version {version} is newer than this rfmem_fast reads ({ROUTER_VERSION}); upgrade rfmem_fast"
        )
    for key in ("kind", "probe", "params"):
        if key not in doc:
            raise RouterFileError(f"{where}: missing key {key!r}")
    kind = doc["kind"]
    if kind not in ROUTER_KINDS:
        raise RouterFileError(f"{where}: unknown router kind {kind!r} (known: {sorted(ROUTER_KINDS)})")
    probe_doc = doc["probe"]
    try:
        probe = ProbeSettings(
            probe_k=int(probe_doc["probe_k"]),
            temperature=float(probe_doc["temperature"]),
            entropy=str(probe_doc["entropy"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise RouterFileError(f"{where}: malformed 'probe' ({e!r}); expected probe_k, temperature, entropy") from None
    if not isinstance(doc["params"], dict):
        raise RouterFileError(f"{where}: 'params' must be an object")
    try:
        router = ROUTER_KINDS[kind].from_params(doc["params"], probe)
    except (TypeError, ValueError) as e:
        raise RouterFileError(f"{where}: malformed {kind} parameters: {e}") from None
    meta = doc.get("meta") or {}
    return router, meta if isinstance(meta, dict) else {}


def load_router(path: str | os.PathLike[str], with_meta: bool = False) -> Any:
    """Read a router file (cached per path, modification time and size).

    Args:
        path: the JSON file.
        with_meta: also return the file's ``meta`` dict.

    Returns:
        the Router, or (Router, meta) when ``with_meta``.

    Raises:
        FileNotFoundError: no such file.
        RouterFileError: (a ValueError) corrupt, other format, newer version, unknown
            kind, malformed parameters; the message names the file.
    """
    p = Path(os.fspath(path)).expanduser().resolve()
    if not p.is_file():
        raise FileNotFoundError(f"router file {str(path)!r} does not exist")
    st = p.stat()
    key = (str(p), st.st_mtime_ns, st.st_size)
    with _lock:
        hit = _cache.get(key)
    if hit is None:
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RouterFileError(f"router file {str(p)!r} is not valid JSON: {e}") from None
        hit = _parse(doc, f"router file {str(p)!r}")
        with _lock:
            _cache[key] = hit
    return hit if with_meta else hit[0]
