"""Benchmark loaders (RFMEM_SPEC.md section 6).

Re-exports the PersonaBench loader and its data model from
:mod:`rfmem_fast.datasets.personabench`.
"""

from __future__ import annotations

from rfmem_fast.datasets.personabench import (
    PRIVATE_FILES,
    REMOVED_KEYS,
    SUBJECTIVE,
    PBQuestion,
    PBUser,
    PersonaBench,
    chunk_text,
    load_personabench,
    noise_tag,
    resolve_synthetic_dir,
    strip_keys,
)

__all__ = [
    "PBQuestion",
    "PBUser",
    "PersonaBench",
    "load_personabench",
    "resolve_synthetic_dir",
    "noise_tag",
    "strip_keys",
    "chunk_text",
    "REMOVED_KEYS",
    "SUBJECTIVE",
    "PRIVATE_FILES",
]
