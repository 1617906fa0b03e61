"""rfmem_fast: fast, batched, multi-tenant RF-Mem retrieval.

RF-Mem ("Evoking User Memory: Personalizing LLM via Recollection-Familiarity Adaptive
Retrieval", ICLR 2026) probes a user's memory with a top-k search, measures
familiarity (mean score, softmax entropy) and either returns the top-k (Familiarity
path) or recollects through rounds of KMeans-guided beam search (Recollection path).
The exact semantics are in ``RFMEM_SPEC.md``.

Public API::

    from rfmem_fast import MemoryBank, RFMemConfig, search
    bank = MemoryBank(dim=384)
    bank.add("alice", vectors, ids=["m1", "m2", ...])
    res = search(bank, queries, users=["alice", ...], config=RFMemConfig(), mode="rfmem")
    res.ids, res.scores, res.route_names, res.mean, res.entropy, res.rule_names, res.rounds

    from rfmem_fast import Memory          # text in, hits out (serving layer)
    mem = Memory("mem_dir")
    mem.add(["I moved to Lyon"], user_id="u1")
    hits = mem.search("where do I live?", user_id="u1")
"""
from __future__ import annotations

from .backends import available as available_backends
from .backends import get_backend
from .bank import BankSnapshot, MemoryBank
from .config import RFMemConfig
from .search import MODES, CandidatePools, SearchResult, search, search_candidates
from .serving import Memory
from .store import StoreError
from .threads import get_num_threads, set_num_threads

__version__ = "0.1.0"

__all__ = [
    "BankSnapshot",
    "CandidatePools",
    "Memory",
    "MemoryBank",
    "MODES",
    "RFMemConfig",
    "SearchResult",
    "StoreError",
    "available_backends",
    "get_backend",
    "get_num_threads",
    "search",
    "search_candidates",
    "set_num_threads",
    "__version__",
]
