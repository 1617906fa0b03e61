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
Without a stemmer, ASCII batches take the native tokenizer (``_native.TokenIds``): it is
used, equals the per-text encoder, follows the vocabulary as it grows, and survives a pickle.
"""
from __future__ import annotations

import pickle
import re

import numpy as np
import pytest

import rfmem_fast.lexical as lexical_mod
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


def test_native_tokenizer_is_used_and_follows_the_vocabulary(monkeypatch):
    if lexical_mod._TokenIds is None:
        pytest.skip("the native extension is not built")
    lex = _index(None, Vocabulary(["the", "x", "apple"]))  # a stopword and a 1-character token in the vocabulary
    texts = [t for t in ADVERSARIAL if t is None or t.isascii()] + ["the x apple X_Y x", "APPLE apple\x00dog"]

    def python_path(*a, **k):
        raise AssertionError("the Python tokenizer ran")

    with monkeypatch.context() as m:  # ASCII batches and single texts never reach the Python tokenizer
        m.setattr(Analyzer, "batch_ids", python_path)
        m.setattr(Analyzer, "tokens", python_path)
        qt, qc, qp = lex.encode_queries(texts)
        one = [lex.encode_queries([t]) for t in texts]
    for i, t in enumerate(texts):
        want_t, want_c = lex.encode_query(t)
        assert qt[qp[i] : qp[i + 1]].tolist() == want_t.tolist() == one[i][0].tolist(), (i, t)
        assert qc[qp[i] : qp[i + 1]].tolist() == want_c.tolist() == one[i][1].tolist(), (i, t)
    assert lex.encode_queries(["the x apple"])[0].tolist() == [lex.vocab.ids["apple"]]
    # the vocabulary grows (a write adds tokens): the next batch knows them
    assert lex.encode_queries(["zebra apple"])[0].tolist() == [lex.vocab.ids["apple"]]
    lex.vocab.encode_doc(["zebra", "yak"])
    assert lex.encode_queries(["zebra apple yak"])[0].tolist() == [lex.vocab.ids[w] for w in ("zebra", "apple", "yak")]
    # a vocabulary pickles without its native mirror, which the copy rebuilds
    back = pickle.loads(pickle.dumps(lex.vocab))
    assert back.tokens == lex.vocab.tokens and "_native" not in back.__dict__
    assert back.native_ids() is not None and len(back.native_ids()) == len(back.tokens)
    monkeypatch.setattr(lexical_mod, "USE_NATIVE_TOKENIZER", False)  # the switch: the Python path, the same ids
    _check(lex, texts)


def test_native_token_table_checks_its_tokens():
    if lexical_mod._TokenIds is None:
        pytest.skip("the native extension is not built")
    t = lexical_mod._TokenIds(sorted(STOPWORDS_EN))
    t.sync(["apple", "dog"])
    assert len(t) == 2
    with pytest.raises(ValueError, match="already in the table"):
        t.sync(["apple", "dog", "apple"])
    with pytest.raises(TypeError, match=r"tokens\[3\] must be a str"):
        t.sync(["apple", "dog", "cat", 7])
    assert len(t) == 3  # (the tokens before the bad one were added)
    assert t.encode(["dog cat zzz", None, "café"]) is None  # a non-ASCII text: the caller's path
    terms, cnt, ptr = t.encode(["dog cat dog zzz", None, "CAT"])
    assert terms.tolist() == [1, 2, 2] and cnt.tolist() == [2.0, 1.0, 1.0] and ptr.tolist() == [0, 2, 2, 3]
