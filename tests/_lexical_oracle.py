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
