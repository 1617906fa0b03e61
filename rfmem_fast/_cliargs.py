"""Command-line helpers shared by ``rfmem`` (:mod:`rfmem_fast.cli`) and ``rfmem bench``
(:mod:`rfmem_fast.bench.cli`): an RFMemConfig from ``--preset`` and ``--set FIELD=VALUE``.

A module of its own so that neither command imports the other (the layers of
``docs/internals/layers.md``).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from .config import RFMemConfig
from .routing.files import check_config_files
from .second_stage import resolve_stage

__all__ = ["config_from_sets"]


def config_from_sets(sets: Sequence[str], preset: str = "default", encoder: str = "minilm") -> RFMemConfig:
    """RFMemConfig from a preset (``recommended`` for the given encoder alias) and
    ``FIELD=VALUE`` strings (values parsed as the field's type), its router and re-ranker
    files loaded and checked now (:func:`rfmem_fast.routing.files.check_config_files`).

    Args:
        sets: ``FIELD=VALUE`` strings (``--set``); ``router`` / ``reranker`` take a path
            or "none".
        preset: "default", "paper" or "recommended".
        encoder: the encoder alias of ``recommended`` ("minilm" or "mpnet").

    Returns:
        RFMemConfig.

    Raises:
        SystemExit: an unknown field, a value that does not parse, an invalid config,
            or a missing / bad router or re-ranker file (the message names the flag).
    """
    fields = {f.name: f for f in dataclasses.fields(RFMemConfig)}
    kwargs: dict[str, object] = {}
    for item in sets:
        name, sep, raw = item.partition("=")
        if not sep or name not in fields:
            raise SystemExit(f"--set expects FIELD=VALUE with FIELD one of {sorted(fields)}, got {item!r}")
        default = getattr(RFMemConfig(), name)
        try:
            if default is None:  # router: a path, or "none"
                kwargs[name] = None if raw.lower() in ("", "none") else raw
            else:
                kwargs[name] = type(default)(raw) if not isinstance(default, str) else raw
        except ValueError:
            raise SystemExit(f"--set {name}: cannot parse {raw!r} as {type(default).__name__}") from None
    try:
        if preset == "recommended":
            config = RFMemConfig.recommended(encoder, **kwargs)
        else:
            config = (RFMemConfig.paper if preset == "paper" else RFMemConfig)(**kwargs)
        check_config_files(config)  # a bad file fails before any work starts
        resolve_stage(config)
    except (TypeError, ValueError, FileNotFoundError) as e:
        raise SystemExit(f"--set / --preset: {e}") from None
    return config
