"""The lexical channel's oracle: bm25s tokenisation, a Counter-based float64 BM25, a full scan of the fused scores.

Independent of rfmem_fast.lexical's index (no postings, no CSR): each user's live texts
are tokenised by ``bm25s.tokenize`` and scored term by term in Python; the fused score
of EVERY item of the user is computed (numpy float64) and sorted by (fused desc, row
asc). The formulas are the documented ones (rfmem_fast.lexical / rfmem_fast.fusion),
evaluated in the documented order.
"""
from __future__ import annotations

from collections import Counter

import bm25s
import numpy as np
import torch

from rfmem_fast._validate import l2_normalize_rows
from rfmem_fast.backends.exact import exact_pair_scores

K1, B = 1.5, 0.75


def _stemmer(name):
    if name is None:
        return None
    import Stemmer

    return Stemmer.Stemmer("english")


def bm25s_tokens(texts, stemmer=None):
    """bm25s.tokenize(texts, stopwords="en") as lists of token strings."""
    if not texts:
        return []
    return bm25s.tokenize(list(texts), stopwords="en", stemmer=_stemmer(stemmer), return_ids=False, show_progress=False)


def bm25_scores(texts, query, stemmer=None):
    """float64 [len(texts)] BM25 ("lucene", k1 1.5, b 0.75) of ``query`` over the texts (None: no document, 0)."""
    docs = [j for j, t in enumerate(texts) if t is not None]
    out = np.zeros(len(texts))
    if not docs or query is None:
        return out
    toks = bm25s_tokens([texts[j] for j in docs], stemmer)
    N = len(docs)
    dl = [len(t) for t in toks]
    avgdl = sum(dl) / N
    df = Counter(t for doc in toks for t in set(doc))
    q = bm25s_tokens([query], stemmer)[0]
    qc = Counter(q)
    order = [t for t in dict.fromkeys(q) if df.get(t, 0) > 0]  # distinct known tokens, first occurrence
    if not order:
        return out
    dfa = np.array([df[t] for t in order], dtype=np.float64)
    idf = np.log(1.0 + (N - dfa + 0.5) / (dfa + 0.5))
    tfs = [Counter(doc) for doc in toks]
    for pos, j in enumerate(docs):
        s, touched = 0.0, False
        for ti, t in enumerate(order):
            f = tfs[pos].get(t, 0)
            if f == 0:
                continue
            f = float(f)
            w = idf[ti] * (f / (K1 * ((1.0 - B) + B * float(dl[pos]) / avgdl) + f))
            s = s + float(qc[t]) * w
            touched = True
        out[j] = s if touched else 0.0
    return out


def bm25s_library_scores(texts, query, stemmer=None):
    """The bm25s library's own float32 scores (None texts left out, 0 there)."""
    docs = [j for j, t in enumerate(texts) if t is not None]
    out = np.zeros(len(texts))
    toks = bm25s_tokens([texts[j] for j in docs], stemmer)
    if not docs or not any(toks):
        return out
    r = bm25s.BM25(method="lucene", k1=K1, b=B)
    r.index(toks, show_progress=False)
    q = [t for t in bm25s_tokens([query], stemmer)[0] if t in r.vocab_dict]
    if q:
        out[docs] = r.get_scores(q)
    return out


def sharpness(bm25_docs):
    """(top1 - mean of ranks 2..10) / top1 over the user's documents' BM25 (0 without a hit)."""
    s = sorted(bm25_docs, reverse=True)
    if not s or s[0] <= 0:
        return 0.0
    m = min(len(s), 10)
    acc = 0.0
    for j in range(1, m):
        acc += s[j]
    mean = acc / (m - 1) if m > 1 else 0.0
    return (s[0] - mean) / s[0]


def fused_topk(bank, queries, users, texts, config, k, stemmer=None):
    """Oracle (rows [b, k] int64, fused [b, k] float64) by a full scan of every item of each query's user."""
    snap = bank.snapshot()
    Q = l2_normalize_rows(np.asarray(queries, dtype=np.float32), "queries")
    X = torch.from_numpy(snap.vectors)
    rows_out = np.full((len(users), k), -1, dtype=np.int64)
    sc_out = np.full((len(users), k), -np.inf)
    w = float(config.lexical_weight)
    D = max(config.lexical_depth, config.out_k, config.probe_k)
    for i, user in enumerate(users):
        u = bank.user_index(user)
        a, b = int(snap.offsets[u]), int(snap.offsets[u + 1])
        if b == a:
            continue
        r = torch.arange(a, b)
        dense = exact_pair_scores(X, torch.from_numpy(Q[i : i + 1]), torch.zeros_like(r), r, 1 << 26).numpy().astype(np.float64)
        ut = list(snap.texts[a:b])
        lex = bm25_scores(ut, texts[i], stemmer)
        has = np.array([t is not None for t in ut])
        local = np.arange(b - a)
        if config.fusion == "rrf":
            dorder = np.lexsort((local, -dense))[:D]
            drank = np.zeros(b - a, dtype=np.int64)
            drank[dorder] = np.arange(1, dorder.size + 1)
            hits = np.flatnonzero(lex > 0)
            lorder = hits[np.lexsort((hits, -lex[hits]))][:D]
            lrank = np.zeros(b - a, dtype=np.int64)
            lrank[lorder] = np.arange(1, lorder.size + 1)
            kk = config.lexical_rrf_k
            fused = np.where(drank > 0, 1.0 / (kk + drank.astype(np.float64)), 0.0) + np.where(
                lrank > 0, 1.0 / (kk + lrank.astype(np.float64)), 0.0
            )
        else:
            mx = lex.max(initial=0.0)
            f = lex / mx if mx > 0 else np.zeros_like(lex)
            if config.fusion == "convex":
                x = w * (lex if config.lexical_norm == "raw" else f)
            elif config.fusion == "zscore":  # the documented formula, in the engine's float64 order
                n = float(b - a)  # sums in row order, one after the other (math: sequential)
                mu = float(np.cumsum(lex)[-1]) / n
                sd = np.sqrt(max(float(np.cumsum(lex * lex)[-1]) / n - mu * mu, 0.0))
                mean_d = float(Q[i].astype(np.float64) @ snap.vectors[a:b].astype(np.float64).mean(axis=0))
                gap = max(float(dense.max()) - mean_d, 0.0)
                x = (w * gap / sd) * lex if sd > 0 else np.zeros_like(lex)
            else:
                x = (w * sharpness(list(lex[has]))) * f
            fused = dense + x
        order = np.lexsort((local, -fused))[:k]
        rows_out[i, : order.size] = order + a
        sc_out[i, : order.size] = fused[order]
    return rows_out, sc_out


# ---------------------------------------------------------------------- chunked items, per item
def item_topk(snap, user, items, query_vec, query_text, config, k, allowed=None, depth=None, stemmer=None):
    """The per-item fused top-k of one query, by brute force over the user's ITEMS.

    An item (what a caller stores) may be several bank rows: its own row (its id) and
    extra chunk rows (ids ``"<id>\\x1f<j>"``). Per item: dense = the largest exact float32
    cosine of its rows (:func:`_exact_oracle.exact_f32`, row by row), lexical = the BM25
    of its WHOLE text over the user's items' whole texts (``items``, one document each:
    :func:`bm25_scores`, as if nothing were chunked). The fusions, per item (the engine's
    documented definitions; ``M`` the items matching the filter, all without one):

    * convex: ``dense + w * f``, ``f`` the BM25 (raw) or BM25 / max over M (max);
    * adaptive: ``dense + w * sharpness * BM25 / max``, sharpness over M's documents;
    * zscore: ``dense + (w * max(0, max dense over M - q . m) / sd) * BM25``, ``sd`` the
      population std of the BM25 over M, ``m`` the mean over M of each item's mean row;
    * rrf: ``1 / (k + best dense rank of its rows)`` over the dense top ``depth`` rows of
      M, plus ``1 / (k + its rank)`` in the lexical top ``depth`` items of M (BM25 > 0,
      ties by the item's own row); items in neither list are not returned.

    Args:
        snap: the bank snapshot; user: the user key; items: {item id: whole text or None}
            of the user's live items (the test's own record); query_vec: float32 [d];
            query_text: str; config: RFMemConfig; k: items wanted; allowed: the item ids
            the filter keeps (None: all); depth: rrf's list depth.

    Returns:
        list of (item id, fused float64, dense float32, BM25 float64) of the top k items
        by (fused desc, the row the item is found by asc).
    """
    from _exact_oracle import exact_f32

    q = l2_normalize_rows(np.asarray(query_vec, dtype=np.float32)[None], "q")[0]
    u = list(snap.users).index(user)
    a, b = int(snap.offsets[u]), int(snap.offsets[u + 1])
    rows_of = {}  # item id -> its bank rows
    for r in range(a, b):
        rid = snap.item_ids[r]
        rows_of.setdefault(rid.split("\x1f")[0] if isinstance(rid, str) else rid, []).append(r)
    assert set(rows_of) == set(items), (sorted(rows_of), sorted(items))
    ids = list(items)
    own = {i: min(rows_of[i], key=lambda r: (snap.item_ids[r] != i, r)) for i in ids}  # the row holding its text
    assert all(snap.item_ids[own[i]] == i for i in ids)
    cos = {r: float(exact_f32(q, snap.vectors[r])) for i in ids for r in rows_of[i]}
    lex_all = bm25_scores([items[i] for i in ids], query_text, stemmer)
    lex = dict(zip(ids, lex_all))
    M = [i for i in ids if allowed is None or i in allowed]
    dense = {i: max(cos[r] for r in rows_of[i]) for i in M}
    best_row = {i: min(rows_of[i], key=lambda r: (-cos[r], r)) for i in M}
    w = float(config.lexical_weight)
    fused, found_by = {}, {}
    if config.fusion == "rrf":
        kk = float(config.lexical_rrf_k)
        drows = sorted((r for i in M for r in rows_of[i]), key=lambda r: (-cos[r], r))[:depth]
        drank = {}
        for pos, r in enumerate(drows, 1):
            item = snap.item_ids[r].split("\x1f")[0] if isinstance(snap.item_ids[r], str) else snap.item_ids[r]
            if item not in drank:
                drank[item] = (pos, r)
        lhits = sorted((i for i in M if lex[i] > 0), key=lambda i: (-lex[i], own[i]))[:depth]
        lrank = {i: pos for pos, i in enumerate(lhits, 1)}
        for i in M:
            if i not in drank and i not in lrank:
                continue
            d = 1.0 / (kk + float(drank[i][0])) if i in drank else 0.0
            x = 1.0 / (kk + float(lrank[i])) if i in lrank else 0.0
            fused[i] = d + x
            found_by[i] = drank[i][1] if i in drank else best_row[i]
    else:
        lm = [lex[i] for i in M]
        mx = max(lm, default=0.0)
        if config.fusion == "convex":
            x = {i: w * (lex[i] if config.lexical_norm == "raw" else (lex[i] / mx if mx > 0 else 0.0)) for i in M}
        elif config.fusion == "adaptive":
            docs = [lex[i] if i in dense else 0.0 for i in ids if items[i] is not None]  # M's BM25, 0 for the rest
            c = sharpness(docs)
            x = {i: (w * c) * (lex[i] / mx if mx > 0 else 0.0) for i in M}
        else:  # zscore
            n = float(max(len(M), 1))
            mu = sum(lm) / n
            sd = max(sum(v * v for v in lm) / n - mu * mu, 0.0) ** 0.5
            mean_vec = np.zeros(q.shape[0])
            for i in M:
                mean_vec += np.mean([snap.vectors[r].astype(np.float64) for r in rows_of[i]], axis=0) / len(M)
            gap = max(max(dense.values(), default=0.0) - float(q.astype(np.float64) @ mean_vec), 0.0) if M else 0.0
            x = {i: (w * gap / sd) * lex[i] if sd > 0 else 0.0 for i in M}
        for i in M:
            fused[i] = dense[i] + x[i]
            found_by[i] = best_row[i]
    order = sorted(fused, key=lambda i: (-fused[i], found_by[i]))[:k]
    return [(i, fused[i], np.float32(max(cos[r] for r in rows_of[i])), float(lex[i])) for i in order]
