"""Router and re-ranker files: a fitted router or re-ranker as a small versioned JSON document.

Layout (``ROUTER_FORMAT``, version ``ROUTER_VERSION``)::

    {
      "format": "rfmem_fast.router",
      "version": 1,
      "kind": "threshold" | "logistic" | "mlp",
      "probe": {"probe_k": 10, "temperature": 20.0, "entropy": "mean"},
      "params": {...},                # the router's own parameters (Router.params())
      "meta": {...}                   # free-form: what it was fitted on, CV scores, ...
    }

A re-ranker file (:mod:`rfmem_fast.routing.rerank`, ``RERANKER_FORMAT``, version
``RERANKER_VERSION``)::

    {
      "format": "rfmem_fast.reranker",
      "version": 1,
      "kind": "linear",
      "params": {"features": ["cos", "profile"], "weights": [...], "depth": 20},
      "meta": {...}
    }

An :class:`~rfmem_fast.config.RFMemConfig` holds the PATH of a router file
(``RFMemConfig(router="file.json")``) or re-ranker file (``reranker=``) as plain data; the
search and the :class:`~rfmem_fast.serving.Memory` facade resolve it with
:func:`resolve_router` / :func:`resolve_reranker` (which load with :func:`load_router` /
:func:`load_reranker` and name the field in their errors; :func:`check_config_files`
resolves both up front, as ``Memory`` and the CLI do on opening). A file that is not
JSON, lacks a key, has another format tag, a newer version, an unknown kind or
malformed parameters raises :class:`RouterFileError` / :class:`RerankerFileError`
naming the file and the problem. Files are written atomically (temporary file +
rename). Loaded routers and re-rankers are cached per (path, modification time, size),
so resolving a config's file at every search reads it once.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from .base import ROUTER_KINDS, ProbeSettings, Router
from .threshold import ThresholdRouter

__all__ = [
    "ROUTER_FORMAT", "ROUTER_VERSION", "RouterFileError", "save_router", "load_router", "router_document",
    "RERANKER_FORMAT", "RERANKER_VERSION", "RerankerFileError", "save_reranker", "load_reranker",
    "resolve_router", "resolve_reranker", "check_config_files",
]  # fmt: skip

ROUTER_FORMAT = "rfmem_fast.router"
ROUTER_VERSION = 1
RERANKER_FORMAT = "rfmem_fast.reranker"
RERANKER_VERSION = 1
_cache: dict[tuple[str, str, int, int], Any] = {}
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
    return _write_atomic(router_document(router, meta), path)


def _write_atomic(doc: dict[str, Any], path: str | os.PathLike[str]) -> str:
    """Write a JSON document to ``path`` atomically (temporary file + rename); returns the path."""
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


def _check_header(doc: Any, where: str, fmt: str, version_max: int, what: str, keys: tuple[str, ...], err: type) -> None:
    """Raise ``err`` unless ``doc`` is an object of format ``fmt``, a version in [1, version_max] and has ``keys``."""
    if not isinstance(doc, dict):
        raise err(f"{where}: expected a JSON object, got {type(doc).__name__}")
    if doc.get("format") != fmt:
        raise err(f"{where}: not a {what} file (format {doc.get('format')!r}, expected {fmt!r})")
    version = doc.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise err(f"{where}: bad version {version!r}")
    if version > version_max:
        raise err(f"{where}: {what} file version {version} is newer than this rfmem_fast reads ({version_max}); upgrade rfmem_fast")
    for key in keys:
        if key not in doc:
            raise err(f"{where}: missing key {key!r}")


def _parse(doc: Any, where: str) -> tuple[Router, dict[str, Any]]:
    _check_header(doc, where, ROUTER_FORMAT, ROUTER_VERSION, "router", ("kind", "probe", "params"), RouterFileError)
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
    hit = _load_cached(path, "router", _parse, RouterFileError)
    return hit if with_meta else hit[0]


def _load_cached(path: str | os.PathLike[str], what: str, parse: Any, err: type) -> Any:
    """``parse(json document, description)`` of a file, cached per (kind, path, mtime, size)."""
    p = Path(os.fspath(path)).expanduser().resolve()
    if not p.is_file():
        raise FileNotFoundError(f"{what} file {str(path)!r} does not exist")
    st = p.stat()
    key = (what, str(p), st.st_mtime_ns, st.st_size)
    with _lock:
        hit = _cache.get(key)
    if hit is None:
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise err(f"{what} file {str(p)!r} is not valid JSON: {e}") from None
        hit = parse(doc, f"{what} file {str(p)!r}")
        with _lock:
            _cache[key] = hit
    return hit


# ------------------------------------------------------------------ re-ranker files


class RerankerFileError(ValueError):
    """A re-ranker file is unreadable, corrupt, of another format or version, or malformed."""


def save_reranker(reranker: Any, path: str | os.PathLike[str], meta: dict[str, Any] | None = None) -> str:
    """Write a re-ranker file atomically (layout in the module docstring).

    Args:
        reranker: a :class:`~rfmem_fast.routing.rerank.LinearReranker`.
        path: the JSON file to write (its folder must exist).
        meta: JSON-serialisable facts (default: the re-ranker's own ``meta``).

    Returns:
        the path written (str).

    Raises:
        TypeError: not a LinearReranker, or ``meta`` not JSON-serialisable.
        OSError: the file cannot be written.
    """
    from .rerank import LinearReranker

    if not isinstance(reranker, LinearReranker):
        raise TypeError(f"reranker must be a rfmem_fast.routing.LinearReranker, got {type(reranker).__name__}")
    doc = {
        "format": RERANKER_FORMAT,
        "version": RERANKER_VERSION,
        "kind": reranker.kind,
        "params": reranker.params(),
        "meta": dict(reranker.meta if meta is None else meta),
    }
    return _write_atomic(doc, path)


def _parse_reranker(doc: Any, where: str) -> Any:
    from .rerank import LinearReranker

    _check_header(doc, where, RERANKER_FORMAT, RERANKER_VERSION, "reranker", ("kind", "params"), RerankerFileError)
    if doc["kind"] != LinearReranker.kind:
        raise RerankerFileError(f"{where}: unknown reranker kind {doc['kind']!r} (known: {[LinearReranker.kind]})")
    if not isinstance(doc["params"], dict):
        raise RerankerFileError(f"{where}: 'params' must be an object")
    meta = doc.get("meta") or {}
    try:
        return LinearReranker.from_params(doc["params"], meta if isinstance(meta, dict) else {})
    except (TypeError, ValueError) as e:
        raise RerankerFileError(f"{where}: malformed linear parameters: {e}") from None


def load_reranker(path: str | os.PathLike[str]) -> Any:
    """Read a re-ranker file (cached per path, modification time and size).

    Args:
        path: the JSON file.

    Returns:
        the :class:`~rfmem_fast.routing.rerank.LinearReranker` (its ``meta`` holds the file's).

    Raises:
        FileNotFoundError: no such file.
        RerankerFileError: (a ValueError) not JSON, another format, a newer version, an
            unknown kind, malformed parameters; the message names the file.
    """
    return _load_cached(path, "reranker", _parse_reranker, RerankerFileError)


# ------------------------------------------------------------------ a config's files


def resolve_router(config: Any) -> Router:
    """The router an :class:`~rfmem_fast.config.RFMemConfig` routes with.

    The search calls it for every call in mode "rfmem" that gets no ``router=`` argument
    (the file is read once: :func:`load_router` caches it).

    Args:
        config: the RFMemConfig (``router``: None or a router file path;
            ``theta_high`` / ``theta_low`` / ``tau`` and the probe settings).

    Returns:
        the router loaded from ``config.router`` and checked against the config's probe
        (:meth:`~rfmem_fast.routing.base.Router.check_config`) when set, else the spec's
        :class:`~rfmem_fast.routing.threshold.ThresholdRouter` with the config's thresholds.

    Raises:
        FileNotFoundError: ``router`` names no file.
        ValueError: the file is corrupt / of another version (RouterFileError), or was
            made for another probe (probe_k, temperature, entropy); the message starts
            with "RFMemConfig.router: ".
    """
    if config.router is None:
        return ThresholdRouter.from_config(config)
    try:
        r = load_router(config.router)
        r.check_config(config)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"RFMemConfig.router: {e}") from None
    return r


def resolve_reranker(config: Any) -> Any:
    """The re-ranker of an :class:`~rfmem_fast.config.RFMemConfig` (``config.reranker``'s file), or None.

    Args:
        config: the RFMemConfig (``reranker``: None or a re-ranker file path).

    Returns:
        the :class:`~rfmem_fast.routing.rerank.LinearReranker` loaded from the file
        (cached by :func:`load_reranker`), or None when ``reranker`` is None.

    Raises:
        FileNotFoundError: ``reranker`` names no file.
        ValueError: the file is corrupt, of another version or malformed
            (RerankerFileError); the message starts with "RFMemConfig.reranker: ".
    """
    if config.reranker is None:
        return None
    try:
        return load_reranker(config.reranker)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"RFMemConfig.reranker: {e}") from None


def check_config_files(config: Any) -> None:
    """Load and check a config's router and re-ranker files now (:func:`resolve_router`,
    :func:`resolve_reranker`), so that a bad file fails when a Memory or a command opens,
    not at its first search.

    Raises:
        FileNotFoundError / ValueError: as :func:`resolve_router` and :func:`resolve_reranker`.
    """
    if config.router is not None:
        resolve_router(config)
    resolve_reranker(config)
