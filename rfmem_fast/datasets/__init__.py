"""Benchmark loaders (RFMEM_SPEC.md section 6), behind one interface (:mod:`rfmem_fast.datasets.base`).

Re-exports the PersonaBench loader and its data model from
:mod:`rfmem_fast.datasets.personabench`, the LoCoMo loader
(:mod:`rfmem_fast.datasets.locomo`), the LongMemEval loader
(:mod:`rfmem_fast.datasets.longmemeval`) and the interface's classes.
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
from rfmem_fast.datasets.base import Dataset, MemoryDataset, MemoryQuestion, MemoryUser, Question, User, check_dataset
from rfmem_fast.datasets.locomo import load_locomo
from rfmem_fast.datasets.longmemeval import load_longmemeval

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
    "MemoryDataset",
    "MemoryUser",
    "MemoryQuestion",
    "Dataset",
    "User",
    "Question",
    "check_dataset",
    "load_locomo",
    "load_longmemeval",
]
