"""Datasets embedded with a sentence encoder, cached on disk (RFMEM_SPEC.md section 6).

:func:`dataset_embeddings` embeds the items and questions of any dataset of the loader
interface (:mod:`rfmem_fast.datasets.base`: PersonaBench, LoCoMo, LongMemEval) and
builds its memory bank; :func:`personabench_embeddings` loads a PersonaBench split and
does the same (its cache files are those of earlier versions: ``personabench-<hash>.npz``). The embeddings are cached as one ``.npz`` per
(encoder, data) pair: the file name is a hash of the encoder's identity (the
:func:`rfmem_fast.models.model_fingerprint` of its folder: content of its config
files and sizes of its weights) and of every chunk and question text, so a second run
with the same encoder and data reads the file instead of encoding, and any change of
either misses the cache. Writes are atomic (temporary file + rename); an unreadable
cache file is ignored and rewritten.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..bank import MemoryBank
from .base import user_threads
from .personabench import PersonaBench, load_personabench

__all__ = [
    "PersonaBenchEmbeddings", "personabench_embeddings", "DatasetEmbeddings", "dataset_embeddings",
    "default_embedding_cache_dir", "encoder_identity",
]  # fmt: skip


def default_embedding_cache_dir() -> Path:
    """Embedding cache folder of the evaluation and tuning jobs.

    ``$RFMEM_CACHE`` if set, else ``$XDG_CACHE_HOME/rfmem_fast/embeddings`` (default
    ``~/.cache/rfmem_fast/embeddings``).
    """
    from .._paths import cache_subdir

    return cache_subdir("embeddings", "RFMEM_CACHE")


@dataclass
class PersonaBenchEmbeddings:
    """PersonaBench chunks and questions embedded with one encoder.

    Attributes:
        bank: MemoryBank, one user per PersonaBench user (key ``"{community}/{name}"``),
            item ids = segment ids, texts = chunk texts.
        Q: float32 [nq, d] unit question embeddings (every question, "Subjective" too).
        users: nq user keys, ``users[i]`` owns question i.
        n_users, n_chunks: sizes.
        encode_chunks_s: seconds to embed the chunks (measured when they were
            encoded, possibly by an earlier run whose cache was reused).
        encode_questions_s: seconds to embed the questions in one batch (likewise).
        cached: True when the embeddings came from the cache.
        cache_file: the cache file used or written (None without a cache).
        model: the encoder's model folder or name.
        model_id: the identity the cache is keyed by (fingerprint or name).
        data: the loaded :class:`PersonaBench` (questions with their ground truth).
    """

    bank: MemoryBank
    Q: np.ndarray
    users: list[str]
    n_users: int
    n_chunks: int
    encode_chunks_s: float
    encode_questions_s: float
    cached: bool
    cache_file: str | None
    model: str
    model_id: str = ""
    data: PersonaBench | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _cache_key(texts: Sequence[str], questions: Sequence[str], model: str) -> str:
    h = hashlib.sha256()
    h.update(model.encode())
    for t in (*texts, "\x00", *questions):
        h.update(t.encode("utf-8", "surrogatepass"))
        h.update(b"\x1f")
    return h.hexdigest()[:24]


def encoder_identity(encoder: Any) -> tuple[str, str, Any]:
    """(model name or folder, cache identity, encoder object or None) of an encoder argument.

    Args:
        encoder: None or "minilm" (the bundled all-MiniLM-L6-v2), "mpnet", the path
            of a local sentence-transformers folder, or an object with
            ``encode(list[str]) -> float32 [n, d]`` (identified by its ``model_path``
            plus its ``dtype`` when not "float32" -- a bfloat16 TextEncoder gets
            its own cache entries -- and, for a runtime other than torch (its
            ``backend`` attribute, e.g. "onnx"), ``-{backend}-{dtype}`` and
            ``-long-{long_texts}`` when its long texts are not embedded by that
            runtime itself: an ONNX encoder embeds differently from the torch one
            at the same precision; else its ``model_name`` attribute or class name).

    Returns:
        (model, identity, obj): ``obj`` is the given object, or None when the
        encoder is to be loaded from the folder ``model`` (only if the cache misses).

    Raises:
        FileNotFoundError: a path that is not a folder, missing MPNet parts.
    """
    from ..models import model_fingerprint, resolve_model

    if encoder is None or isinstance(encoder, (str, os.PathLike)):
        folder = resolve_model(encoder)
        return folder, model_fingerprint(folder), None
    path = getattr(encoder, "model_path", None)
    if isinstance(path, str) and os.path.isdir(path):
        return path, model_fingerprint(path) + _runtime_suffix(encoder), encoder
    name = str(getattr(encoder, "model_name", None) or type(encoder).__name__)
    return name, name, encoder


def _runtime_suffix(encoder: Any) -> str:
    """The part of a model-folder encoder's cache identity that tells its runtime and precision:
    "" for torch float32 (the reference), ``-{dtype}`` for another torch precision,
    ``-{backend}-{dtype}`` (plus ``-long-{long_texts}`` where the long texts go elsewhere)
    for another runtime. Attributes that are absent or not str count as torch / float32."""
    dtype = getattr(encoder, "dtype", None)
    dtype = dtype if isinstance(dtype, str) else "float32"
    backend = getattr(encoder, "backend", None)
    if not isinstance(backend, str) or backend == "torch":
        return "" if dtype == "float32" else f"-{dtype}"
    long_texts = getattr(encoder, "long_texts", None)
    long_part = f"-long-{long_texts}" if isinstance(long_texts, str) and long_texts != backend else ""
    return f"-{backend}-{dtype}{long_part}"


@dataclass
class DatasetEmbeddings:
    """Any dataset (:mod:`rfmem_fast.datasets.base`) embedded with one encoder, its bank built.

    Attributes:
        bank: MemoryBank, one tenant per dataset user (``user.key``), item ids and texts
            as the dataset lists them.
        Q: float32 [nq, d] unit question embeddings, one row per ``dataset.questions``
            entry (unscored ones too), same order.
        users: nq user keys, ``users[i] == dataset.questions[i].user_key``.
        dataset: the dataset.
        n_users, n_items: sizes.
        encode_items_s / encode_questions_s: seconds spent encoding (when encoded,
            possibly by an earlier run whose cache was reused).
        cached: True when the embeddings came from the cache.
        cache_file: the cache file used or written (None without a cache).
        model / model_id: the encoder's folder or name, and the identity the cache is keyed by.
    """

    bank: MemoryBank
    Q: np.ndarray
    users: list[str]
    dataset: Any
    n_users: int
    n_items: int
    encode_items_s: float
    encode_questions_s: float
    cached: bool
    cache_file: str | None
    model: str
    model_id: str = ""


def _embed_cached(
    prefix: str,
    texts: Sequence[str],
    qtexts: Sequence[str],
    encoder: Any,
    cache_dir: str | os.PathLike[str] | None,
    say: Callable[[str], None],
    dedup: bool,
) -> tuple[np.ndarray, np.ndarray, float, float, bool, Path | None, str, str]:
    """(X, Q, encode_items_s, encode_questions_s, cached, cache_file, model, model_id).

    The cache file is ``{prefix}-{hash}.npz``, the hash over the encoder identity and
    every item and question text (in order). With ``dedup`` each distinct text is
    encoded once (items and questions separately).
    """
    model, model_id, enc = encoder_identity(encoder)
    key = _cache_key(texts, qtexts, model_id)
    cache_file = Path(cache_dir) / f"{prefix}-{key}.npz" if cache_dir is not None else None
    X = Q = None
    enc_c = enc_q = float("nan")
    cached = False
    if cache_file is not None and cache_file.is_file():
        try:
            with np.load(cache_file) as z:
                X, Q = z["X"], z["Q"]
                meta = json.loads(str(z["meta"]))
            if X.shape[0] != len(texts) or Q.shape[0] != len(qtexts):
                raise ValueError("cache shape mismatch")
            enc_c, enc_q = float(meta["encode_chunks_s"]), float(meta["encode_questions_s"])
            cached = True
            say(f"{prefix}: embeddings from cache {cache_file}")
        except (OSError, KeyError, ValueError):
            X = Q = None
    if X is None or Q is None:
        if enc is None:
            from ..encoders import TextEncoder

            say(f"{prefix}: loading the encoder {model}")
            enc = TextEncoder(model)

        def run(items: Sequence[str]) -> np.ndarray:
            if not dedup:
                return np.asarray(enc.encode(list(items)), dtype=np.float32)
            uniq = list(dict.fromkeys(items))
            pos = {t: i for i, t in enumerate(uniq)}
            E = np.asarray(enc.encode(uniq), dtype=np.float32)
            return E[np.fromiter((pos[t] for t in items), dtype=np.int64, count=len(items))]

        say(f"{prefix}: encoding {len(texts)} items and {len(qtexts)} questions with {model}")
        t0 = time.perf_counter()
        X = run(texts)
        enc_c = time.perf_counter() - t0
        t0 = time.perf_counter()
        Q = run(qtexts)
        enc_q = time.perf_counter() - t0
        if cache_file is not None:
            try:
                cache_file.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache_file.with_name(cache_file.name + f".{os.getpid()}.tmp.npz")
                meta = {"encode_chunks_s": enc_c, "encode_questions_s": enc_q, "model": model, "model_id": model_id}
                np.savez(tmp, X=X, Q=Q, meta=np.array(json.dumps(meta)))
                os.replace(tmp, cache_file)
            except OSError as e:  # a read-only cache is not an error
                say(f"{prefix}: cannot write the cache ({e})")
    return X, Q, enc_c, enc_q, cached, cache_file, model, model_id


#: the lexical stemmer of the evaluation banks (the one RFMemConfig.recommended() was tuned with)
EVAL_STEMMER = "english"


def _build_bank(users: Sequence[Any], X: np.ndarray, lexical_stemmer: str | None = EVAL_STEMMER) -> MemoryBank:
    """One tenant per user: its items' rows of ``X`` (in order), ids, texts, and threads and
    positions where the loader gives them (:func:`rfmem_fast.datasets.base.user_threads`)."""
    bank = MemoryBank(X.shape[1], lexical_stemmer=lexical_stemmer)
    pos = 0
    for u in users:
        n = len(u.item_ids)
        threads, positions = user_threads(u)
        bank.add(u.key, X[pos : pos + n], list(u.item_ids), texts=list(u.item_texts), threads=threads,
                 positions=positions)  # fmt: skip
        pos += n
    bank.snapshot()
    return bank


def dataset_embeddings(
    dataset: Any,
    encoder: Any = None,
    cache_dir: str | os.PathLike[str] | None = None,
    say: Callable[[str], None] | None = None,
    dedup: bool | None = None,
    lexical_stemmer: str | None = EVAL_STEMMER,
) -> DatasetEmbeddings:
    """Embed a dataset's items and questions (cached) and build its memory bank.

    Args:
        dataset: a dataset of the loader interface (:class:`rfmem_fast.datasets.base.MemoryDataset`:
            ``name``, ``users`` with ``key`` / ``item_ids`` / ``item_texts``,
            ``questions`` with ``text`` / ``user_key``).
        encoder: see :func:`encoder_identity` (default: the offline MiniLM, loaded
            only when the cache misses).
        cache_dir: folder of the embedding cache (``{dataset.name}-<hash>.npz``, the
            hash over the encoder identity and every text); None disables the cache.
        say: optional callable receiving status lines.
        lexical_stemmer: the stemmer of the bank's lexical index (default "english", the
            Snowball English stemmer of PyStemmer: what ``RFMemConfig.recommended()`` was
            tuned with; None: no stemming).
        dedup: encode each distinct text once (LongMemEval haystacks share sessions);
            None (default): True except for PersonaBench, whose cache files
            (``personabench-<hash>.npz``, the same key as :func:`personabench_embeddings`)
            hold the vectors of one encoding of every text in order.

    Returns:
        DatasetEmbeddings (X rows in user order, item order within a user).

    Raises:
        TypeError / ValueError: ``dataset`` does not follow the interface
            (:func:`rfmem_fast.datasets.base.check_dataset`); a user without items
            (the bank refuses an empty add).
        FileNotFoundError: as :func:`encoder_identity`.
    """
    from .base import check_dataset

    check_dataset(dataset)
    say = say or (lambda s: None)
    for u in dataset.users:
        if len(u.item_ids) == 0:
            raise ValueError(f"dataset {dataset.name!r}: user {u.key!r} has no items")
    texts = [t for u in dataset.users for t in u.item_texts]
    qtexts = [q.text for q in dataset.questions]
    if dedup is None:
        dedup = dataset.name != "personabench"
    X, Q, enc_c, enc_q, cached, cache_file, model, model_id = _embed_cached(
        str(dataset.name), texts, qtexts, encoder, cache_dir, say, bool(dedup)
    )
    bank = _build_bank(dataset.users, X, lexical_stemmer)
    return DatasetEmbeddings(
        bank=bank, Q=np.ascontiguousarray(Q, dtype=np.float32), users=[q.user_key for q in dataset.questions],
        dataset=dataset, n_users=len(dataset.users), n_items=len(texts), encode_items_s=enc_c,
        encode_questions_s=enc_q, cached=cached, cache_file=str(cache_file) if cache_file is not None else None,
        model=model, model_id=model_id,
    )  # fmt: skip


def personabench_embeddings(
    data_dir: str | os.PathLike[str],
    noise: float = 0.0,
    users_per_community: int = 3,
    encoder: Any = None,
    cache_dir: str | os.PathLike[str] | None = None,
    say: Callable[[str], None] | None = None,
) -> PersonaBenchEmbeddings:
    """Load PersonaBench (spec section 6) and embed its chunks and questions, cached.

    Args:
        data_dir: folder holding ``synthetic_data/``.
        noise: noise level of the private data.
        users_per_community: users per community (3 = the reference's 6 users).
        encoder: see :func:`encoder_identity` (default: the offline MiniLM, loaded
            only when the cache misses).
        cache_dir: folder of the embedding cache (``personabench-<hash>.npz``); None
            disables the cache.
        say: optional callable receiving status lines.

    Returns:
        PersonaBenchEmbeddings.

    Raises:
        FileNotFoundError / ValueError: as :func:`rfmem_fast.datasets.load_personabench`
            and :func:`encoder_identity`.
    """
    say = say or (lambda s: None)
    data = load_personabench(data_dir, noise=noise, users_per_community=users_per_community)
    texts = [t for u in data.users for t in u.chunk_texts]
    qtexts = [q.question for q in data.questions]
    # the same cache files as before the loader interface: prefix "personabench", no dedup
    X, Q, enc_c, enc_q, cached, cache_file, model, model_id = _embed_cached(
        "personabench", texts, qtexts, encoder, cache_dir, say, dedup=False
    )
    bank = _build_bank(data.users, X)
    return PersonaBenchEmbeddings(
        bank=bank,
        Q=np.ascontiguousarray(Q, dtype=np.float32),
        users=[q.user_key for q in data.questions],
        n_users=len(data.users),
        n_chunks=len(texts),
        encode_chunks_s=enc_c,
        encode_questions_s=enc_q,
        cached=cached,
        cache_file=str(cache_file) if cache_file is not None else None,
        model=model,
        model_id=model_id,
        data=data,
    )
