"""A batch of query texts encoded at once (LexicalIndex.encode_queries) = each text's encode_query.

Pins: for every text of a batch, the batched encoder gives exactly the distinct known
token ids (first-occurrence order) and counts (float64) of the per-text
:meth:`LexicalIndex.encode_query`, whose tokens are ``re.findall(TOKEN_PATTERN,
text.lower())`` less the stopwords (tests/test_lexical.py pins them to bm25s): on
empty and None texts, stopwords only, unknown and repeated tokens, every ASCII
character, non-ASCII and case-changing Unicode ('İ', 'ẞ', final sigma), digits and
underscores, the batch separator character inside a text, a vocabulary holding
stopwords and 1-character tokens, with the stemmer off and on (the stemmer's cache
ends the same), in batches of 0, 1 and many texts; a bad text raises TypeError naming it.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from rfmem_fast.lexical import STOPWORDS_EN, TOKEN_PATTERN, Analyzer, LexicalIndex, Vocabulary

DOCS = [
    "apple banana cherry dog eagle fox running runs runner Paris london",
    "café naïve straße İstanbul ΟΔΟΣ σοφός Ωμέγα日本語 テキスト",
    "x_y __ a1 42 007 snake_case CamelCase under_score_ x",
    "i̇stanbul ss ẞig  Über über ÜBER",
]
ADVERSARIAL = [
    "", None, "the of and a an", "zzz unknownword qqq", "apple Apple APPLE apple banana apple",
    "Running RUNS runner run", "café CAFÉ Café naïve", "İstanbul İSTANBUL istanbul", "İ İİ iİ",
    "ẞIG ßig", "ΟΔΟΣ οδοσ οδος ΣΟΦΟΣ", "x_y X_Y __ _ a1 A1 42 4 007", "a b c x y z", "apple,banana;cherry-dog.eagle",
    "tab\tnew\nline\rcarriage\x0bvt\x0cff", "unit\x1fsep\x1egroup\x1cfile", "\x85next line\xa0nbsp", "日本語 テキスト",
    "Paris\x00london", "   ", "the", "dog dog dog", "snake_case CamelCase camelcase",
]  # fmt: skip


def _index(stemmer, vocab=None):
    if stemmer:
        pytest.importorskip("Stemmer")
    offsets = np.array([0, len(DOCS)], dtype=np.int64)
    return LexicalIndex.from_texts(offsets, DOCS, vocab if vocab is not None else Vocabulary(), Analyzer(stemmer))


def _check(lex, texts):
    qt, qc, qp = lex.encode_queries(texts)
    assert qt.dtype == np.int32 and qc.dtype == np.float64 and qp.dtype == np.int64
    assert qp.shape == (len(texts) + 1,) and qp[0] == 0 and qp[-1] == qt.shape[0] == qc.shape[0]
    for i, t in enumerate(texts):
        want_t, want_c = lex.encode_query(t)
        assert qt[qp[i] : qp[i + 1]].tolist() == want_t.tolist(), (i, t)
        assert qc[qp[i] : qp[i + 1]].tolist() == want_c.tolist(), (i, t)


def _oracle(lex, text):
    """(ids, counts) by hand: the pattern on the lowered text, stopwords out, known tokens counted."""
    counts: dict = {}
    an = lex.analyzer
    for tok in re.findall(TOKEN_PATTERN, "" if text is None else text.lower()):
        if tok in STOPWORDS_EN:
            continue
        if an.stemmer is not None:
            tok = an._stem.stemWord(tok)
        i = lex.vocab.ids.get(tok)
        if i is not None:
            counts[i] = counts.get(i, 0) + 1
    return list(counts), [float(c) for c in counts.values()]


@pytest.mark.parametrize("stemmer", [None, "english"])
def test_batch_equals_per_text_on_adversarial_texts(stemmer):
    lex = _index(stemmer)
    _check(lex, ADVERSARIAL)
    _check(lex, [t for t in ADVERSARIAL if t is None or (t.isascii() and "\x00" not in t)])  # the ASCII pass
    _check(lex, [t for t in ADVERSARIAL if t is None or "\x00" not in t])  # the pattern pass
    for t in ADVERSARIAL:  # and the per-text encoder is the plain rule
        got = lex.encode_query(t)
        assert (got[0].tolist(), got[1].tolist()) == _oracle(lex, t)
    qt, qc, qp = lex.encode_queries(ADVERSARIAL)
    assert (qp[1:] > qp[:-1]).sum() >= 10  # many texts have known tokens
    assert qc.max() >= 4  # repeated tokens counted


@pytest.mark.parametrize("stemmer", [None, "english"])
def test_every_ascii_character(stemmer):
    lex = _index(stemmer)
    chars = [chr(c) for c in range(1, 128)]
    texts = [f"apple{c}banana {c}{c}dog{c} x{c}y {c}runs" for c in chars] + ["".join(chars) + " apple"]
    _check(lex, texts)
    _check(lex, texts + ["é apple"])  # the same texts through the pattern pass


@pytest.mark.parametrize("stemmer", [None, "english"])
def test_random_texts_in_batches_of_every_size(stemmer):
    lex = _index(stemmer)
    rng = np.random.default_rng(0)
    words = sorted({w for d in DOCS for w in d.split()}) + ["the", "of", "zzz", "a", "İ", "ß", "Σ", "_", "42"]
    seps = [" ", "  ", ",", "-", "_", ".", "\t", "\n", "é", "\x1f", "", "'", "\u0307"]
    texts = []
    for _ in range(300):
        n = int(rng.integers(0, 9))
        parts = [str(rng.choice(words)) + str(rng.choice(seps)) for _ in range(n)]
        t = "".join(parts)
        texts.append(t.upper() if rng.random() < 0.2 else (None if rng.random() < 0.05 else t))
    for b in (0, 1, 2, 3, 17, 300):
        _check(lex, texts[:b])
    ascii_texts = [t for t in texts if t is None or t.isascii()]
    _check(lex, ascii_texts)


def test_stemmer_cache_ends_the_same():
    a, b = _index("english"), _index("english")
    texts = ADVERSARIAL + ["Flying flies foxes jumped jumping", "RUNNING quickly"]
    a.encode_queries(texts)
    for t in texts:
        b.encode_query(t)
    assert a.analyzer._cache == b.analyzer._cache
    assert "flying" in a.analyzer._cache and "the" not in a.analyzer._cache


def test_vocabulary_with_stopwords_and_one_character_tokens():
    vocab = Vocabulary(["the", "x", "a", "é", "apple"])  # not a tokenizer's output: still dropped / never matched
    lex = _index(None, vocab)
    texts = ["the x a apple é x_y", "A X THE", "é é apple", "the apple"]
    _check(lex, texts)
    qt, _, qp = lex.encode_queries(texts)
    assert qt[qp[0] : qp[1]].tolist() == [vocab.ids["apple"], vocab.ids["x_y"]]


def test_empty_and_bad_batches():
    lex = _index(None)
    qt, qc, qp = lex.encode_queries([])
    assert qt.shape == (0,) and qc.shape == (0,) and qp.tolist() == [0]
    qt, qc, qp = lex.encode_queries([None, "", "the of"])
    assert qt.shape == (0,) and qp.tolist() == [0, 0, 0, 0]
    for bad in (["apple", 3], [b"apple", "dog"], [4]):
        i = next(j for j, t in enumerate(bad) if not isinstance(t, str))
        with pytest.raises(TypeError, match=rf"texts\[{i}\] must be a str or None"):
            lex.encode_queries(bad)
