"""Benchmark data: sizes, seeded synthetic clustered banks and queries, PersonaBench embeddings.

Synthetic data (DESIGN.md, "Benchmark workloads"): every user owns ``clusters`` random
unit centres in R^d; an item is ``normalise(centre + spread * g / sqrt(d))`` with
``g ~ N(0, I_d)`` and a uniformly drawn centre (so two items of one centre have a cosine
of about ``1 / (1 + spread^2)``). A query is one of two kinds, drawn with probability
``specific_frac``:

* *specific*: ``normalise(item + t * g / sqrt(d))`` around one of the user's items,
  ``t ~ U(specific_noise)``; its top score stands out, so the probe's entropy is low and
  RF-Mem takes the Familiarity path;
* *vague*: ``normalise(centre + t * g / sqrt(d))`` around one of the user's centres,
  ``t ~ U(vague_noise)``; many items score alike, so the entropy is high and most of
  these take the Recollection path.

With the defaults (d = 384, 8 centres, spread 1, half of each kind) about 60 % of the
queries go to familiarity, at every memory scale; the benchmark reports the split it
measured. Everything is float32 and reproducible from the seed.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..bank import MemoryBank
from ..datasets.embedded import PersonaBenchEmbeddings, personabench_embeddings  # noqa: F401  (re-exported)

#: rows generated per step when a large bank is built (bounds the temporary memory)
GEN_BLOCK_ROWS = 65536
#: items per centre of the shared bank (it gets ``max(clusters, n // this)`` centres)
SHARED_ITEMS_PER_CLUSTER = 512

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgG]?)\s*$")


def parse_size(text: str, binary: bool) -> int:
    """Parse a size such as ``"32K"``, ``"1M"``, ``"100000"`` or ``"1e5"``.

    Args:
        text: a number with an optional suffix K, M or G (case-insensitive).
        binary: True: K = 1024, M = 1024**2, G = 1024**3 (token scales: 32K = 32,768
            tokens = 128 chunks of 256); False: K = 1e3, M = 1e6, G = 1e9 (vector
            counts).

    Returns:
        int >= 1.

    Raises:
        ValueError: not a positive size.
    """
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 32K, 1M, 100000, 1e5)")
    base = 1024 if binary else 1000
    mult = {"": 1, "k": base, "m": base**2, "g": base**3}[m.group(2).lower()]
    value = float(m.group(1)) * mult
    if value < 1 or value != value:
        raise ValueError(f"size must be >= 1, got {text!r}")
    return int(round(value))


def parse_size_list(text: str, binary: bool) -> list[int]:
    """Parse a comma list of sizes (see :func:`parse_size`); order kept, duplicates dropped.

    Raises:
        ValueError: an empty list or a bad entry.
    """
    out: list[int] = []
    for part in str(text).split(","):
        if part.strip():
            v = parse_size(part, binary)
            if v not in out:
                out.append(v)
    if not out:
        raise ValueError(f"expected a comma list of sizes, got {text!r}")
    return out


def format_tokens(tokens: int) -> str:
    """A token count as the paper writes it: 32768 -> "32K", 1048576 -> "1M", 1000 -> "1000"."""
    for unit, mult in (("M", 1024**2), ("K", 1024)):
        if tokens >= mult and tokens % mult == 0:
            return f"{tokens // mult}{unit}"
    return str(tokens)


def format_count(n: int) -> str:
    """A vector count in short decimal form: 100000 -> "100K", 1000000 -> "1M", 2000 -> "2K"."""
    for unit, mult in (("M", 10**6), ("K", 10**3)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def chunks_for_tokens(tokens: int, chunk_tokens: int) -> int:
    """Memory chunks of one user for a token budget: ``max(1, round(tokens / chunk_tokens))``.

    Args:
        tokens: memory size in tokens (e.g. 1,048,576 for "1M").
        chunk_tokens: tokens per chunk (default of the benchmark: 256).

    Returns:
        int >= 1 (1M tokens at 256 per chunk = 4,096 chunks).
    """
    return max(1, int(round(tokens / chunk_tokens)))


# --------------------------------------------------------------------------- synthetic


@dataclass(frozen=True)
class SyntheticSpec:
    """Parameters of the synthetic clustered data (see the module docstring).

    Attributes:
        dim: vector dimension d.
        clusters: centres per user (the shared bank gets ``max(clusters, n // 512)``).
        spread: noise of an item around its centre (relative to the unit centre).
        specific_frac: probability that a query is *specific* (near an item).
        specific_noise: (low, high) noise range of specific queries.
        vague_noise: (low, high) noise range of vague queries (around a centre).
    """

    dim: int = 384
    clusters: int = 8
    spread: float = 1.0
    specific_frac: float = 0.5
    specific_noise: tuple[float, float] = (0.3, 1.5)
    vague_noise: tuple[float, float] = (0.5, 2.0)

    def to_dict(self) -> dict[str, Any]:
        """The parameters as a JSON-serialisable dict."""
        return {
            "dim": self.dim,
            "clusters": self.clusters,
            "spread": self.spread,
            "specific_frac": self.specific_frac,
            "specific_noise": list(self.specific_noise),
            "vague_noise": list(self.vague_noise),
        }


def _normalise_rows(x: np.ndarray) -> np.ndarray:
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def _centres(rng: np.random.Generator, c: int, d: int) -> np.ndarray:
    return _normalise_rows(rng.standard_normal((c, d), dtype=np.float32))


def _items(rng: np.random.Generator, centres: np.ndarray, n: int, spread: float) -> np.ndarray:
    d = centres.shape[1]
    lab = rng.integers(0, centres.shape[0], n)
    x = rng.standard_normal((n, d), dtype=np.float32)
    x *= np.float32(spread / np.sqrt(d))
    x += centres[lab]
    return _normalise_rows(x)


@dataclass
class SyntheticBank:
    """A seeded multi-tenant bank of clustered unit vectors.

    Attributes:
        bank: the MemoryBank (users ``"u0" .. "u{U-1}"``, item ids 0 .. n_u - 1).
        users: the user keys in segment order (list of str, length U).
        centres: float32 [U, C, d] unit centres of every user (C may differ per user
            only through the shared-bank rule; stored padded to the largest C).
        n_centres: int64 [U], centres per user.
        spec: the generating :class:`SyntheticSpec`.
        build_s: seconds spent generating and inserting (the CSR snapshot included).
    """

    bank: MemoryBank
    users: list[str]
    centres: np.ndarray
    n_centres: np.ndarray
    spec: SyntheticSpec
    build_s: float = 0.0

    @property
    def nbytes(self) -> int:
        """Bytes of the bank's float32 vectors (n x d x 4)."""
        return int(self.bank.num_items) * self.bank.dim * 4

    def queries(
        self, nq: int, seed: int, user_index: np.ndarray | None = None, labels: bool = False
    ) -> tuple[np.ndarray, ...]:
        """Seeded queries near the users' items (specific) or centres (vague).

        Args:
            nq: number of queries (int >= 1).
            seed: seed of this query set (independent of the bank's seed).
            user_index: optional int [nq] segment index of each query; default: a
                uniformly random user per query.
            labels: also return what generated each query (the same queries either way).

        Returns:
            (Q float32 [nq, d] unit rows, user_index int64 [nq], specific bool [nq]), plus
            with ``labels`` (item int64 [nq]: the bank row a specific query was drawn
            around, centre int64 [nq]: the centre index a vague query was drawn around;
            both are drawn for every query, only the one of its kind is used).
        """
        rng = np.random.default_rng([seed, 0x51E5])
        snap = self.bank.snapshot()
        U, d = len(self.users), self.bank.dim
        if user_index is None:
            user_index = rng.integers(0, U, nq)
        user_index = np.asarray(user_index, dtype=np.int64)
        sp = self.spec
        specific = rng.random(nq) < sp.specific_frac
        lo = snap.offsets[user_index]
        ln = snap.offsets[user_index + 1] - lo
        item = lo + (rng.random(nq) * ln).astype(np.int64)
        cen = (rng.random(nq) * self.n_centres[user_index]).astype(np.int64)
        t = np.where(
            specific, rng.uniform(*sp.specific_noise, nq), rng.uniform(*sp.vague_noise, nq)
        ).astype(np.float32)
        base = np.where(specific[:, None], snap.vectors[item], self.centres[user_index, cen])
        g = rng.standard_normal((nq, d), dtype=np.float32) * (t[:, None] / np.float32(np.sqrt(d)))
        Q = _normalise_rows((base + g).astype(np.float32))
        if labels:
            return np.ascontiguousarray(Q, dtype=np.float32), user_index, specific, item, cen
        return np.ascontiguousarray(Q, dtype=np.float32), user_index, specific


def synthetic_bank(
    n_users: int,
    n_items: int,
    spec: SyntheticSpec,
    seed: int,
    clusters: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> SyntheticBank:
    """Build a seeded bank of ``n_users`` users with ``n_items`` clustered unit vectors each.

    Rows are generated and inserted in blocks of at most :data:`GEN_BLOCK_ROWS`, so the
    peak memory is about twice the bank (the bank's blocks plus its CSR snapshot,
    which is built here).

    Args:
        n_users: U >= 1.
        n_items: items per user n >= 1.
        spec: data parameters (dimension, centres, spread).
        seed: seed of the bank (user u draws from ``default_rng([seed, u])``).
        clusters: centres per user (default ``spec.clusters``).
        progress: optional callable receiving the number of rows just added.

    Returns:
        SyntheticBank.

    Raises:
        ValueError: a size < 1.
    """
    if n_users < 1 or n_items < 1:
        raise ValueError(f"n_users and n_items must be >= 1, got {n_users}, {n_items}")
    c = int(clusters or spec.clusters)
    t0 = time.perf_counter()
    bank = MemoryBank(spec.dim)
    users = [f"u{u}" for u in range(n_users)]
    centres = np.empty((n_users, c, spec.dim), dtype=np.float32)
    for u, key in enumerate(users):
        rng = np.random.default_rng([seed, u])
        centres[u] = _centres(rng, c, spec.dim)
        for a in range(0, n_items, GEN_BLOCK_ROWS):
            b = min(n_items, a + GEN_BLOCK_ROWS)
            bank.add(key, _items(rng, centres[u], b - a, spec.spread), ids=range(a, b))
            if progress is not None:
                progress(b - a)
    bank.snapshot()
    return SyntheticBank(
        bank=bank,
        users=users,
        centres=centres,
        n_centres=np.full(n_users, c, dtype=np.int64),
        spec=spec,
        build_s=time.perf_counter() - t0,
    )


# --------------------------------------------------------------------------- synthetic texts
# Seeded synthetic texts for the lexical (BM25) channel: the hybrid rows of ``rfmem bench``
# and bench/bench_hybrid.py. An item's text is ``words`` Zipf(s) draws from a vocabulary
# of pseudo-words whose most frequent ranks are bm25s's English stopwords (removed by the
# tokenizer, as real function words are); a query text is a few words of one item's text
# plus a few Zipf draws.


@dataclass(frozen=True)
class TextSpec:
    """Parameters of the synthetic texts (see :func:`zipf_texts` and :func:`query_texts`).

    Attributes:
        words: words per item text (60: about a short memory chunk).
        vocab: vocabulary size (pseudo-words, rank order).
        zipf: Zipf exponent s of the word draws.
        query_item_words: words of the query's item text in a query text.
        query_extra_words: further Zipf draws in a query text.
        stemmer: the lexical stemmer of the text banks ("english", what
            ``RFMemConfig.recommended()`` was tuned with, or None); "english" falls back
            to None where PyStemmer is not installed.
    """

    words: int = 60
    vocab: int = 30000
    zipf: float = 1.07
    query_item_words: int = 3
    query_extra_words: int = 5
    stemmer: str | None = "english"

    def to_dict(self) -> dict[str, Any]:
        """The parameters as a JSON-serialisable dict."""
        return {
            "words": self.words, "vocab": self.vocab, "zipf": self.zipf, "query_item_words": self.query_item_words,
            "query_extra_words": self.query_extra_words, "stemmer": self.stemmer,
        }  # fmt: skip


def zipf_vocab(n: int) -> np.ndarray:
    """``n`` pseudo-words (rank order): bm25s's English stopwords first, then letter strings.

    Returns:
        object array [n] of str (``n`` >= the number of stopwords).
    """
    from ..lexical import STOPWORDS_EN

    stop = sorted(STOPWORDS_EN)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = []
    for i in range(n - len(stop)):
        s, x = "", i + 26
        while x:
            x, r = divmod(x, 26)
            s = letters[r] + s
        words.append("q" + s)
    return np.array(stop + words, dtype=object)


def zipf_texts(n: int, words: int, vocab: np.ndarray, s: float, rng: np.random.Generator) -> list[str]:
    """``n`` texts of ``words`` Zipf(s) draws from ``vocab`` (rank order), space-separated."""
    p = 1.0 / np.arange(1, vocab.shape[0] + 1) ** s
    p /= p.sum()
    out: list[str] = []
    for a in range(0, n, 65536):
        idx = rng.choice(vocab.shape[0], size=(min(n, a + 65536) - a, words), p=p)
        out += [" ".join(row) for row in vocab[idx]]
    return out


def query_texts(
    texts: list[str],
    n: int,
    vocab: np.ndarray,
    s: float,
    rng: np.random.Generator,
    items: np.ndarray | None = None,
    item_words: int = 3,
    extra_words: int = 5,
) -> list[str]:
    """Per query: ``item_words`` distinct words of one item's text + ``extra_words`` Zipf draws.

    Args:
        texts: the item texts (``zipf_texts``).
        n: number of query texts.
        vocab, s: as :func:`zipf_texts`.
        rng: the generator (consumed in a fixed order: reproducible).
        items: optional int [n] index into ``texts`` of each query's item (e.g. the item
            a synthetic query vector was drawn around); default a uniformly random item
            per query.
        item_words, extra_words: the query's composition.

    Returns:
        list of n str.
    """
    extra = zipf_texts(n, extra_words, vocab, s, rng)
    out = []
    for i in range(n):
        j = int(rng.integers(len(texts))) if items is None else int(items[i])
        w = texts[j].split()
        pick = rng.choice(len(w), min(item_words, len(w)), replace=False)
        out.append(" ".join([w[k] for k in pick]) + " " + extra[i])
    return out


def bank_with_texts(bank: MemoryBank, texts: list[str] | None, lexical_stemmer: str | None = None,
                    dtype: str = "float32") -> MemoryBank:  # fmt: skip
    """``bank`` rebuilt with ``texts`` (same vectors, offsets, users, item ids and row order),
    stored in ``dtype`` (``MemoryBank``'s dtypes: its scan copy; ValueError for another)."""
    s = bank.snapshot()
    return MemoryBank.from_arrays(
        s.vectors, s.offsets, list(s.users), list(s.item_ids), texts, lexical_stemmer=lexical_stemmer, dtype=dtype
    )


def text_stemmer(spec: TextSpec) -> str | None:
    """The stemmer a text bank of ``spec`` gets here: ``spec.stemmer``, or None without PyStemmer."""
    if spec.stemmer is None:
        return None
    try:
        import Stemmer  # noqa: F401
    except ImportError:
        return None
    return spec.stemmer


@dataclass
class SyntheticTexts:
    """A synthetic bank's text twin and its query texts (:func:`synthetic_texts`).

    Attributes:
        bank: the MemoryBank with a text per item (rows as the synthetic bank's) and its
            lexical index built (forward index and the postings of ``users_indexed``).
        queries: one query text per query row.
        stemmer: the bank's lexical stemmer.
        build_s: seconds spent generating the texts and building the bank and index.
        tokens: tokens in the lexical index (after stopwords).
    """

    bank: MemoryBank
    queries: list[str]
    stemmer: str | None
    build_s: float
    tokens: int


def synthetic_texts(
    sb: SyntheticBank,
    items: np.ndarray,
    spec: TextSpec,
    seed: int,
    users_indexed: np.ndarray | None = None,
) -> SyntheticTexts:
    """Seeded texts for every item of ``sb`` and a query text per query.

    Args:
        sb: the synthetic bank.
        items: int [nq] the bank row each query's text is drawn from (``sb.queries(...,
            labels=True)``'s ``item``: a specific query's item, a random item of a vague
            query's user).
        spec: the text parameters.
        seed: seed of the texts.
        users_indexed: segment indices whose BM25 postings are built here (untimed, as
            an index build; default every user).

    Returns:
        SyntheticTexts.
    """
    t0 = time.perf_counter()
    rng = np.random.default_rng([seed, 0x7E47])
    vocab = zipf_vocab(spec.vocab)
    texts = zipf_texts(sb.bank.num_items, spec.words, vocab, spec.zipf, rng)
    qt = query_texts(texts, len(items), vocab, spec.zipf, rng, items=items, item_words=spec.query_item_words,
                     extra_words=spec.query_extra_words)  # fmt: skip
    stem = text_stemmer(spec)
    bank = bank_with_texts(sb.bank, texts, stem)
    del texts
    lex = bank.snapshot().lexical
    segs = range(len(sb.users)) if users_indexed is None else sorted(set(int(u) for u in users_indexed))
    for u in segs:
        lex.postings(u)
    return SyntheticTexts(bank=bank, queries=qt, stemmer=stem, build_s=time.perf_counter() - t0,
                          tokens=int(np.asarray(lex.tf, dtype=np.int64).sum()))  # fmt: skip


def memory_available_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(need_bytes: int, what: str, fraction: float = 0.85) -> None:
    """Refuse a workload that would not fit in the memory available now.

    Args:
        need_bytes: estimated peak bytes of the workload.
        what: the workload and the flags that size it, for the message.
        fraction: share of ``MemAvailable`` the workload may use.

    Raises:
        MemoryError: ``need_bytes > fraction * MemAvailable`` (the message names the
            sizes and the flags to lower). Nothing is checked where /proc/meminfo is
            unreadable.
    """
    avail = memory_available_bytes()
    if avail is not None and need_bytes > fraction * avail:
        raise MemoryError(
            f"{what} needs about {need_bytes / 2**30:.1f} GiB but only {avail / 2**30:.1f} GiB "
            "are available; lower its sizes"
        )


# --------------------------------------------------------------------------- PersonaBench


def default_personabench_dir() -> Path | None:
    """``../shared/data/personabench/eval_data_v1`` next to the checkout, if it exists.

    Looked up under ``$RFMEM_SHARED`` (as the tests do), then relative to the source
    checkout holding this package, then to the current directory.

    Returns:
        Path or None.
    """
    sub = Path("data") / "personabench" / "eval_data_v1"
    cands = [Path(os.environ["RFMEM_SHARED"]) / sub] if os.environ.get("RFMEM_SHARED") else []
    cands += [root / ".." / "shared" / sub for root in (Path(__file__).resolve().parents[2], Path.cwd())]
    for p in cands:
        if p.is_dir():
            return p.resolve()
    return None


def default_cache_dir() -> Path:
    """Cache folder of encoded PersonaBench embeddings.

    ``$RFMEM_BENCH_CACHE`` if set, else ``$XDG_CACHE_HOME/rfmem_fast/bench`` (default
    ``~/.cache/rfmem_fast/bench``).
    """
    from .._paths import cache_subdir

    return cache_subdir("bench", "RFMEM_BENCH_CACHE")


# --------------------------------------------------------------------------- PersonaBench pack
#: format tag of :func:`write_personabench_pack` files
PACK_FORMAT = "rfmem_fast.personabench_pack/1"


def write_personabench_pack(
    path: str | os.PathLike[str],
    data_dir: str | os.PathLike[str],
    golden_file: str | os.PathLike[str],
    encoder: Any = None,
    noise: float = 0.0,
) -> Path:
    """Write PersonaBench, embedded, with its golden values, into ONE self-contained file.

    A machine without the shared data or the offline encoder (a lent GPU machine, see
    ``bench/gpu_check.py --prepare``) runs the golden parity tests from this file
    (``RFMEM_PB_PACK=file``, read by tests/conftest.py through
    :func:`read_personabench_pack`). About 1.5 MB (npz, compressed).

    Args:
        path: the ``.npz`` file to write.
        data_dir: folder holding ``synthetic_data/`` (the reference's 6 users are loaded).
        golden_file: ``personabench_noise0.0.jsonl`` (the authors' per-question values).
        encoder: object with ``encode(list[str]) -> float32 [n, d]`` (default: the
            offline MiniLM :class:`rfmem_fast.encoders.TextEncoder`).
        noise: noise level of the private data.

    Returns:
        the path written.

    Raises:
        FileNotFoundError / ValueError: as :func:`rfmem_fast.datasets.load_personabench`,
            or a golden file that cannot be read.
    """
    from dataclasses import asdict

    from ..datasets import load_personabench

    data = load_personabench(data_dir, noise=noise)
    if encoder is None:
        from ..encoders import TextEncoder

        encoder = TextEncoder(show_progress=False)
    texts = [t for u in data.users for t in u.chunk_texts]
    X = np.asarray(encoder.encode(texts), dtype=np.float32)
    Q = np.asarray(encoder.encode([q.question for q in data.questions]), dtype=np.float32)
    with open(golden_file, encoding="utf-8") as f:
        golden = [json.loads(line) for line in f if line.strip()]
    meta = {
        "format": PACK_FORMAT,
        "noise": noise,
        "users": [{"key": u.key, "chunk_ids": u.chunk_ids, "chunk_texts": u.chunk_texts} for u in data.users],
        "questions": [asdict(q) for q in data.questions],
        "golden": golden,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, X=X, Q=Q, meta=np.array(json.dumps(meta)))
    os.replace(tmp, path)
    return path


def read_personabench_pack(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a file of :func:`write_personabench_pack`.

    Returns:
        {"bank": MemoryBank (user keys, chunk ids and texts as loaded), "queries":
        float32 [263, d], "users": user key per question, "questions": list of
        :class:`rfmem_fast.datasets.personabench.PBQuestion`, "golden": list of dicts
        (the golden file's rows, in file order)}.

    Raises:
        ValueError: not such a file (wrong format tag or inconsistent sizes).
        OSError: unreadable.
    """
    from ..datasets.personabench import PBQuestion

    with np.load(path) as z:
        X, Q, meta = z["X"], z["Q"], json.loads(str(z["meta"]))
    if meta.get("format") != PACK_FORMAT:
        raise ValueError(f"{path} is not a PersonaBench pack ({PACK_FORMAT})")
    bank = MemoryBank(X.shape[1])
    pos = 0
    for u in meta["users"]:
        n = len(u["chunk_ids"])
        bank.add(u["key"], X[pos : pos + n], u["chunk_ids"], texts=u["chunk_texts"])
        pos += n
    questions = [PBQuestion(**q) for q in meta["questions"]]
    if pos != X.shape[0] or len(questions) != Q.shape[0]:
        raise ValueError(f"{path}: sizes do not match ({pos} chunks for {X.shape[0]} vectors)")
    return {
        "bank": bank,
        "queries": Q,
        "users": [q.user_key for q in questions],
        "questions": questions,
        "golden": meta["golden"],
    }
