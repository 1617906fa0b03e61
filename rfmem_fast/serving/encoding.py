"""Encoder workers and pooled encoding of a :class:`~rfmem_fast.serving.memory.Memory`:
how many encoder workers ``"auto"`` gives (:func:`default_encoder_workers`) and each one's
intra-op threads (:func:`encoder_threads`), and the Memory's encode calls (``_EncoderPool``):
borrowing a free encoder of the workers', sharing a lone batch over the idle ones, and
checking what an encoder returns (shape, dtype, zero / non-finite rows) before it is
searched or stored.

The default encoder itself is built by ``rfmem_fast.serving.memory._default_encoder``
(kept there: tests replace it), loaded on first use by ``Memory._get_encoder``.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import queue
import time
from typing import Any, Sequence

import numpy as np

from .._validate import as_float_matrix, l2_normalize_rows


#: dimension of the default encoder (all-MiniLM-L6-v2)
DEFAULT_DIM = 384


#: texts per forward pass of the default encoder. sentence-transformers sorts a call's
#: texts by length and pads each pass to its longest text: small passes keep padding
#: low, so a micro-batch of 64 questions costs ~2.7x less CPU per question than 64
#: single encodes, where passes of 64 cost MORE than single encodes (one 85-token
#: question pads 63 15-token ones).
ENCODE_BATCH_SIZE = 8


#: cores per encoder worker of "auto" (:func:`default_encoder_workers`)
CORES_PER_ENCODER_WORKER = 4


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS tells it,
    else ``os.cpu_count()``); int >= 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def default_encoder_workers(cores: int | None = None) -> int:
    """Encoder workers of ``encoder_workers="auto"`` (``rfmem serve`` default): the rule is
    one worker per :data:`CORES_PER_ENCODER_WORKER` (4) cores, at least one:
    ``max(1, cores // 4)``, so 1 up to 7 cores (each worker then gets
    :func:`encoder_threads`, all the cores, as ONNX Runtime / torch intra-op threads).

    Why (``docs/benchmarks/serving.md``, 2 cores): an encoder's intra-op threads run
    without the GIL, but each extra worker is a Python thread that needs the GIL back
    between its ONNX passes, next to the event loop and the search thread. Alone, two
    workers with one thread each encode faster than one worker with two (1.43 vs 1.62
    ms per question in batches of 32), but in the server on two shared cores the
    second worker served 14-36 % fewer closed-loop requests per second at 64 clients
    in five of seven runs (3 % and 19 % more in the other two) and won on open-loop
    tails in only some. Beyond 2 cores this rule is
    not measured: it keeps each worker's pass on 4 or more threads.

    Args:
        cores: the cores to plan for (default :func:`usable_cores`); int >= 1.

    Raises:
        ValueError: ``cores`` is not an int >= 1.
    """
    if cores is None:
        cores = usable_cores()
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise ValueError(f"cores must be an int >= 1, got {cores!r}")
    return max(1, cores // CORES_PER_ENCODER_WORKER)


def encoder_threads(workers: int, cores: int | None = None) -> int:
    """Intra-op threads of each of ``workers`` default encoders: the cores shared out,
    ``max(1, threads // workers)`` with ``threads`` = ``torch.get_num_threads()`` (what
    one encoder uses alone; it follows ``OMP_NUM_THREADS``), capped at ``cores``, so
    that the workers together never run more encoder threads than one encoder would."""
    import torch

    threads = max(1, int(torch.get_num_threads()))
    if cores is not None:
        threads = min(threads, cores)
    return max(1, threads // workers)


class _EncoderPool:
    """The encode calls of a :class:`~rfmem_fast.serving.memory.Memory` (a mixin of it: the
    methods read its encoder pool, counters and dimension)."""

    @staticmethod
    def _check_workers(workers: Any, encoder: Any, encoders: list | None, batching: bool, pipeline: bool) -> int:
        """The number of encoder workers (``encoder_workers`` checked against the rest).

        Raises:
            ValueError / TypeError: a bad value, or more than one worker without the
                default encoder (or a list of encoders), batching or the pipeline.
        """
        if not isinstance(pipeline, bool):
            raise TypeError(f"pipeline must be a bool, got {type(pipeline).__name__}")
        if workers is None or workers == "auto":
            if encoders is not None:
                return len(encoders)
            if workers is None or encoder is not None or not batching or not pipeline:
                return 1  # the default, one given encoder, or no pipeline: one worker
            return default_encoder_workers()
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"encoder_workers must be an int >= 1, 'auto' or None, got {workers!r}")
        if encoders is not None and workers != len(encoders):
            raise ValueError(f"encoder_workers={workers} but encoder is a list of {len(encoders)}: one per worker")
        if workers > 1:
            if encoder is False:
                raise ValueError(f"encoder_workers={workers} needs a text encoder; this Memory has encoder=False")
            if encoder is not None and encoders is None:
                raise ValueError(f"encoder_workers={workers} needs one encoder per worker: pass encoder=[...] "
                                 f"({workers} encoders) or the default encoder (encoder=None)")
            if not batching or not pipeline:
                raise ValueError(f"encoder_workers={workers} needs batching=True and pipeline=True "
                                 "(the workers are the pipeline's encode stage)")
        return workers

    @contextlib.contextmanager
    def _borrow_encoder(self) -> Any:
        """An encoder for one encode call: the only one, or a free one of the workers'
        (waits while all are busy); given back when the block ends."""
        enc = self._get_encoder()
        if len(self._encoders) < 2:
            yield enc
            return
        enc = self._pool.get()
        try:
            yield enc
        finally:
            self._pool.put(enc)

    def _encode_with(self, enc: Any, texts: list[str]) -> np.ndarray:
        """``enc.encode(texts)`` as a checked float array [len(texts), d].

        Raises:
            ValueError / TypeError: an output of the wrong shape / type."""
        raw = enc.encode(texts)
        if hasattr(raw, "detach"):
            raw = raw.detach().cpu().float().numpy()
        out = np.asarray(raw)
        if out.ndim != 2 or out.shape[0] != len(texts) or out.shape[1] != self.dim:
            raise ValueError(f"the encoder returned shape {out.shape}, expected ({len(texts)}, {self.dim})")
        if not np.issubdtype(out.dtype, np.floating):
            raise TypeError(f"the encoder returned {out.dtype} values, expected floats")
        return out

    def _encode_shared(self, texts: list[str]) -> np.ndarray:
        """Embed ``texts`` with a borrowed encoder, and with every other encoder idle now
        (work sharing: with ``encoder_workers`` > 1 a lone batch is split over the idle
        encoders, each part encoded at once, so one batch in flight still uses every
        worker's threads; busy workers are never waited for, and never more encoder
        threads run than the workers have). The parts are balanced by text length
        (length-sorted texts dealt round-robin); row i is ``texts[i]``'s embedding.

        Raises:
            What an encoder call raises (every part is finished first), ValueError /
            TypeError as :meth:`_encode_with`."""
        with self._borrow_encoder() as enc:
            idle = self._borrow_idle(len(texts) - 1)
            if not idle:
                return self._encode_with(enc, texts)
            try:
                order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
                k = len(idle) + 1
                parts = [order[j::k] for j in range(k)]
                futs = [self._helpers().submit(self._encode_with, e, [texts[i] for i in idx])
                        for e, idx in zip(idle, parts[1:])]
                try:
                    outs = [self._encode_with(enc, [texts[i] for i in parts[0]])]
                finally:
                    cf.wait(futs)  # every part done before its encoder goes back to the pool
                outs += [f.result() for f in futs]
            finally:
                for e in idle:
                    self._pool.put(e)
        out = np.empty((len(texts), self.dim), dtype=np.result_type(*outs))
        for idx, part in zip(parts, outs):
            out[idx] = part
        return out

    def _borrow_idle(self, most: int) -> list:
        """Up to ``most`` encoders free right now (never waits); give them back to the pool."""
        got: list = []
        if len(self._encoders) < 2:
            return got
        while len(got) < most:
            try:
                got.append(self._pool.get_nowait())
            except queue.Empty:
                break
        return got

    def _helpers(self) -> cf.ThreadPoolExecutor:
        """Threads that run the extra parts of a shared encode (one per extra encoder)."""
        if self._helper_pool is None:
            with self._encoder_lock:
                if self._helper_pool is None:
                    self._helper_pool = cf.ThreadPoolExecutor(max(1, len(self._encoders) - 1),
                                                              thread_name_prefix="rfmem-encode-helper")
        return self._helper_pool

    def _encode_rows(self, texts: list[str], name: str,
                     labels: Sequence[str] | None = None) -> list[np.ndarray | ValueError]:
        """One encoder call for ``texts``: per text its float32 [d] embedding, or a
        ValueError naming ``labels[i]`` (default ``name[i]``, or the query text) when
        the encoder returned a zero or non-finite row for it. Raises what the encoder
        call raises."""
        t0 = time.perf_counter()
        out = self._encode_shared(texts)
        dt = time.perf_counter() - t0
        with self._stats_lock:
            c = self._counters
            c["encode_calls"] += 1
            c["encoded"] += len(texts)
            c["encode_seconds"] += dt
        with np.errstate(over="ignore", invalid="ignore"):
            rows64 = out.astype(np.float64)
            norms = np.sqrt(np.einsum("ij,ij->i", rows64, rows64))
        rows: list[Any] = []
        for i, text in enumerate(texts):
            label = labels[i] if labels is not None else f"{name}[{i}]" if name != "query" else "query"
            if not np.isfinite(rows64[i]).all() or not np.isfinite(norms[i]) or norms[i] <= 1e-12 \
                    or np.abs(rows64[i]).max() > np.finfo(np.float32).max:
                rows.append(ValueError(
                    f"{label} {text[:60]!r}: the encoder returned a zero or non-finite embedding for this text, "
                    "so it cannot be searched or stored"))
            else:
                rows.append(out[i].astype(np.float32))
        return rows

    def _encode(self, texts: list[str], name: str = "texts", labels: Sequence[str] | None = None) -> np.ndarray:
        """float32 [n, d] embeddings of ``texts`` (one encoder call).

        Raises:
            ValueError: the encoder's row for ``labels[i]`` (default ``name[i]``) is
                zero or not finite (named)."""
        rows = self._encode_rows(texts, name, labels)
        for r in rows:
            if isinstance(r, BaseException):
                raise r
        return np.stack(rows) if rows else np.zeros((0, self.dim), np.float32)

    def _vectors(self, vectors: Any, name: str = "vectors") -> np.ndarray:
        """float32 [m, d] from a [m, d] or [d] array (rows checked, not yet normalised)."""
        arr = vectors
        if isinstance(arr, (str, bytes)):
            raise TypeError(f"{name} must be a float array, got {type(arr).__name__}")
        if not (hasattr(arr, "detach") or isinstance(arr, np.ndarray)):
            try:
                arr = np.asarray(arr)
            except (ValueError, TypeError) as exc:  # ragged nested lists
                raise ValueError(f"{name} must be a [m, d] or [d] array of floats: {exc}") from None
        if getattr(arr, "ndim", None) == 1:
            arr = arr[None, :]
        shape = getattr(arr, "shape", ())
        if self._dim_defaulted and len(shape) == 2 and shape[1] not in (0, self.dim):
            raise ValueError(f"{name} must have dimension {self.dim}, got {shape[1]}: this Memory has no encoder "
                             f"and no dim, so it took the default dimension {DEFAULT_DIM}; for {shape[1]}-dimensional "
                             f"vectors create it with dim={shape[1]} (Memory(..., encoder=False, dim={shape[1]}))")
        out = as_float_matrix(arr, name, self.dim)
        l2_normalize_rows(out, name)  # refuses zero rows now, before anything is logged
        return out
