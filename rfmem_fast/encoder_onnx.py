"""The ONNX Runtime side of :class:`rfmem_fast.encoders.TextEncoder` (``backend="onnx"``):
``_OnnxRunner``, the sessions over the graphs :mod:`rfmem_fast.onnx_export` exports and
caches, and the token counts that route a text to the int8 graph
(:data:`INT8_MAX_TOKENS`) or to torch bfloat16 (:data:`LONG_TEXT_TOKENS`).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ._optional import require
from .encoder_passes import _passes

#: ONNX int8 encoder: texts of at most this many tokens (special tokens included) run in
#: the int8 graph, longer ones in the float32 graph (:class:`_OnnxRunner`). int8
#: (``MatMulNBits``) pays where a pass has few rows, its weights a quarter of float32's
#: to stream: 2.0x less CPU per token than float32 for one 16-token text, 1.2x at 64
#: tokens, even at ~100-1000 rows, and 1.1-1.3x *more* for passes of long texts (256
#: tokens: one text 1.0x, 16 texts 1.1x, 64 chunks 1.3x; one core, AMD EPYC with
#: AVX512-VNNI). Queries are short (PersonaBench questions: 16 tokens on average),
#: memories and chunks long.
INT8_MAX_TOKENS = 64

#: ONNX float32 encoder with ``long_texts="torch"``: texts of more than this many tokens run in
#: torch bfloat16 (with int8: more than :data:`INT8_MAX_TOKENS`). Above it torch's bfloat16
#: pass wins even for one text alone (113 tokens: 15.5 against 22.9 ms, AMX Xeon); below,
#: a rare long query would pay torch's per-op overhead in a server's batch (its p99 at 1
#: and 8 clients rose from ~16 / 48 to ~24 / 60 ms with a 64-token split)
LONG_TEXT_TOKENS = 128


class _OnnxRunner:
    """ONNX Runtime sessions over the exported graphs of a sentence-transformers model.

    Tokenises with the model's own ``preprocess`` (the same ids, truncation and padding
    as the torch path), in the passes of :func:`_passes` (as the torch path),
    runs the graph (masked mean pooling inside) and L2-normalises in float32.

    ``dtype="float32"``: one session, the float32 graph. ``dtype="int8"``: two sessions,
    the int8 graph for texts of at most :data:`INT8_MAX_TOKENS` tokens and the float32
    graph for longer ones (where int8 does not pay), both exported and loaded here; a
    pass holds texts of one side only, so which graph embeds a text depends on the text
    alone, never on the others encoded with it. ``long_torch`` (a callable
    ``f(features, m) -> float32 [m, d]``: :class:`TextEncoder` ``long_texts="torch"``):
    the texts over :data:`LONG_TEXT_TOKENS` tokens (int8: :data:`INT8_MAX_TOKENS`) go to it instead of a float32 graph
    (for int8 no float32 session is loaded then).

    Threads: ``intra_op_num_threads = num_threads``, by default
    ``torch.get_num_threads()`` (the torch encoder's count, so both backends use the
    same cores; :class:`TextEncoder` ``num_threads`` to share the cores out between
    encoders); the pool's threads never spin (``session.intra_op.allow_spinning`` = 0),
    whatever ``OMP_WAIT_POLICY`` says.
    """

    def __init__(self, st_model: Any, model_path: str, dtype: str, dim: int, num_threads: int | None = None,
                 long_torch: Any = None) -> None:
        from .onnx_export import onnx_model_file

        ort = require("onnxruntime", "onnx", "TextEncoder(backend='onnx')")
        import torch

        self.file = onnx_model_file(st_model, model_path, dtype)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.num_threads = int(num_threads) if num_threads is not None else max(1, int(torch.get_num_threads()))
        opts.intra_op_num_threads = self.num_threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        # never spin: with 2 threads on 2 shared cores, spinning between and after runs
        # cost 2-2.5x the CPU per text and more wall time (load ~3.7, one-text calls:
        # 8.7-11.3 against 4.2-4.5 ms CPU per text); without it, CPU as with 1 thread
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = ["CPUExecutionProvider"]
        self._session = ort.InferenceSession(self.file, opts, providers=providers)
        #: the session for texts longer than INT8_MAX_TOKENS (the float32 graph), or None
        self._long: Any = None
        self.long_file: str | None = None
        #: ``f(features, m) -> [m, d]``: the torch pass for texts longer than INT8_MAX_TOKENS, or None
        self._long_torch = long_torch
        self._int8 = dtype == "int8"
        if dtype == "int8" and long_torch is None:
            self.long_file = onnx_model_file(st_model, model_path, "float32")
            self._long = ort.InferenceSession(self.long_file, opts, providers=providers)
        self._inputs = [i.name for i in self._session.get_inputs()]
        self._st = st_model
        self._dim = dim

    def encode(self, items: list[str], batch_size: int) -> np.ndarray:
        """``items`` (n >= 1 str) -> float32 ``[n, d]`` unit rows, in input order: the
        passes of :func:`_passes` (int8: split at :data:`INT8_MAX_TOKENS` tokens, the
        longer texts in the float32 graph), L2-normalised in float32."""
        out = np.empty((len(items), self._dim), dtype=np.float32)
        split = (INT8_MAX_TOKENS if self._int8 else LONG_TEXT_TOKENS) if self._long_torch is not None else (
            INT8_MAX_TOKENS if self._long is not None else None)
        for rows, feats, long in _passes(self._st, items, batch_size, split):
            if long and self._long_torch is not None:
                emb = self._long_torch(feats, len(rows))
            else:
                feed = {name: (np.zeros(tuple(feats["attention_mask"].shape), dtype=np.int64) if feats.get(name) is None
                               else np.ascontiguousarray(feats[name].numpy().astype(np.int64, copy=False)))
                        for name in self._inputs}
                emb = (self._long if long else self._session).run(None, feed)[0]
            out[rows] = emb
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out
