"""Device-resident batches: memory checks, non-blocking copies and host-synchronisation audits.

A search whose queries already live on a GPU (``search(..., output="torch")`` with a CUDA
tensor) keeps them there: the bank is copied to the device once per bank version (the
backend's cached :class:`BankView`, in the bank's dtype), the
router runs on the device (:func:`rfmem_fast.routing.threshold.route_tensor`) and the results come
back as tensors on that device. This module holds what that path needs:

* :func:`free_device_memory` / :func:`check_fits`: a bank too large for the device's free
  memory is refused with :class:`DeviceMemoryError` (naming its size and the free memory
  reported by ``torch.cuda.mem_get_info``) BEFORE any allocation is tried;
* :func:`to_device`: a host array copied through pinned memory with ``non_blocking=True``
  (no host synchronisation, unlike a plain ``.to("cuda")`` of pageable memory);
* :func:`count_host_syncs`: counts the host synchronisations of a block of code. On a CUDA
  device it uses ``torch.cuda.set_sync_debug_mode("warn")`` (the real thing); elsewhere a
  :class:`torch.overrides.TorchFunctionMode` counts the calls that would synchronise on a
  GPU (``.item()``, ``bool()`` / ``int()`` / ``float()`` of a tensor, ``.tolist()``,
  ``.cpu()``, ``.numpy()``, ``nonzero``, ``unique``, ``masked_select``, boolean-mask
  indexing and assignment, ``repeat_interleave`` with tensor repeats, ``torch.tensor`` /
  ``as_tensor`` host-to-device copies), so that the CPU test suite pins the same budget
  (README "GPU").

Where the search path synchronises (documented budget, measured by ``bench/gpu_check.py``
and pinned by tests/test_device_resident.py):

* query validation: ONE synchronisation per :func:`rfmem_fast.search` call on tensor
  queries (NaN / Inf / zero rows are found on the device, then one flag is read);
* each recollection round: ONE synchronisation in the beam driver (the number of queries
  still active, which sizes the round's tensors; :func:`rfmem_fast.recollection.recollect`),
  plus those of the backend's primitives (top-k tiling, KMeans' convergence test), which the
  benchmark reports per backend;
* the final copy of the results to the host, only for ``output="numpy"``.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

_HALF_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}  # a view without a snapshot

from .bank import BankSnapshot
from .precision import row_norm_bound_from_scan, row_norm_max

__all__ = [
    "BankView",
    "DeviceMemoryError",
    "HostSyncCounter",
    "check_fits",
    "count_host_syncs",
    "free_device_memory",
    "to_device",
    "view_from_tensors",
]

#: share of the free device memory a bank copy may take (the rest is left for the
#: temporaries of the search itself)
DEFAULT_HEADROOM = 0.9


class DeviceMemoryError(MemoryError):
    """A bank (or another buffer) does not fit in the free memory of its device.

    Attributes:
        need_bytes: bytes the copy needs.
        free_bytes: bytes free on the device when it was checked.
        device: the device (str).
    """

    def __init__(self, message: str, need_bytes: int, free_bytes: int, device: str) -> None:
        super().__init__(message)
        self.need_bytes = int(need_bytes)
        self.free_bytes = int(free_bytes)
        self.device = device


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def free_device_memory(device: str | torch.device) -> int | None:
    """Free bytes on a device, or None where there is nothing to check (the CPU).

    Args:
        device: a torch device ("cuda", "cuda:1", "cpu", ...).

    Returns:
        int bytes free on a CUDA device (``torch.cuda.mem_get_info``), None otherwise.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    return None


def check_fits(need_bytes: int, device: str | torch.device, what: str, headroom: float = DEFAULT_HEADROOM) -> None:
    """Refuse a copy that would not fit in the device's free memory (before allocating it).

    Args:
        need_bytes: bytes the copy will allocate on the device.
        device: the target device.
        what: what is copied, for the message (e.g. "the bank (4,096,000 x 384 float32)").
        headroom: share of the free memory the copy may use (default 0.9).

    Raises:
        DeviceMemoryError: ``need_bytes > headroom * free`` (the message names both sizes,
            the device and what to do). Nothing is checked where :func:`free_device_memory`
            returns None (the CPU).
    """
    free = free_device_memory(device)
    if free is not None and need_bytes > headroom * free:
        raise DeviceMemoryError(
            f"{what} needs {_gib(need_bytes)} ({need_bytes:,} bytes) on {device}, but only "
            f"{_gib(free)} ({free:,} bytes) are free there (torch.cuda.mem_get_info; at most "
            f"{headroom:.0%} of it may be used): free device memory, store the bank in a "
            "smaller dtype, or shard the users (rfmem_fast.distributed)",
            need_bytes, free, str(device),
        )


def host_array(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """A C-contiguous host numpy view of tensor ``t`` as ``dtype`` (a copy only when needed:
    another dtype or device, strides, or grad).

    Args:
        t: any tensor; dtype: the torch dtype of the result.

    Returns:
        np.ndarray sharing ``t``'s memory when ``t`` is already a contiguous CPU tensor of
        ``dtype`` without grad, else a converted copy.
    """
    if t.dtype == dtype and t.device.type == "cpu" and not t.requires_grad and t.is_contiguous():
        return t.numpy()  # the common case, without four dispatcher round trips
    return t.detach().to("cpu", dtype).contiguous().numpy()


def to_device(array: np.ndarray | torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """A host array on ``device`` without a host synchronisation.

    On a CUDA device the data goes through a pinned staging buffer with
    ``non_blocking=True`` (a plain copy of pageable memory blocks the host until the copy
    is done); elsewhere it is a plain (zero-copy where possible) conversion.

    Args:
        array: numpy array or CPU tensor.
        device: target device.

    Returns:
        torch.Tensor on ``device`` (same dtype).
    """
    t = torch.from_numpy(np.ascontiguousarray(array)) if isinstance(array, np.ndarray) else array
    dev = device if isinstance(device, torch.device) else torch.device(device)
    if dev.type == "cpu" and isinstance(array, np.ndarray):
        return t  # (from_numpy made a CPU tensor: nothing to move)
    if dev.type != "cuda" or t.device.type == "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


# --------------------------------------------------------------------------- sync audits
#: torch functions that synchronise the host with a GPU whatever their arguments
_SYNC_ALWAYS = frozenset(
    {
        "item", "__bool__", "__int__", "__float__", "__index__", "__complex__", "tolist", "cpu", "numpy",
        "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select",
        "_local_scalar_dense", "equal", "allclose", "tensor", "as_tensor",
    }
)  # fmt: skip


def _is_bool_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.bool


def _syncs(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a call would synchronise the host with a GPU (see :func:`count_host_syncs`)."""
    if name in _SYNC_ALWAYS:
        return True
    if name in ("__getitem__", "__setitem__", "index_put_", "index_put"):
        idx = args[1] if len(args) > 1 else None
        parts = idx if isinstance(idx, (tuple, list)) else (idx,)
        return any(_is_bool_tensor(p) for p in parts)
    if name == "repeat_interleave":
        rep = args[1] if len(args) > 1 else kwargs.get("repeats")
        if rep is None and len(args) == 1 and isinstance(args[0], torch.Tensor):
            return True  # torch.repeat_interleave(counts)
        return isinstance(rep, torch.Tensor) and rep.numel() > 1 and kwargs.get("output_size") is None
    if name == "where":
        return len(args) == 1  # torch.where(cond): nonzero
    # ``.to(device)`` is not counted: on the CPU audit every tensor is on the one device
    # audited, and the code moves data to the host only through ``.cpu()`` / ``.numpy()``
    return False


class _SyncAuditMode(TorchFunctionMode):
    """Counts calls that would synchronise with a GPU (CPU stand-in for the sync debug mode)."""

    def __init__(self, counter: "HostSyncCounter") -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        if not self.counter._paused:
            name = getattr(func, "__name__", "")
            if _syncs(name, args, kwargs):
                self.counter._hit(name)
        return func(*args, **kwargs)


@dataclass
class HostSyncCounter:
    """Host synchronisations seen by :func:`count_host_syncs`.

    Attributes:
        count: synchronisations counted so far.
        events: the name of each (the torch function on the CPU audit; "cuda-sync" with
            the CUDA sync debug mode, whose warnings do not name the operation).
        method: "cuda-sync-debug-mode" or "cpu-audit".
    """

    count: int = 0
    events: list[str] = field(default_factory=list)
    method: str = "cpu-audit"
    _paused: bool = False

    def _hit(self, name: str) -> None:
        self.count += 1
        self.events.append(name)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Do not count inside this block (e.g. a backend primitive whose own syncs are
        accounted separately)."""
        was = self._paused
        self._paused = True
        mode = None
        if self.method == "cuda-sync-debug-mode":
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
        try:
            yield
        finally:
            self._paused = was
            if mode is not None:
                torch.cuda.set_sync_debug_mode(mode)


_SYNC_WARNING = "synchroniz"


@contextmanager
def count_host_syncs(device: str | torch.device | None = None) -> Iterator[HostSyncCounter]:
    """Count the host synchronisations of the enclosed code.

    On a CUDA device: ``torch.cuda.set_sync_debug_mode("warn")`` and the warnings it
    raises (the exact count of the synchronising CUDA calls torch makes). Elsewhere: a
    :class:`~torch.overrides.TorchFunctionMode` counting the calls that WOULD synchronise
    on a GPU (list in the module docstring), so that a CPU test can pin the budget.

    Args:
        device: where the code runs (default: CUDA when available).

    Yields:
        HostSyncCounter (``.count``, ``.events``; ``.paused()`` excludes a block).
    """
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        counter = HostSyncCounter(method="cuda-sync-debug-mode")
        old = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield counter
            finally:
                torch.cuda.set_sync_debug_mode(old)
        for w in caught:
            if _SYNC_WARNING in str(w.message):
                counter._hit("cuda-sync")
        return
    counter = HostSyncCounter(method="cpu-audit")
    with _SyncAuditMode(counter):
        yield counter


@dataclass(frozen=True)
class BankView:
    """A bank snapshot as one backend holds it (built by ``Backend.view`` or :func:`view_from_tensors`).

    Defined here, below the backends (``rfmem_fast.backends.base`` re-exports it), so that
    :func:`view_from_tensors` needs no backend.

    Attributes:
        X: float32 [n, d] unit rows (the exact copy the scores are defined on), on the
            backend's device; on the host (CPU) when ``Xs`` is a half-precision copy, so
            that a GPU holds only the scan copy.
        offsets: int64 [U + 1] CSR offsets on the backend's device.
        offsets_cpu: the same offsets as a CPU tensor (for host-side bookkeeping).
        snapshot: the bank snapshot it was made from (None for a view built from device
            tensors, :func:`rfmem_fast.device.view_from_tensors`).
        Xs: the scan copy of a float16 / bfloat16 bank (``torch.float16`` /
            ``torch.bfloat16`` [n, d] on the backend's device) for a backend that scans
            it (``Backend.scans_half``); None: the backend scans ``X``.
    """

    X: torch.Tensor
    offsets: torch.Tensor
    offsets_cpu: torch.Tensor
    snapshot: BankSnapshot | None
    Xs: torch.Tensor | None = None
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def scan(self) -> torch.Tensor:
        """The rows a scan reads: ``Xs`` when set, else ``X`` (float32)."""
        return self.X if self.Xs is None else self.Xs

    @property
    def scan_dtype(self) -> str:
        """"float32", or the half type of ``Xs`` (:mod:`rfmem_fast.precision`)."""
        if self.Xs is None:
            return "float32"
        return self.snapshot.dtype if self.snapshot is not None else _HALF_NAMES[self.Xs.dtype]

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """float32 rows ``X[idx]`` on ``idx``'s device (the exact copy; [*idx.shape, d])."""
        return self.X[idx.to(self.X.device)].to(idx.device)

    @property
    def row_norm_max(self) -> float:
        """An upper bound of the largest row norm of the float32 rows (computed once, cached).

        Used by the error bound of the exact top-k (:mod:`rfmem_fast.backends.exact`;
        the norm bounds are :func:`rfmem_fast.precision.row_norm_max` and
        :func:`rfmem_fast.precision.row_norm_bound_from_scan`).
        For a half-precision or int8 bank it is computed from the scan copy
        (:func:`rfmem_fast.precision.row_norm_bound_from_scan`), so that float32 rows
        memory-mapped from a store are not read. A view without a snapshot (built from
        device tensors) computes it where X lives: squared norms summed in float64
        (relative error <= d 2^-53), inflated to stay an upper bound.
        """
        if "xnorm" not in self._memo:
            snap = self.snapshot
            if snap is not None and snap.scan is not None:
                self._memo["xnorm"] = row_norm_bound_from_scan(snap.scan, snap.dtype, meta=snap.scan_meta)
            elif snap is not None:
                self._memo["xnorm"] = row_norm_max(snap.vectors)
            else:
                m = 0.0
                d = self.X.shape[1] if self.X.ndim == 2 else 1
                for a in range(0, self.X.shape[0], 1 << 16):
                    part = self.X[a : a + (1 << 16)].to(torch.float64)
                    m = max(m, float((part * part).sum(dim=1).max()))
                self._memo["xnorm"] = (m * (1.0 + (d + 2) * 2.0**-52)) ** 0.5 * (1.0 + 2.0**-30)
        return self._memo["xnorm"]



def view_from_tensors(X: torch.Tensor, offsets: Any, device: str | torch.device | None = None):
    """A :class:`BankView` over vectors that already live on a device.

    For banks generated or loaded straight on a GPU (``bench/gpu_check.py`` builds its
    multi-tenant banks this way), searched with :func:`rfmem_fast.search.search_tensors`:
    no host copy of the vectors exists, so results carry rows, not item ids.

    Args:
        X: [n, d] floating tensor of unit rows (float32 or float16), kept in its dtype.
        offsets: int [U + 1] CSR offsets (numpy, list or tensor), from 0 to n, non-decreasing.
        device: where the view lives (default: X's device); X is moved there when needed,
            after :func:`check_fits`.

    Returns:
        BankView with ``snapshot=None``.

    Raises:
        TypeError: X not a floating tensor. ValueError: X not 2-D, or bad offsets.
        DeviceMemoryError: X does not fit on ``device``.
    """
    if not isinstance(X, torch.Tensor) or not X.dtype.is_floating_point:
        raise TypeError(f"X must be a floating torch.Tensor, got {type(X).__name__} {getattr(X, 'dtype', '')}")
    if X.ndim != 2:
        raise ValueError(f"X must be 2-D [n, d], got shape {tuple(X.shape)}")
    off = torch.as_tensor(np.asarray(offsets.cpu() if isinstance(offsets, torch.Tensor) else offsets), dtype=torch.int64)
    if off.ndim != 1 or off.shape[0] < 1 or int(off[0]) != 0 or int(off[-1]) != X.shape[0] or bool((off[1:] < off[:-1]).any()):
        raise ValueError(f"offsets must be a non-decreasing int vector from 0 to n={X.shape[0]}")
    dev = torch.device(device) if device is not None else X.device
    if X.device != dev:
        check_fits(X.numel() * X.element_size(), dev, f"the vectors ({X.shape[0]:,} x {X.shape[1]} {X.dtype})")
    return BankView(X=X.to(dev).contiguous(), offsets=to_device(off, dev), offsets_cpu=off, snapshot=None)
