"""A long text stored as several chunk rows is ONE item for the lexical channel.

The semantics (docs/guides/hybrid.md, "Chunked items"): an item's lexical score is the
BM25 of its WHOLE text (one document per item, as if unchunked), its dense score its best
chunk's cosine, and every fusion is taken per item; a hit reports both channels. The
reference is a brute force over the user's items (tests/_lexical_oracle.item_topk): whole
texts scored by the Counter-based BM25, chunk rows scored one by one with the exact
float32 cosine. Checked on every CPU backend (triton under TRITON_INTERPRET=1 with -m slow), with and
without filters, after update / delete, after a reopen (log replay, then checkpoint) and
after export / import, and batch-invariant.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from _lexical_oracle import bm25_scores, item_topk
from _serving_helpers import HashEncoder, WordChunkEncoder

from rfmem_fast import Memory, MemoryBank, RFMemConfig, available_backends
from rfmem_fast.lexical import item_rows

pytest.importorskip("bm25s")

DIM = 16


def _backends():
    names = [b for b in ("native", "torch", "reference") if b in available_backends()]
    if os.environ.get("TRITON_INTERPRET") == "1" and "triton" in available_backends():
        # the interpreter takes minutes per case (~11 for the six): run with -m slow
        names.append(pytest.param("triton", marks=pytest.mark.slow))
    return names


# ----------------------------------------------------------------------------- the minimal case
def test_a_chunked_item_keeps_its_lexical_score():
    """Item A = 20 filler words + " banana" (chunked), B = "banana split", query "banana":
    A's hit reports the BM25 of its whole text (as unchunked) and its best chunk's cosine."""
    filler = " ".join(f"w{i}" for i in range(20))
    texts, ids = [filler + " banana", "banana split"], ["A", "B"]
    cfg = RFMemConfig.recommended(second_stage=None)  # convex fusion, cosine + 0.03 * BM25 (raw)
    enc = WordChunkEncoder(DIM)
    mem = Memory(encoder=enc, chunk_overlap=2, batching=False, config=cfg, cache_size=0)
    mem.add(texts, "u", ids=ids)
    assert mem.bank.user_size("u") > 2  # A is stored as several chunk rows
    flat = Memory(encoder=HashEncoder(DIM), batching=False, config=cfg, cache_size=0)  # no window: unchunked
    flat.add(texts, "u", ids=ids)
    hits = {h.id: h for h in mem.search("banana", "u", k=2, mode="dense")}
    whole = {h.id: h for h in flat.search("banana", "u", k=2, mode="dense")}
    want = bm25_scores(texts, "banana", mem.bank.lexical_stemmer)
    assert want[0] > 0
    assert hits["A"].lexical_score == whole["A"].lexical_score == pytest.approx(want[0], rel=1e-6)
    assert hits["B"].lexical_score == whole["B"].lexical_score
    snap = mem.bank.snapshot()
    q = enc.vector("banana")
    rows = [r for r, i in enumerate(snap.item_ids) if i.split("\x1f")[0] == "A"]
    best = max(float(np.float32(snap.vectors[r].astype(np.float64) @ q.astype(np.float64))) for r in rows)
    assert hits["A"].dense_score == pytest.approx(best, abs=1e-6)
    assert hits["A"].score == pytest.approx(hits["A"].dense_score + 0.03 * hits["A"].lexical_score, abs=1e-6)
    reco = {h.id: h for h in mem.search("banana", "u", k=2, mode="recollection")}  # the lexical score looked up
    assert reco["A"].lexical_score == hits["A"].lexical_score


# ----------------------------------------------------------------------------- the row -> item map
def test_item_rows_reads_chunk_rows_only():
    has = np.array([True, False, False, False, False, True, False, False])
    ids = ["a", "a\x1f1", "a\x1f2", "x\x1f1", "a\x1f0", "b\x1f1", "b\x1fz", "a\x1f1\x1f1"]
    # a's chunks map to a; no row "x"; j = 0 or not a number; a chunk id WITH a text; a nested id
    assert item_rows(ids, has).tolist() == [0, 0, 0, 3, 4, 5, 6, 7]
    assert item_rows(["a", "b", 3], np.ones(3, bool)) is None  # no chunk row at all
    assert item_rows([], np.zeros(0, bool)) is None


def test_bank_level_chunk_rows_share_their_items_bm25_and_statistics():
    """A MemoryBank holding the Memory's row layout: every row of an item has the item's
    BM25, N / avgdl count it once; orphan chunk rows (their item gone) score 0."""
    bank = MemoryBank(4)
    rng = np.random.default_rng(0)
    bank.add("u", rng.normal(size=(5, 4)), ids=["a", "b", "a\x1f1", "a\x1f2", "c"],
             texts=["apple pie with apple", "apple", None, None, "dog"])
    u = bank.user_index("u")
    got = bank.snapshot().lexical.scores(u, "apple")
    want = bm25_scores(["apple pie with apple", "apple", "dog"], "apple")
    np.testing.assert_array_equal(got, [want[0], want[1], want[0], want[0], want[2]])
    P = bank.snapshot().lexical.postings(u)
    assert (P.n_docs, P.n_items) == (3, 3)
    bank.delete("u", ["a"])
    got = bank.snapshot().lexical.scores(u, "apple")
    np.testing.assert_array_equal(got, np.r_[bm25_scores(["apple", "dog"], "apple")[:1], 0.0, 0.0, 0.0])


# ----------------------------------------------------------------------------- seeded random, per item
WORDS = "apple banana cherry dog eagle fox grape house island jungle kite lemon mango night ocean piano".split()
FUSIONS = {
    "convex-raw": RFMemConfig.recommended(second_stage=None),
    "convex-max": RFMemConfig(lexical_weight=0.5, fusion="convex", lexical_norm="max"),
    "adaptive": RFMemConfig(lexical_weight=0.5, fusion="adaptive"),
    "zscore": RFMemConfig(lexical_weight=0.1, fusion="zscore", theta_high=-1.0, theta_low=-1.0, tau=0.0),
    "zscore-heavy": RFMemConfig(lexical_weight=5.0, fusion="zscore"),
    "rrf": RFMemConfig(lexical_weight=1.0, fusion="rrf", lexical_rrf_k=10.0),
}
USERS = ("alice", "bob", "carol")
QUERIES = ["apple banana", "kite kite lemon", "piano night dog", "zzz", "grape house island jungle"]


def _text(rng):
    n = int(rng.choice([1, 2, 3, 5, 6, 7, 9, 12, 15, 19]))  # more than 6 words: chunked
    return " ".join(rng.choice(WORDS, n))


class _Model:
    """The test's own record of every user's items: {user: {id: (text or None, tag)}}."""

    def __init__(self):
        self.items = {u: {} for u in USERS}

    def texts(self, user):
        return {i: t for i, (t, _) in self.items[user].items()}

    def allowed(self, user, flt):
        return None if flt is None else {i for i, (_, tag) in self.items[user].items() if tag == flt["tag"]}


def _populate(mem, model, rng):
    for user in USERS:  # add: texts (some long), metadata
        ids = [f"{user}{j}" for j in range(8)]
        texts = [_text(rng) for _ in ids]
        tags = [str(rng.choice(["x", "y"])) for _ in ids]
        mem.add(texts, user, ids=ids, metadata=[{"tag": t} for t in tags])
        model.items[user].update({i: (t, g) for i, t, g in zip(ids, texts, tags)})
    items = []  # add_many: texts and a vector-only item (no document)
    for user in USERS:
        for j in range(8, 11):
            t, g = _text(rng), str(rng.choice(["x", "y"]))
            items.append({"user_id": user, "id": f"{user}{j}", "text": t, "metadata": {"tag": g}})
            model.items[user][f"{user}{j}"] = (t, g)
        items.append({"user_id": user, "id": f"{user}v", "vector": rng.normal(size=DIM), "metadata": {"tag": "x"}})
        model.items[user][f"{user}v"] = (None, "x")
    mem.add_many(items)


def _rewrite(mem, model, rng):
    """Updates (long -> short, short -> long, metadata only) and deletes (chunked and not)."""
    for user in USERS:
        long_ids = [i for i, (t, _) in model.items[user].items() if t and len(t.split()) > 6]
        short_ids = [i for i, (t, _) in model.items[user].items() if t and len(t.split()) <= 6]
        if long_ids:
            i = long_ids[0]
            mem.update(i, user, texts="apple short now")
            model.items[user][i] = ("apple short now", model.items[user][i][1])
        if short_ids:
            i = short_ids[0]
            t = " ".join(rng.choice(WORDS, 14))
            mem.update(i, user, texts=t, metadata={"tag": "y"})
            model.items[user][i] = (t, "y")
        i = next(iter(model.items[user]))
        mem.update(i, user, metadata={"tag": "x"})
        model.items[user][i] = (model.items[user][i][0], "x")
        gone = (long_ids[1:2] if len(long_ids) > 1 else []) + short_ids[1:2]
        if gone:
            mem.delete(gone, user)
            for i in gone:
                del model.items[user][i]


def _key(hits):
    return [(h.id, h.score, h.dense_score, h.lexical_score) for h in hits]


def _check(mem, model, cfg, label):
    snap = mem.bank.snapshot()
    enc = mem.encoder
    singles = {}
    for flt in (None, {"tag": "x"}):
        for user in USERS:
            texts = model.texts(user)
            assert {i.id for i in mem.get_all(user)} == set(texts), label
            for q in QUERIES:
                full = item_topk(snap, user, texts, enc.vector(q), q, cfg, 20, model.allowed(user, flt),
                                 depth=cfg.lexical_depth, stemmer=mem.bank.lexical_stemmer)
                for k in (3, 20) if flt is None else (20,):  # (a top-k is a prefix of the oracle's top 20)
                    got = singles[user, q, k, flt is None] = mem.search(q, user, k=k, mode="dense", filters=flt)
                    want = full[:k]
                    where = f"{label}: user {user}, query {q!r}, k {k}, filters {flt}"
                    assert [h.id for h in got] == [w[0] for w in want], where
                    for h, (_, fused, dense, lex) in zip(got, want):
                        assert h.dense_score == float(dense), where
                        assert h.lexical_score == float(np.float32(lex)), where
                        assert h.score == pytest.approx(fused, rel=1e-6, abs=1e-6), where
    # batch-invariant: one batch of every (user, query) equals the single searches
    qs = [(u, q) for u in USERS for q in QUERIES]
    batch = mem.search_batch([q for _, q in qs], [u for u, _ in qs], k=3, mode="dense")
    for (u, q), hits in zip(qs, batch):
        assert _key(hits) == _key(singles[u, q, 3, True]), f"{label}: batch, {u} {q!r}"


#: the fusions checked through every stage (reopen, import); the others after adds and rewrites
LIFECYCLE = ("convex-raw", "zscore", "rrf")


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("fusion", list(FUSIONS))
def test_chunked_items_fuse_per_item_on_every_backend(tmp_path, backend, fusion):
    cfg = FUSIONS[fusion]
    rng = np.random.default_rng(sorted(FUSIONS).index(fusion))
    model = _Model()
    path = tmp_path / "m"

    def open_():
        return Memory(path, encoder=WordChunkEncoder(DIM), chunk_overlap=2, config=cfg, backend=backend, batching=False,
                      cache_size=0, fsync=False)  # fmt: skip

    mem = open_()
    _populate(mem, model, rng)
    assert any("\x1f" in str(i) for i in mem.bank.snapshot().item_ids)  # some items are chunked
    assert max(np.diff(mem.bank.snapshot().offsets)) < cfg.lexical_depth  # rrf's lists hold every row
    _check(mem, model, cfg, "after adds")
    _rewrite(mem, model, rng)
    _check(mem, model, cfg, "after update / delete")
    if fusion not in LIFECYCLE:
        return
    mem._lock_file.close()  # a crash: the log alone holds the writes
    mem = open_()
    _check(mem, model, cfg, "after the log's replay")
    mem.close()  # a checkpoint
    mem = open_()
    _check(mem, model, cfg, "after a checkpoint")
    items = list(mem.export_items())
    mem.close()
    other = Memory(tmp_path / "imported", encoder=WordChunkEncoder(DIM), chunk_overlap=2, config=cfg, backend=backend,
                   batching=False, cache_size=0, fsync=False)  # fmt: skip
    other.add_many(items)
    _check(other, model, cfg, "after export / import")
    other.close()
