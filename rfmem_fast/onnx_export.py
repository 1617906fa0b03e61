"""Local ONNX export of a sentence-transformers encoder, cached per model.

:class:`rfmem_fast.encoders.TextEncoder` with ``backend="onnx"`` runs the model in ONNX
Runtime. The ONNX graph is made here, from the local model folder's own weights; nothing
is downloaded (sentence-transformers' ``backend="onnx"`` goes through optimum, whose
releases pin ``transformers < 4.58`` and would downgrade the transformers 5 this
package runs with, so the export is done directly with torch and onnxruntime's tools):

1. ``torch.onnx.export`` (the TorchScript exporter, opset 17, dynamic batch and
   sequence axes) of the model's transformer with eager attention, followed by the
   masked mean pooling: inputs ``input_ids`` / ``attention_mask`` (/ ``token_type_ids``),
   int64 ``[b, s]``; output ``sentence_embedding``, float32 ``[b, d]`` (not yet
   normalised);
2. for a BERT model, onnxruntime's transformer optimizer
   (``onnxruntime.transformers.optimizer.optimize_model``): fused attention,
   EmbedLayerNormalization, SkipLayerNormalization and BiasGelu kernels, float32;
3. ``dtype="int8"``: blockwise 8-bit weights with int8 arithmetic
   (``onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer``: ``MatMulNBits``
   nodes, ``bits=8``, symmetric, :data:`INT8_BLOCK` = 16 weights of the input dimension
   per scale, ``accuracy_level=4``: each token's activations are quantised to int8 per
   block of 16 inputs when multiplied, in the same node) of every encoder ``MatMul``
   except the attention *value* projections, which stay float32. The graph it starts
   from is the float32 export of step 1 fused in step 2 into ``MultiHeadAttention``
   (``FusionOptions.use_multi_head_attention``), whose query / key / value projections
   are separate ``MatMul`` nodes (the ``Attention`` node of the float32 graph holds the
   three in one weight). Measured on PersonaBench's questions (1 - cosine to the float32
   encoder, mean; docs/benchmarks/serving.md "Encoder runtimes"):
   every MatMul in blocks of 32, 3.5e-4 (of which the
   value projections alone 1.7e-4, the query and key ones 1e-5 together, the
   feed-forward up / down projections 1.0e-4 / 0.5e-4); value projections in float32,
   1.8e-4; the same with blocks of 16, 1.2e-4 (this recipe: cosine >= 0.9997), at the
   same speed within the noise. Speed against the float32 graph, one core: 2x less CPU
   per token for one 16-token text (its weights, a quarter of the bytes, are what such
   a pass streams), the same from ~100 rows per pass on, and 1.1-1.3x more for passes
   of long texts: :class:`rfmem_fast.encoders.TextEncoder` runs texts over
   ``INT8_MAX_TOKENS`` tokens in the float32 graph. The scales are per
   token and block, so an int8 embedding does not depend on the other texts of its pass
   (as float32: cosine > 0.9999999 between a text alone and in a batch). Tried and
   dropped: ``quantize_dynamic`` (per-channel int8 weights, one uint8 activation scale
   per tensor and call, the feed-forward down-projections in float32; the recipe of
   format 1): cosine >= 0.992, routes as float32's on 98.5 % of PersonaBench questions,
   embeddings that depend on the pass.

Each graph is written once per model content, onnxruntime version and recipe, under
:func:`onnx_cache_dir` ``/<model fingerprint>-<dtype>-ort<version>-v<recipe>/model.onnx``
(the recipe: :data:`RECIPE_VERSIONS`)
(:func:`rfmem_fast.models.model_fingerprint`), atomically: it is built in a temporary
sibling folder that is renamed into place, so a reader sees the complete folder or
none, and two processes exporting at once both end with the same complete graph (the
loser's folder is discarded). In one process a graph is looked up, or exported, once
(:func:`onnx_model_file` memoises it under a lock).

Packages: ``onnxruntime`` and ``onnx`` (extra ``onnx``: ``pip install "rfmem_fast[onnx]"``).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Iterator

from ._optional import require

__all__ = ["ONNX_DTYPES", "FORMAT_VERSION", "RECIPE_VERSIONS", "INT8_BLOCK", "onnx_cache_dir",
           "onnx_model_file", "onnx_available"]

#: the precisions an ONNX graph is exported in
ONNX_DTYPES = ("float32", "int8")
#: recipe of the float32 graph, bumped when it changes (part of its cache key)
FORMAT_VERSION = 1
#: recipe version per precision (part of the cache key): int8 2 = MatMulNBits (module
#: docstring, step 3); 1 was ``quantize_dynamic``
RECIPE_VERSIONS = {"float32": FORMAT_VERSION, "int8": 2}
#: int8 graph: weights (and activations) per scale, along the input dimension
INT8_BLOCK = 16

_MEMO: dict[tuple[str, str, str], str] = {}
_MEMO_LOCK = threading.Lock()


def onnx_available() -> bool:
    """Whether the ONNX backend can run here: ``onnxruntime`` and ``onnx`` import.

    Returns:
        bool (never raises).
    """
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except Exception:  # ImportError, or a broken binary install
        return False
    return True


def onnx_cache_dir() -> Path:
    """Folder of the exported graphs: ``$RFMEM_ONNX_CACHE`` if set, else
    ``$XDG_CACHE_HOME/rfmem_fast/onnx`` (default ``~/.cache/rfmem_fast/onnx``)."""
    from ._paths import cache_subdir

    return cache_subdir("onnx", "RFMEM_ONNX_CACHE")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the exporter's / optimizer's / quantizer's warnings and log lines for the block."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


def _check_exportable(st_model: Any) -> tuple[Any, str]:
    """The transformer (a ``transformers`` model) of a Transformer -> mean Pooling
    (-> Normalize) sentence-transformers pipeline, and its pooling mode.

    Raises:
        ValueError: another pipeline (other modules, or pooling other than mean).
    """
    kinds = [type(m).__name__ for m in st_model]
    if kinds[:2] != ["Transformer", "Pooling"] or any(k != "Normalize" for k in kinds[2:]):
        raise ValueError(
            "backend='onnx' exports Transformer -> Pooling (-> Normalize) sentence-transformers "
            f"models only; this one is {kinds}: use backend='torch'"
        )
    mode = getattr(st_model[1], "pooling_mode", None)
    if mode != "mean":
        raise ValueError(f"backend='onnx' supports mean pooling only; this model pools with {mode!r}: use backend='torch'")
    hf = getattr(st_model[0], "auto_model", None) or getattr(st_model[0], "model")
    return hf, mode


def _export_raw(st_model: Any, raw: Path) -> tuple[list[str], Any]:
    """Step 1 of the module docstring: the unfused float32 graph at ``raw``; returns
    (input names, the transformers config)."""
    import torch

    hf, _ = _check_exportable(st_model)
    sample = st_model.preprocess(["an example sentence to trace", "another one"])
    names = [k for k in ("input_ids", "attention_mask", "token_type_ids") if isinstance(sample.get(k), torch.Tensor)]
    if "input_ids" not in names or "attention_mask" not in names:
        raise ValueError("backend='onnx' needs a tokenizer that gives input_ids and attention_mask")

    class Pooled(torch.nn.Module):
        def __init__(self, m: Any) -> None:
            super().__init__()
            self.m = m

        def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
            feed = dict(zip(names, inputs))
            h = self.m(**feed).last_hidden_state
            mask = feed["attention_mask"].unsqueeze(-1).to(h.dtype)
            return (h * mask).sum(1) / mask.sum(1).clamp(min=1e-9)

    set_attn = getattr(hf, "set_attn_implementation", None)
    before = getattr(hf.config, "_attn_implementation", None)
    try:
        if set_attn is not None:
            set_attn("eager")  # the pattern onnxruntime's optimizer fuses into one Attention op
        with _quiet(), torch.no_grad():
            torch.onnx.export(
                Pooled(hf).eval(), tuple(sample[k] for k in names), str(raw),
                input_names=names, output_names=["sentence_embedding"],
                dynamic_axes={**{k: {0: "batch", 1: "sequence"} for k in names}, "sentence_embedding": {0: "batch"}},
                opset_version=17, dynamo=False,
            )
    finally:
        if set_attn is not None and before is not None:
            set_attn(before)
    return names, hf.config


def _fuse_bert(raw: Path, cfg: Any, multi_head: bool) -> Any:
    """Step 2: onnxruntime's BERT optimizer over ``raw``; ``multi_head``: attention as
    ``MultiHeadAttention`` with separate Q / K / V MatMuls (else one ``Attention`` node).
    Returns the optimizer's ``OnnxModel``."""
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    options = FusionOptions("bert")
    options.use_multi_head_attention = multi_head
    with _quiet():
        return optimize_model(str(raw), model_type="bert", num_heads=int(cfg.num_attention_heads),
                              hidden_size=int(cfg.hidden_size), opt_level=0, optimization_options=options)


def _export_float32(st_model: Any, out: Path) -> dict[str, Any]:
    """Write the float32 graph (steps 1-2 of the module docstring) to ``out``; returns its info."""
    raw = out.with_name("raw.onnx")
    names, cfg = _export_raw(st_model, raw)
    fused = False
    if getattr(cfg, "model_type", None) == "bert":
        _fuse_bert(raw, cfg, multi_head=False).save_model_to_file(str(out))
        raw.unlink()
        fused = True
    else:
        os.replace(raw, out)
    return {"inputs": names, "fused": fused, "model_type": getattr(cfg, "model_type", None)}


def _value_matmuls(graph: Any) -> list[str]:
    """Names of the MatMul nodes that make the value input of each ``MultiHeadAttention``
    node of ``graph`` (directly, or through one bias ``Add``)."""
    producer = {o: n for n in graph.node for o in n.output}
    found = []
    for node in graph.node:
        if node.op_type != "MultiHeadAttention" or len(node.input) < 3:
            continue
        src = producer.get(node.input[2])
        if src is not None and src.op_type == "Add":
            src = next((producer[i] for i in src.input if i in producer and producer[i].op_type == "MatMul"), None)
        if src is not None and src.op_type == "MatMul":
            found.append(src.name)
    return found


def _nbits_quantizer() -> Any:
    """``MatMulNBitsQuantizer``, imported without its module's side effect: that module
    calls ``logging.basicConfig(level=INFO)`` on import (a handler on the root logger
    and its level set to INFO, for the whole process); the root logger's handlers and
    level are put back as they were."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    finally:
        for h in list(root.handlers):
            if h not in handlers:
                root.removeHandler(h)
        root.setLevel(level)
    return MatMulNBitsQuantizer


def _export_int8(st_model: Any, out: Path) -> dict[str, Any]:
    """Write the int8 graph (step 3 of the module docstring) to ``out``; returns its info.

    Raises:
        ValueError: a model that is not BERT-like (no ``MultiHeadAttention`` fusion, so no
            value projections to keep in float32): use dtype "float32".
    """
    import onnx

    MatMulNBitsQuantizer = _nbits_quantizer()
    raw = out.with_name("raw.onnx")
    names, cfg = _export_raw(st_model, raw)
    if getattr(cfg, "model_type", None) != "bert":
        raise ValueError(f"dtype='int8' supports BERT encoders only; this model is {getattr(cfg, 'model_type', None)!r}: "
                         "use dtype='float32'")
    model = _fuse_bert(raw, cfg, multi_head=True).model
    raw.unlink()
    graph = model.graph
    value = _value_matmuls(graph)
    layers = int(cfg.num_hidden_layers)
    if len(value) != layers:
        raise ValueError(f"dtype='int8': found {len(value)} attention value projections in the fused graph, "
                         f"expected {layers} (one per layer): use dtype='float32'")
    with _quiet():
        q = MatMulNBitsQuantizer(model, bits=8, block_size=INT8_BLOCK, is_symmetric=True, accuracy_level=4,
                                 nodes_to_exclude=value)
        q.process()
        onnx.save(q.model.model, str(out))
    kinds = [n.op_type for n in onnx.load(str(out), load_external_data=False).graph.node]
    return {"inputs": names, "fused": True, "model_type": "bert",
            "quantized": f"MatMulNBits bits=8 block_size={INT8_BLOCK} symmetric accuracy_level=4",
            "int8_matmuls": kinds.count("MatMulNBits"), "float32_matmuls": value}


def _key(fingerprint: str, dtype: str) -> str:
    import onnxruntime

    return f"{fingerprint}-{dtype}-ort{onnxruntime.__version__}-v{RECIPE_VERSIONS[dtype]}"


def _build_atomically(root: Path, key: str, build: Any) -> Path:
    """``root/key/model.onnx``, made by ``build(folder: Path) -> dict`` in a temporary
    sibling folder renamed into place (the first complete folder wins a race)."""
    final = root / key
    if (final / "model.onnx").is_file():
        return final / "model.onnx"
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{key}.tmp-"))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would outlive the rename
        info = build(tmp)
        (tmp / "info.json").write_text(json.dumps(info, indent=1), encoding="utf-8")
        if final.exists() and not (final / "model.onnx").is_file():  # a folder left incomplete by hand
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:  # another process renamed its complete folder first: use that one
            if not (final / "model.onnx").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final / "model.onnx"


def onnx_model_file(st_model: Any, model_path: str, dtype: str = "float32",
                    cache_dir: str | os.PathLike[str] | None = None) -> str:
    """The ONNX graph of a loaded sentence-transformers model, exported on first use.

    Args:
        st_model: the ``SentenceTransformer`` loaded (on the CPU, float32) from
            ``model_path``; its weights are what is exported.
        model_path: its local folder (the cache key is its
            :func:`~rfmem_fast.models.model_fingerprint`).
        dtype: "float32" or "int8" (:data:`ONNX_DTYPES`; module docstring).
        cache_dir: the cache root (default :func:`onnx_cache_dir`).

    Returns:
        the path (str) of ``<cache root>/<fingerprint>-<dtype>-ort<version>-v<recipe>/model.onnx``,
        complete (module docstring: atomic, reused by later calls and processes).

    Raises:
        ValueError: ``dtype`` not in :data:`ONNX_DTYPES`, or a model the export does
            not cover (modules other than Transformer -> mean Pooling -> Normalize;
            "int8": a transformer other than BERT).
        ImportError: ``onnxruntime`` / ``onnx`` missing (names the extra ``onnx``).
        OSError: the cache folder cannot be written.
    """
    if dtype not in ONNX_DTYPES:
        raise ValueError(f"dtype must be one of {ONNX_DTYPES} for an ONNX export, got {dtype!r}")
    require("onnxruntime", "onnx", "TextEncoder(backend='onnx')")
    require("onnx", "onnx", "TextEncoder(backend='onnx')")
    from .models import model_fingerprint

    root = Path(cache_dir) if cache_dir is not None else onnx_cache_dir()
    memo_key = (str(root.resolve()), os.path.abspath(model_path), dtype)
    with _MEMO_LOCK:
        hit = _MEMO.get(memo_key)
        if hit is not None and os.path.isfile(hit):
            return hit
        fp = model_fingerprint(model_path)
        _check_exportable(st_model)
        export = _export_int8 if dtype == "int8" else _export_float32  # each from the model's weights
        path = _build_atomically(root, _key(fp, dtype), lambda d: {
            "source": os.path.abspath(model_path), "fingerprint": fp, "dtype": dtype,
            **export(st_model, d / "model.onnx")})
        _MEMO[memo_key] = str(path)
        return str(path)
