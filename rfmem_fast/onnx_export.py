"""Local ONNX export of a sentence-transformers encoder, cached per model (issue 21, item 1).

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
3. ``dtype="int8"``: dynamic quantisation (``onnxruntime.quantization.quantize_dynamic``)
   of the fused float32 graph: int8 weights per output channel (symmetric), uint8
   activations quantised per call, for the attention projections and every ``MatMul``
   except the feed-forward down-projections (``intermediate_size -> hidden_size``),
   which stay float32: quantising those too drops the cosine to the float32 encoder
   from >= 0.993 to 0.988 (questions and chunks of PersonaBench; per-tensor weights,
   the default of ``quantize_dynamic``, give 0.88). Quantising the attention output
   projections too, or leaving the attention's QKV in float32, changes little (routes
   as float32's on 98.9 % of PersonaBench questions either way, against 98.5 %).
   The activation scales are computed per pass, so an int8 embedding depends on the
   other texts of its pass a little more than a float32 one.

Each graph is written once per model content and onnxruntime version, under
:func:`onnx_cache_dir` ``/<model fingerprint>-<dtype>-ort<version>-v1/model.onnx``
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

__all__ = ["ONNX_DTYPES", "FORMAT_VERSION", "onnx_cache_dir", "onnx_model_file", "onnx_available"]

#: the precisions an ONNX graph is exported in
ONNX_DTYPES = ("float32", "int8")
#: bumped when the export recipe changes (part of the cache key)
FORMAT_VERSION = 1

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


def _export_float32(st_model: Any, out: Path) -> dict[str, Any]:
    """Write the float32 graph (steps 1-2 of the module docstring) to ``out``; returns its info."""
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
    raw = out.with_name("raw.onnx")
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
    cfg = hf.config
    fused = False
    if getattr(cfg, "model_type", None) == "bert":
        from onnxruntime.transformers.optimizer import optimize_model

        with _quiet():
            opt = optimize_model(str(raw), model_type="bert", num_heads=int(cfg.num_attention_heads),
                                 hidden_size=int(cfg.hidden_size), opt_level=0)
            opt.save_model_to_file(str(out))
        raw.unlink()
        fused = True
    else:
        os.replace(raw, out)
    return {"inputs": names, "fused": fused, "model_type": getattr(cfg, "model_type", None)}


def _quantize_int8(src: Path, out: Path, intermediate_size: int, hidden_size: int) -> dict[str, Any]:
    """Write the int8 graph (step 3 of the module docstring) of the float32 graph ``src``."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    graph = onnx.load(str(src), load_external_data=False).graph
    shapes = {i.name: tuple(i.dims) for i in graph.initializer}
    keep = [n.name for n in graph.node if n.op_type == "MatMul" and len(n.input) > 1
            and shapes.get(n.input[1]) == (intermediate_size, hidden_size)]
    with _quiet():
        quantize_dynamic(
            str(src), str(out), weight_type=QuantType.QInt8, per_channel=True,
            op_types_to_quantize=["MatMul", "Attention"], nodes_to_exclude=keep,
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )
    return {"quantized": "int8 per-channel weights, dynamic uint8 activations", "float32_nodes": keep}


def _key(fingerprint: str, dtype: str) -> str:
    import onnxruntime

    return f"{fingerprint}-{dtype}-ort{onnxruntime.__version__}-v{FORMAT_VERSION}"


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
        the path (str) of ``<cache root>/<fingerprint>-<dtype>-ort<version>-v1/model.onnx``,
        complete (module docstring: atomic, reused by later calls and processes).

    Raises:
        ValueError: ``dtype`` not in :data:`ONNX_DTYPES`, or a model the export does
            not cover (modules other than Transformer -> mean Pooling -> Normalize).
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
        f32 = _build_atomically(root, _key(fp, "float32"), lambda d: {
            "source": os.path.abspath(model_path), "fingerprint": fp, "dtype": "float32",
            **_export_float32(st_model, d / "model.onnx")})
        path = f32
        if dtype == "int8":
            cfg = _check_exportable(st_model)[0].config
            path = _build_atomically(root, _key(fp, "int8"), lambda d: {
                "source": os.path.abspath(model_path), "fingerprint": fp, "dtype": "int8", "from": str(f32),
                **_quantize_int8(f32, d / "model.onnx", int(cfg.intermediate_size), int(cfg.hidden_size))})
        _MEMO[memo_key] = str(path)
        return str(path)
