"""The comparators of the GPU benchmark (:mod:`rfmem_fast.bench.gpu`): faiss flat
inner-product search, one index per user (:class:`FaissFlat`: ``GpuIndexFlatIP`` on a
GPU, optionally with cuVS; faiss-cpu's ``IndexFlatIP`` as a stand-in elsewhere), and cuML's
``KMeans``.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from .._optional import require
from .gpu_data import sync


class FaissFlat:
    """faiss flat inner-product search, one index per user (``GpuIndexFlatIP`` on a GPU).

    On a CUDA device with faiss-gpu: ``GpuIndexFlatIP`` (optionally with cuVS), fed torch
    tensors through ``faiss.contrib.torch_utils`` (no host copies). Elsewhere (the dry
    run): faiss-cpu's ``IndexFlatIP`` on host copies, labelled as a stand-in.

    Args:
        device: the benchmark's device.
        use_cuvs: build the GPU indexes with ``use_cuvs=True``.

    Raises:
        ImportError: faiss is not installed (names the ``gpu`` extra).
        RuntimeError: ``use_cuvs`` where faiss has no cuVS, or a GPU device where faiss
            has no GPU support.
    """

    def __init__(self, device: torch.device, use_cuvs: bool = False) -> None:
        self.faiss = require("faiss", "gpu", "the faiss-gpu comparator of bench/gpu_check.py")
        self.device = device
        self.gpu = device.type == "cuda"
        if self.gpu:
            if not hasattr(self.faiss, "StandardGpuResources") or self.faiss.get_num_gpus() < 1:
                raise RuntimeError("faiss is installed without GPU support (install faiss-gpu: the [gpu] extra)")
            import faiss.contrib.torch_utils  # noqa: F401  (torch tensors in and out)

            self.res = self.faiss.StandardGpuResources()
            self.cfg = self.faiss.GpuIndexFlatConfig()
            self.cfg.device = device.index or 0
            if use_cuvs:
                if not hasattr(self.cfg, "use_cuvs"):
                    raise RuntimeError("this faiss has no cuVS support (GpuIndexFlatConfig.use_cuvs)")
                self.cfg.use_cuvs = True
        elif use_cuvs:
            raise RuntimeError("cuVS needs a GPU")
        self.use_cuvs = use_cuvs
        self.name = ("faiss-gpu+cuvs" if use_cuvs else "faiss-gpu") if self.gpu else "faiss-cpu"
        self.label = (
            ("faiss-gpu GpuIndexFlatIP" + (" (cuVS)" if use_cuvs else "")) if self.gpu
            else "faiss-cpu IndexFlatIP (stand-in)"
        )  # fmt: skip
        self.indexes: dict[int, Any] = {}

    def build(self, X: torch.Tensor, offsets: np.ndarray, users: list[int]) -> float:
        """Build one index per user in ``users``; returns the seconds it took."""
        t0 = time.perf_counter()
        d = X.shape[1]
        for u in users:
            a, b = int(offsets[u]), int(offsets[u + 1])
            if self.gpu:
                index = self.faiss.GpuIndexFlatIP(self.res, d, self.cfg)
                index.add(X[a:b].to(torch.float32).contiguous())
            else:
                index = self.faiss.IndexFlatIP(d)
                index.add(X[a:b].to(torch.float32).cpu().numpy())
            self.indexes[u] = index
        sync(self.device)
        return time.perf_counter() - t0

    def search(self, Q: torch.Tensor, qseg_host: np.ndarray, offsets: np.ndarray, k: int) -> torch.Tensor:
        """Dense top-k of each query in its user's index (grouped per user); global rows [b, k]."""
        rows = torch.full((Q.shape[0], k), -1, dtype=torch.int64, device=Q.device)
        order = np.argsort(qseg_host, kind="stable")
        cuts = np.flatnonzero(np.diff(qseg_host[order])) + 1
        for grp in np.split(order, cuts):
            u = int(qseg_host[grp[0]])
            idx = torch.from_numpy(grp).to(Q.device)
            if self.gpu:
                _, I = self.indexes[u].search(Q[idx], k)
            else:
                _, I = self.indexes[u].search(Q[idx].cpu().numpy(), k)
                I = torch.from_numpy(I).to(Q.device)
            rows[idx] = torch.where(I >= 0, I + int(offsets[u]), torch.full_like(I, -1))
        return rows

    def release(self) -> None:
        """Drop the indexes."""
        self.indexes = {}


def _cuml_kmeans():
    """cuML's KMeans class (ImportError naming the ``gpu`` extra when absent)."""
    return require("cuml.cluster", "gpu", "the cuML comparator of bench/gpu_check.py").KMeans
