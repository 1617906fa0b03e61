"""The batched beam driver against a per-query re-statement of spec section 4.

`spec_recollect` below is the pseudo-code of RFMEM_SPEC.md section 4 written as a plain
loop (numpy + scikit-learn), independent of the package. The reference backend run
through the batched driver must give exactly its output, for several configs and for
many users in one batch; the torch backend (which replays scikit-learn's KMeans draws)
must agree on nearly every query.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from sklearn.cluster import KMeans

from rfmem_fast import MemoryBank, RFMemConfig, search


def _norm(v):
    return v / (np.linalg.norm(v) + 1e-12)


def spec_recollect(X, q0, cfg):
    B, F, R = cfg.beam_width, cfg.fanout, cfg.max_rounds
    beam = [(q0, [], 0.0)]
    seen, results = set(), []
    for level in range(R):
        children = []
        for q, _, acc in beam:
            n_l = (B + level) * F
            s = X @ q
            top = np.argsort(-s, kind="stable")[:n_l]
            cands = [(int(i), float(s[i])) for i in top if int(i) not in seen and s[i] >= cfg.score_floor]
            if not cands:
                continue
            V = X[[c for c, _ in cands]]
            if cfg.mmr_lambda < 1:
                G = V @ V.T
                sc = []
                for i, (_, si) in enumerate(cands):
                    others = [G[i, j] for j in range(len(cands)) if j != i]
                    sc.append(cfg.mmr_lambda * si - (1 - cfg.mmr_lambda) * (max(others) if others else 0.0))
                cands = [(c, x) for (c, _), x in zip(cands, sc)]
            kc = min(B, len(cands))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                labels = KMeans(n_clusters=kc, random_state=cfg.kmeans_seed).fit_predict(V)
            for c in range(kc):
                members = [i for i in range(len(cands)) if labels[i] == c]
                if not members:
                    continue
                cen = _norm(V[members].mean(axis=0))
                qc = _norm(cfg.alpha * q + (1 - cfg.alpha) * cen + q0)
                children.append((qc, [cands[i] for i in members], acc + sum(cands[i][1] for i in members)))
        if not children:
            break
        beam = sorted(children, key=lambda br: br[2], reverse=True)[:B]
        for _, hits, _ in beam:
            for i, s in hits:
                if i not in seen:
                    seen.add(i)
                    results.append(i)
        if len(results) >= cfg.out_k:
            break
    return results[: cfg.out_k]


def clustered_bank(seed, users=5, n=(3, 60), d=24):
    rng = np.random.default_rng(seed)
    bank = MemoryBank(d)
    for u in range(users):
        size = int(rng.integers(*n))
        centres = rng.normal(size=(4, d))
        x = centres[rng.integers(0, 4, size)] + 0.6 * rng.normal(size=(size, d))
        bank.add(f"u{u}", x, [f"u{u}-{i}" for i in range(size)])
    queries = rng.normal(size=(3 * users, d))
    owners = [f"u{i % users}" for i in range(3 * users)]
    return bank, queries, owners


CONFIGS = [
    RFMemConfig(),
    RFMemConfig(beam_width=3, fanout=2, max_rounds=4, alpha=0.3, mmr_lambda=1.0),
    RFMemConfig(beam_width=5, fanout=1, max_rounds=3, alpha=0.8, mmr_lambda=0.6, score_floor=0.05, out_k=7),
    RFMemConfig(beam_width=2, fanout=3, max_rounds=6, out_k=20),
]


@pytest.mark.parametrize("ci", range(len(CONFIGS)))
def test_driver_matches_spec_loop(ci):
    cfg = CONFIGS[ci]
    bank, Q, owners = clustered_bank(ci)
    snap = bank.snapshot()
    ref = search(bank, Q, owners, cfg, mode="recollection", backend="reference")
    tor = search(bank, Q, owners, cfg, mode="recollection", backend="torch")
    agree = 0
    for i, u in enumerate(owners):
        a, b = snap.offsets[bank.user_index(u)], snap.offsets[bank.user_index(u) + 1]
        q = Q[i] / np.linalg.norm(Q[i])
        want = [snap.item_ids[a + j] for j in spec_recollect(snap.vectors[a:b], q.astype(np.float32), cfg)]
        assert ref.ids_list(i) == want, f"query {i}"
        assert all(str(x).startswith(u + "-") for x in ref.ids_list(i))
        agree += tor.ids_list(i) == want
        assert ref.rounds[i] >= 1
    assert agree >= 0.9 * len(owners)


def test_recollection_stops_when_bank_is_exhausted():
    d = 6
    rng = np.random.default_rng(5)
    bank = MemoryBank(d)
    bank.add("small", rng.normal(size=(3, d)), ["a", "b", "c"])
    res = search(bank, rng.normal(size=(2, d)), ["small", "small"], RFMemConfig(score_floor=-1.0), mode="recollection")
    for i in range(2):
        assert sorted(res.ids_list(i)) == ["a", "b", "c"]  # all three, none twice
        assert res.ids[i, 3:].tolist() == [None] * 7 and (res.rows[i, 3:] == -1).all()
        assert np.isneginf(res.scores[i, 3:]).all()
