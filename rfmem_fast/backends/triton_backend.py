"""Triton backend: fused GPU kernels for the primitives (DESIGN.md, "Kernels worth fusing").

* ``segmented_topk`` / ``probe``: one fused kernel scores each query against its own
  user's CSR segment in ``BLOCK_N x BLOCK_D`` tiles (any d: the last tile is masked),
  keeps a running top-K in registers (K = the next power of two >= max(k, 16)) as packed
  (score, row) int64 keys whose order is the spec's (score descending, ties by the
  smaller row), and for ``probe`` also computes the familiarity signals (mean and
  entropy of the first ``probe_k`` scores, every convention of
  :func:`rfmem_fast.signals.familiarity_signals`) in the same kernel. No ``[b, n]``
  score matrix is ever written. Queries are grouped by segment on the host, and one
  program serves a tile of up to ``BLOCK_M`` queries of one segment, so that a bank
  tile loaded once serves all of them (DESIGN.md, "Cost model").
* ``batched_kmeans``: the k-means++ seeding is :func:`rfmem_fast.kmeans.kmeanspp_init`
  (scikit-learn's greedy seeding as tensor ops, the very code the torch backend runs,
  so both start from the same centres); the Lloyd iterations run in one kernel with
  one program per problem, iterated inside the kernel with the stopping rules of
  :func:`rfmem_fast.kmeans.lloyd` (labels repeat, or squared centre shift <=
  ``tol * mean variance``). Centroids are the member means of the final labels (0 for
  an empty cluster); padding labels are -1.
* ``alpha_mix``: one program per (branch, cluster), normalise + mix + normalise.

Where it runs. On a CUDA device (the default when ``torch.cuda.is_available()``) the
kernels are compiled by Triton. On the CPU they run only in Triton's interpreter, i.e.
when ``TRITON_INTERPRET=1`` is set in the environment; the variable is read at CALL
time (the kernel module is loaded once per mode, see :func:`_kernels`), so a test may
set it after ``rfmem_fast`` was imported. Triton itself binds its language library to
the interpreter or to the compiler at the first ``import triton`` of a process and
cannot mix the two afterwards (:func:`process_mode`; a clear RuntimeError says so).
The interpreter is slow and meant for tests. :func:`compile_kernels` runs the real
compiler down to cubins without a GPU (CI).

Fallbacks (documented, exact): a top-k wider than ``max_k`` (default 1024) and KMeans
problems with more than 128 points or 64 clusters go to the torch implementation on the
same device (the CUDA warp top-k of ``csrc/cuda`` is the tool for very large k).

Numerics. The kernel keeps the best ``max(16, next_pow2(k + 4))`` rows of each query by
its scan score; then the exact re-scoring of :mod:`rfmem_fast.backends.exact` (shared
with the torch backend: every kept row whose scan score can reach the k-th exact score
within the scan's proven error bound is re-scored exactly, and the rare query whose
kept list cannot prove it holds them all is rescanned by the torch implementation on
the same device). So the scores are exact (``RN32(q . x)``) and every backend returns
the same ids in the same tie order, independent of tiling and batch. With
``exact=True`` (the default) the scan accumulates in float64 and rounds once to
float32 (bound ~2 float32 ulps: the re-scored set is the near-ties only); with
``exact=False`` in float32 (``tl.dot`` with IEEE precision; bound gamma_d), faster
where float64 is slow. The probe's signals come from the kernel unless the re-scoring
changed the first ``probe_k`` (score, row) pairs of a query; those are recomputed by
:func:`rfmem_fast.signals.familiarity_signals`. KMeans (distances, means, tolerance)
and the alpha-mix run in float64 like their torch counterparts
(:func:`rfmem_fast.kmeans.lloyd`); a KMeans label can differ only for points
equidistant to two centres within float64 summation order (about 1e-16 relative).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

from .._optional import install_hint
from ..config import ENTROPY_CONVENTIONS
from ..kmeans import kmeanspp_init
from ..signals import familiarity_signals
from . import exact as _exact
from .base import DEFAULT_MEMORY_BUDGET, Backend, BankView
from .torch_backend import TorchBackend

_KERNELS_FILE = Path(__file__).with_name("_triton_kernels.py")
_LOCK = threading.Lock()
_KERNEL_MODULES: dict[bool, ModuleType] = {}
_IMPORTABLE: list[bool] = []

#: Largest KMeans problem run in the kernel (points, clusters); larger ones fall back.
KMEANS_MAX_POINTS = 128
KMEANS_MAX_CLUSTERS = 64


# --------------------------------------------------------------------------- availability
def _missing_triton() -> ImportError:
    """The error for a process without the ``triton`` package (names the extra)."""
    return ImportError(
        f"the triton backend needs the optional package 'triton': {install_hint('triton')}",
        name="triton",
    )


def triton_importable() -> bool:
    """True when the ``triton`` package is installed (checked once, without importing it)."""
    if not _IMPORTABLE:
        _IMPORTABLE.append(importlib.util.find_spec("triton") is not None)
    return _IMPORTABLE[0]


def interpret_mode() -> bool:
    """True when ``TRITON_INTERPRET`` is set to 1 / true / on (read now, at call time).

    This is the variable Triton reads when a kernel is defined. Note that Triton fixes
    the mode of its own library functions (``tl.sort``, ``tl.flip``, ...) when
    ``triton`` is FIRST imported in a process (see :func:`process_mode`).
    """
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")


def process_mode() -> bool | None:
    """Whether the imported ``triton`` runs its language library interpreted.

    Returns:
        True (interpreter), False (compiler), or None when triton is not imported yet
        (then the first import follows ``TRITON_INTERPRET``).
    """
    if "triton.language" not in sys.modules:
        return None
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.flip, InterpretedFunction)


def triton_available() -> bool:
    """True when the triton backend can run here: triton installed and either a CUDA
    device present or ``TRITON_INTERPRET=1`` (CPU interpreter) set."""
    return triton_importable() and (torch.cuda.is_available() or interpret_mode())


def extend_available(names: list[str]) -> list[str]:
    """Insert "triton" into a list of available backend names (used by ``backends.available``).

    On a CUDA machine with triton installed, "triton" goes first (it is what "auto"
    picks); on a CPU machine under ``TRITON_INTERPRET=1`` it goes last (listed, never
    picked by "auto"); otherwise the list is returned unchanged.

    Args:
        names: list of str, fastest first.

    Returns:
        a new list of str.
    """
    names = [n for n in names if n != "triton"]
    if not triton_available():
        return names
    if torch.cuda.is_available():
        return ["triton"] + names
    return names + ["triton"]


def _kernels(interpret: bool | None = None) -> ModuleType:
    """The kernel module for the current mode (compiled or interpreted).

    ``triton.jit`` binds a kernel to the interpreter or to the compiler when the kernel
    is defined, according to ``TRITON_INTERPRET`` at that moment; so
    ``_triton_kernels.py`` is executed into a private module for the mode asked for
    (cached). Triton's own library (``tl.sort``, ...) is bound once, at the first
    ``import triton`` of the process: when this function makes that first import, it
    makes it in the mode asked for; a later request for the other mode is refused.

    Args:
        interpret: the mode to load; None = the current ``TRITON_INTERPRET``.

    Raises:
        ImportError: triton is not installed (the message names the extra ``triton``).
        RuntimeError: triton was imported in the other mode.
    """
    mode = interpret_mode() if interpret is None else bool(interpret)
    mod = _KERNEL_MODULES.get(mode)
    if mod is not None:
        return mod
    if not triton_importable():
        raise _missing_triton()
    if process_mode() is None:  # first import of triton: in the mode asked for
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if mode else "0"
        try:
            import triton.language  # noqa: F401
        finally:
            if saved is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = saved
    if process_mode() != mode:
        raise RuntimeError(
            f"triton was first imported in this process {'with' if not mode else 'without'} "
            f"TRITON_INTERPRET=1, and Triton cannot mix its interpreter and its compiler in one "
            f"process; set TRITON_INTERPRET {'before' if mode else 'only in another process than'} "
            f"the first import of triton"
        )
    with _LOCK:
        mod = _KERNEL_MODULES.get(mode)
        if mod is None:
            name = f"{__package__}._triton_kernels_{'interp' if mode else 'jit'}"
            spec = importlib.util.spec_from_file_location(name, _KERNELS_FILE)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            saved = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1" if mode else "0"  # what triton.jit reads now
            try:
                spec.loader.exec_module(mod)
            except BaseException:
                sys.modules.pop(name, None)
                raise
            finally:
                if saved is None:
                    os.environ.pop("TRITON_INTERPRET", None)
                else:
                    os.environ["TRITON_INTERPRET"] = saved
            _KERNEL_MODULES[mode] = mod
    return mod


def compile_kernels(arch: int = 90, variants: list[tuple[str, dict]] | None = None) -> dict[str, str]:
    """Compile the kernels ahead of time for an NVIDIA target; no GPU or driver needed.

    Runs Triton's whole pipeline (TTIR, TTGIR, LLVM IR, PTX, cubin via the ptxas that
    ships with triton) on representative constexpr variants, so that CI on a CPU-only
    machine catches a kernel that would not compile on the GPU (the interpreter checks
    semantics only).

    Args:
        arch: compute capability as an int (80, 90, ...).
        variants: list of (kernel name, constexprs incl. "num_warps") or None for the
            default set (every kernel, exact and float32 top-k, small and large K).

    Returns:
        dict variant label -> size of the cubin in bytes.

    Raises:
        ImportError: triton is not installed (extra ``triton``).
        RuntimeError: this process imported triton under ``TRITON_INTERPRET=1`` (run
            it in a fresh process); compilation errors propagate.
    """
    if not triton_importable():
        raise _missing_triton()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kern = _kernels(interpret=False)  # a process whose triton is interpreted is refused here
    if variants is None:
        top = dict(K=16, BLOCK_M=1, BLOCK_N=64, BLOCK_D=16, EXACT=True, USE_DOT=False, SIGNALS=True, CONVENTION=0)
        variants = [
            ("segtopk_kernel", dict(top, num_warps=4)),
            ("segtopk_kernel", dict(top, SIGNALS=False, num_warps=4)),
            ("segtopk_kernel", dict(top, BLOCK_M=16, BLOCK_N=32, BLOCK_D=2, CONVENTION=2, num_warps=4)),
            ("segtopk_kernel", dict(top, BLOCK_M=16, BLOCK_N=32, BLOCK_D=16, EXACT=False, USE_DOT=True,
                                    CONVENTION=1, num_warps=4)),
            ("segtopk_kernel", dict(top, K=1024, BLOCK_N=1024, BLOCK_D=2, SIGNALS=False, num_warps=8)),
            ("kmeans_kernel", dict(NP=16, CP=4, BLOCK_D=32, num_warps=4)),
            ("kmeans_kernel", dict(NP=64, CP=16, BLOCK_D=2, num_warps=4)),
            ("alpha_mix_kernel", dict(BLOCK_D=512, num_warps=4)),
        ]
    target = GPUTarget("cuda", int(arch), 32)
    out: dict[str, str] = {}
    for name, consts in variants:
        consts = dict(consts)
        nw = consts.pop("num_warps", 4)
        fn = getattr(kern, name)
        src = ASTSource(fn=fn, signature=kern.SIGNATURES[name], constexprs=consts)
        compiled = triton.compile(src, target=target, options={"num_warps": nw, "enable_fp_fusion": False})
        label = f"{name}[{', '.join(f'{k}={v}' for k, v in consts.items())}, num_warps={nw}]"
        out[label] = len(compiled.asm["cubin"])
    return out


# --------------------------------------------------------------------------- helpers
def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _check_int(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return int(v)


def _check_tensor(name: str, t, ndim: int, floating: bool) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if floating and not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if not floating and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")


class TritonBackend(Backend):
    """Triton kernels for the four primitives (see the module docstring).

    Args:
        device: "cuda", "cuda:N" or "cpu" (the latter only with ``TRITON_INTERPRET=1``);
            default: CUDA when present, else CPU.
        block_m: queries of one segment per top-k program (a power of two <= 64), or
            None for a heuristic (1 when queries rarely share a user, up to 16).
        max_k: widest top-k run in the kernel (power of two); wider ones fall back to
            the torch implementation.
        num_warps: warps per program on the GPU (None: 4, or 8 for K >= 512).
        exact: True (default): the scan accumulates in float64 (a tight error bound,
            so almost nothing is re-scored); False: float32 accumulation (``tl.dot``
            for tiles of >= 16 queries), faster on GPUs with slow float64. The results
            are exact either way (module docstring "Numerics").
        memory_budget: bytes for the temporaries of the exact re-scoring and of the
            torch fallbacks (default 256 MiB).

    Raises:
        ValueError: an unsupported device type, or bad ``block_m`` / ``max_k`` /
            ``num_warps``.
        ImportError: triton is not installed (the message names the extra ``triton``).
        RuntimeError: CUDA is requested but not available, or the device is the CPU
            and ``TRITON_INTERPRET=1`` is not set.
    """

    name = "triton"

    def __init__(
        self,
        device: str | torch.device | None = None,
        block_m: int | None = None,
        max_k: int = 1024,
        num_warps: int | None = None,
        exact: bool = True,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must be a torch device such as 'cuda' or 'cpu', got {device!r}") from e
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"the triton backend runs on 'cuda' (or 'cpu' under TRITON_INTERPRET=1), got {device!r}")
        if block_m is not None:
            _check_int("block_m", block_m, 1)
            if block_m > 64 or block_m & (block_m - 1):
                raise ValueError(f"block_m must be a power of two <= 64, got {block_m}")
        _check_int("max_k", max_k, 1)
        if max_k & (max_k - 1) or max_k > 4096:
            raise ValueError(f"max_k must be a power of two <= 4096, got {max_k}")
        if num_warps is not None:
            _check_int("num_warps", num_warps, 1)
            if num_warps > 32 or num_warps & (num_warps - 1):
                raise ValueError(f"num_warps must be a power of two <= 32, got {num_warps}")
        if not isinstance(exact, bool):
            raise TypeError(f"exact must be a bool, got {type(exact).__name__}")
        self.exact = exact
        self.block_m = block_m
        self.max_k = int(max_k)
        self.num_warps = num_warps
        self._torch = TorchBackend(self.device, memory_budget=memory_budget)
        self.memory_budget = self._torch.memory_budget
        self._check_runnable(self.device)

    # ------------------------------------------------------------ plumbing
    @staticmethod
    def _check_runnable(dev: torch.device) -> None:
        if not triton_importable():
            raise _missing_triton()
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("the triton backend was asked for CUDA, but torch.cuda.is_available() is False")
        elif dev.type == "cpu":
            if not interpret_mode():
                raise RuntimeError(
                    "the triton backend runs on the CPU only in Triton's interpreter: "
                    "set TRITON_INTERPRET=1 (slow; for tests) or use a CUDA device"
                )
        else:
            raise ValueError(f"the triton backend cannot run on device {dev}")

    def _num_warps(self, K: int) -> int:
        return self.num_warps if self.num_warps is not None else (8 if K >= 512 else 4)

    def _check_view_query(self, view: BankView, Q, qseg, k) -> int:
        if not isinstance(view, BankView):
            raise TypeError(f"view must be a BankView, got {type(view).__name__}")
        _check_tensor("Q", Q, 2, floating=True)
        _check_tensor("qseg", qseg, 1, floating=False)
        k = _check_int("k", k, 1)
        if Q.shape[1] != view.X.shape[1]:
            raise ValueError(f"Q has dimension {Q.shape[1]} but the bank has {view.X.shape[1]}")
        if qseg.shape[0] != Q.shape[0]:
            raise ValueError(f"qseg has {qseg.shape[0]} entries but Q has {Q.shape[0]} rows")
        return k

    def _tiles(self, qseg: torch.Tensor, K: int):
        """Group the queries by segment into tiles of at most ``block_m`` queries.

        Returns:
            (block_m, perm [b], tile_seg [T], tile_q0 [T], tile_len [T]), int64 tensors:
            tile t serves the queries ``perm[tile_q0[t] : tile_q0[t] + tile_len[t]]``, all
            of segment ``tile_seg[t]``.
        """
        dev = qseg.device
        b = qseg.shape[0]
        sseg, perm = torch.sort(qseg, stable=True)
        new = torch.ones(b, dtype=torch.bool, device=dev)
        new[1:] = sseg[1:] != sseg[:-1]
        run_start = new.nonzero().squeeze(1)
        run_len = torch.diff(run_start, append=torch.tensor([b], device=dev))
        if self.block_m is not None:
            bm = self.block_m
        else:  # queries per user: group them only when several share a segment
            avg = b / max(1, run_start.numel())
            bm = 1 if (avg < 2 or K > 128) else min(16, _next_pow2(int(avg)))
        ntile = (run_len + bm - 1) // bm
        run_of_tile = torch.repeat_interleave(torch.arange(run_start.numel(), device=dev), ntile)
        first = torch.cumsum(ntile, 0) - ntile
        j = torch.arange(run_of_tile.numel(), device=dev) - first[run_of_tile]
        q0 = run_start[run_of_tile] + j * bm
        qlen = torch.clamp(run_start[run_of_tile] + run_len[run_of_tile] - q0, max=bm)
        return bm, perm.contiguous(), sseg[q0].contiguous(), q0.contiguous(), qlen.contiguous()

    def _topk_launch(self, view: BankView, Q, qseg, k: int, signals: tuple | None):
        """Run the fused kernel: (scores [b, k], rows [b, k], mean [b], entropy [b], count [b]).

        ``signals`` = (probe_k, temperature, convention index) or None (then the last
        three are zeros and the kernel skips the signals).
        """
        dev = view.X.device
        self._check_runnable(dev)
        kern = _kernels()
        X = view.X
        if X.dtype != torch.float32 or not X.is_contiguous():
            X = X.to(torch.float32).contiguous()
        off = view.offsets.to(dev, torch.int64)
        Q = Q.to(dev, torch.float32).contiguous()
        qseg = qseg.to(dev, torch.int64).contiguous()
        b, d = Q.shape
        U = off.shape[0] - 1
        scores = torch.full((b, k), float("-inf"), dtype=torch.float32, device=dev)
        rows = torch.full((b, k), -1, dtype=torch.int64, device=dev)
        mean = torch.zeros(b, dtype=torch.float64, device=dev)
        ent = torch.zeros(b, dtype=torch.float64, device=dev)
        count = torch.zeros(b, dtype=torch.int64, device=dev)
        if b == 0 or X.shape[0] == 0:
            return scores, rows, mean, ent, count
        if bool(((qseg < 0) | (qseg >= U)).any()):
            raise ValueError(f"qseg values must be segment indices in [0, {U})")
        K = max(16, _next_pow2(k))  # >= 16: fewer compiled variants, no degenerate 1-wide sorts
        bm, perm, tseg, tq0, tlen = self._tiles(qseg, K)
        block_n = max(K, 32 if bm > 1 else 64)
        use_dot = (not self.exact) and bm >= 16
        nw = self._num_warps(K)
        # elements of the [BLOCK_M, BLOCK_N, BLOCK_D] product per program: ~8 float64 (16
        # float32) per thread keeps sm_90 builds near 64-128 registers, no spills
        budget = (1024 if self.exact else 2048) * nw // 4
        bd = min(_next_pow2(d), 128, max(1, budget // (bm * block_n)))
        if use_dot:
            bd = max(bd, 16)
        if signals is None:
            probe_k, lam, conv, with_sig = 1, 1.0, 0, False
        else:
            probe_k, lam, conv, with_sig = signals[0], float(signals[1]), signals[2], True
        lam_t = torch.tensor([lam], dtype=torch.float64, device=dev)
        grid = (tseg.shape[0],)
        kern.segtopk_kernel[grid](
            Q, X, off, perm, tseg, tq0, tlen,
            scores, rows, mean, ent, count,
            d, k, Q.stride(0), X.stride(0), probe_k, lam_t,
            K=K, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_D=bd, EXACT=self.exact, USE_DOT=use_dot,
            SIGNALS=with_sig, CONVENTION=conv, num_warps=nw, enable_fp_fusion=not self.exact,
        )
        return scores, rows, mean, ent, count

    # ------------------------------------------------------------ primitives
    def segmented_topk(self, view: BankView, Q, qseg, k, sel=None):
        """Fused segmented top-k (see :meth:`Backend.segmented_topk`; DESIGN.md primitives).

        Args:
            view: the bank (its tensors' device is where the kernel runs).
            Q: float [b, d] queries.
            qseg: integer [b] segment index of each query, in [0, U).
            k: int >= 1.
            sel: optional RowSelection: the filtered queries run the kernel over the
                compacted view of their selected rows (:meth:`Backend.on_selection`).

        Returns:
            (scores float32 [b, k] descending, rows int64 [b, k]); ``-inf`` / ``-1``
            where the segment has fewer than k rows; ties by the smaller row.

        Raises:
            TypeError: non-tensor input or wrong dtype (float Q, integer qseg, int k).
            ValueError: wrong shapes, d mismatch, k < 1, qseg out of range.
            RuntimeError: the device cannot run Triton (see the class docstring).
        """
        if sel is not None:
            return self.on_selection(view, Q, qseg, sel, lambda v, q, s: self.segmented_topk(v, q, s, k))
        k = self._check_view_query(view, Q, qseg, k)
        kw = self._scan_width(k)
        if kw > self.max_k:
            self._check_runnable(view.X.device)
            return self._torch.segmented_topk(view, Q, qseg, k)
        s, r, _, _, _ = self._topk_launch(view, Q, qseg, kw, None)
        return self._finish(view, Q, qseg, k, s, r)

    @staticmethod
    def _scan_width(k: int) -> int:
        """Candidates the kernel keeps for a top-k: a power of two >= max(16, k + 4)."""
        return max(16, _next_pow2(k + 4))

    def _finish(self, view: BankView, Q, qseg, k: int, s, r):
        """The exact top-k from the kernel's candidates (:meth:`TorchBackend.finish_topk`)."""
        acc = _exact.U64 if self.exact else _exact.U32
        coef = _exact.scan_error_coef(Q.shape[1], acc)
        return self._torch.finish_topk(view, Q.to(view.X.device, torch.float32), qseg.to(view.X.device), k, s, r, coef)

    def probe(self, view, Q, qseg, k, probe_k, temperature, convention, sel=None):
        """Top-k plus the familiarity signals in ONE kernel (see :meth:`Backend.probe`).

        Args:
            view, Q, qseg, k, sel: as :meth:`segmented_topk`.
            probe_k: int in [1, k], the K of the signals (spec section 1).
            temperature: float > 0 (lam).
            convention: "mean" | "sum" | "normalized".

        Returns:
            (scores float32 [b, k], rows int64 [b, k], mean float64 [b], entropy
            float64 [b], count int64 [b]) on the view's device.

        Raises:
            TypeError / ValueError: as :meth:`segmented_topk`, plus probe_k outside
            [1, k], a non-positive temperature or an unknown convention.
        """
        if sel is not None:
            return self.on_selection(
                view, Q, qseg, sel, lambda v, q, s: self.probe(v, q, s, k, probe_k, temperature, convention)
            )
        k = self._check_view_query(view, Q, qseg, k)
        probe_k = _check_int("probe_k", probe_k, 1)
        if probe_k > k:
            raise ValueError(f"probe_k must be <= k, got probe_k={probe_k}, k={k}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise TypeError(f"temperature must be a float, got {type(temperature).__name__}")
        if not temperature > 0 or temperature != temperature or temperature == float("inf"):
            raise ValueError(f"temperature must be a finite float > 0, got {temperature}")
        if convention not in ENTROPY_CONVENTIONS:
            raise ValueError(f"convention must be one of {ENTROPY_CONVENTIONS}, got {convention!r}")
        kw = self._scan_width(k)
        if kw > self.max_k:
            self._check_runnable(view.X.device)
            return self._torch.probe(view, Q, qseg, k, probe_k, temperature, convention)
        conv = ENTROPY_CONVENTIONS.index(convention)
        s, r, mean, ent, cnt = self._topk_launch(view, Q, qseg, kw, (probe_k, float(temperature), conv))
        scores, rows = self._finish(view, Q, qseg, k, s, r)
        # the kernel's signals hold where the re-scoring left the first probe_k pairs as scanned
        changed = ((scores[:, :probe_k] != s[:, :probe_k]) | (rows[:, :probe_k] != r[:, :probe_k])).any(dim=1)
        if bool(changed.any()):
            idx = changed.nonzero().squeeze(1)
            m2, e2, c2 = familiarity_signals(scores[idx, :probe_k], float(temperature), convention)
            mean[idx], ent[idx], cnt[idx] = m2, e2, c2
        return scores, rows, mean, ent, cnt

    def batched_kmeans(self, V, counts, clusters, iters, tol, seed):
        """Many small KMeans problems: batched k-means++ seeding + in-kernel Lloyd.

        See :meth:`Backend.batched_kmeans` (spec section 4). Same seeding
        (:func:`rfmem_fast.kmeans.kmeanspp_init`), distance formula, tolerance and
        stopping rules as :meth:`TorchBackend.batched_kmeans` /
        :func:`rfmem_fast.kmeans.lloyd`, so the labels agree up to float rounding of
        near-equidistant points.

        Args:
            V: float [m, n, d] points; problem i uses ``V[i, :counts[i]]``.
            counts: integer [m], 1 <= counts[i] <= n.
            clusters: integer [m], 1 <= clusters[i] <= counts[i].
            iters: int >= 1, Lloyd iteration cap.
            tol: float >= 0, relative tolerance (times the mean variance of the points).
            seed: int >= 0, scikit-learn's ``random_state``.

        Returns:
            (labels int64 [m, n], -1 on padding; centroids float32 [m, c, d] with
            c = max(clusters), member means, 0 when empty or unused), on the backend's
            device.

        Raises:
            TypeError: wrong tensor types / dtypes, non-int iters or seed, non-float tol.
            ValueError: wrong shapes, counts / clusters out of range, negative tol or seed.
            RuntimeError: the device cannot run Triton.
        """
        _check_tensor("V", V, 3, floating=True)
        for nm, t in (("counts", counts), ("clusters", clusters)):
            _check_tensor(nm, t, 1, floating=False)
            if t.shape[0] != V.shape[0]:
                raise ValueError(f"{nm} has {t.shape[0]} entries but V holds {V.shape[0]} problems")
        iters = _check_int("iters", iters, 1)
        seed = _check_int("seed", seed, 0)
        if isinstance(tol, bool) or not isinstance(tol, (int, float)):
            raise TypeError(f"tol must be a float, got {type(tol).__name__}")
        if not tol >= 0:
            raise ValueError(f"tol must be >= 0, got {tol}")
        dev = self.device
        self._check_runnable(dev)
        V = V.to(dev, torch.float32).contiguous()
        counts = counts.to(dev, torch.int64).contiguous()
        clusters = clusters.to(dev, torch.int64).contiguous()
        m, n, d = V.shape
        if m == 0:
            return (
                torch.full((0, n), -1, dtype=torch.int64, device=dev),
                torch.zeros((0, 0, d), dtype=torch.float32, device=dev),
            )
        bad = (counts < 1) | (counts > n) | (clusters < 1) | (clusters > counts)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"problem {i}: need 1 <= counts <= n={n} and 1 <= clusters <= counts, "
                f"got counts={int(counts[i])}, clusters={int(clusters[i])}"
            )
        c_max = int(clusters.max())
        if n > KMEANS_MAX_POINTS or c_max > KMEANS_MAX_CLUSTERS:
            return self._torch.batched_kmeans(V, counts, clusters, iters, tol, seed)
        kern = _kernels()
        C = kmeanspp_init(V, counts, clusters, seed).to(torch.float64).contiguous()
        # per-problem tolerance, exactly as rfmem_fast.kmeans.lloyd: tol * mean variance (float64)
        V64 = V.to(torch.float64)
        pmask = torch.arange(n, device=dev)[None, :] < counts[:, None]
        cnt_f = counts.to(torch.float64)[:, None]
        mu = (V64 * pmask[:, :, None]).sum(dim=1) / cnt_f
        var = (((V64 - mu[:, None, :]) ** 2) * pmask[:, :, None]).sum(dim=1) / cnt_f
        tol_m = (tol * var.mean(dim=1)).contiguous()
        del V64
        labels = torch.empty((m, n), dtype=torch.int64, device=dev)
        NP, CP = max(16, _next_pow2(n)), max(4, _next_pow2(c_max))  # floors: fewer compiled variants
        kern.kmeans_kernel[(m,)](
            V, counts, clusters, tol_m, C, labels,
            n, c_max, d, iters,
            V.stride(0), V.stride(1), C.stride(0), C.stride(1),
            NP=NP, CP=CP, BLOCK_D=min(_next_pow2(d), max(1, 2048 // (NP * CP))),
            num_warps=4, enable_fp_fusion=False,
        )
        return labels, C.to(torch.float32)

    def alpha_mix(self, qb, centroids, q0, alpha):
        """Child queries of all branches in one kernel (see :meth:`Backend.alpha_mix`).

        Args:
            qb: float [m, d] branch queries.
            centroids: float [m, c, d] cluster means.
            q0: float [m, d] original queries.
            alpha: float in [0, 1].

        Returns:
            float32 [m, c, d] = normalise(alpha qb + (1 - alpha) normalise(c) + q0),
            ``normalise(v) = v / (||v|| + 1e-12)``.

        Raises:
            TypeError: non-tensor / non-floating inputs or non-float alpha.
            ValueError: mismatched shapes or alpha outside [0, 1].
            RuntimeError: the device cannot run Triton.
        """
        _check_tensor("qb", qb, 2, floating=True)
        _check_tensor("centroids", centroids, 3, floating=True)
        _check_tensor("q0", q0, 2, floating=True)
        m, c, d = centroids.shape
        if tuple(qb.shape) != (m, d) or tuple(q0.shape) != (m, d):
            raise ValueError(
                f"qb and q0 must be [m, d] = [{m}, {d}] to match centroids {tuple(centroids.shape)}, "
                f"got {tuple(qb.shape)} and {tuple(q0.shape)}"
            )
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise TypeError(f"alpha must be a float, got {type(alpha).__name__}")
        if not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        dev = self.device
        self._check_runnable(dev)
        out = torch.empty((m, c, d), dtype=torch.float32, device=dev)
        if m * c == 0 or d == 0:
            return out
        kern = _kernels()
        qb = qb.to(dev, torch.float32).contiguous()
        q0 = q0.to(dev, torch.float32).contiguous()
        cen = centroids.to(dev, torch.float32).contiguous()
        bd = min(1024, _next_pow2(d))
        alpha = float(alpha)
        params = torch.tensor([alpha, 1.0 - alpha, 1e-12], dtype=torch.float64, device=dev)
        kern.alpha_mix_kernel[(m * c,)](
            qb, cen, q0, out, params, c, d, BLOCK_D=bd, num_warps=4, enable_fp_fusion=False
        )
        return out


__all__ = [
    "TritonBackend",
    "compile_kernels",
    "extend_available",
    "interpret_mode",
    "process_mode",
    "triton_available",
    "triton_importable",
]
