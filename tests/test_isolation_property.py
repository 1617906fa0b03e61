"""Tenant isolation, property-based.

Over random banks, random add / update / delete / compact sequences and random queries:
no result of any mode (dense, recollection, rfmem) or CPU backend ever holds another
user's item or a deleted one. Item ids are drawn from one small pool shared by all
users (the same id lives in several users), so a leak is caught by row, not by name.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rfmem_fast
from rfmem_fast import MemoryBank, RFMemConfig, search
from rfmem_fast._validate import l2_normalize_rows

CPU_BACKENDS = [b for b in rfmem_fast.available_backends() if b in ("reference", "torch", "native")]
MODES = ["dense", "recollection", "rfmem"]
ID_POOL = list(range(8)) + [str(i) for i in range(8)] + ["x", ""]

user_keys = st.one_of(st.text(max_size=3), st.integers(-3, 3))
one_op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 5), st.integers(0, 2**16)),
    st.tuples(st.just("delete"), st.integers(0, 3), st.integers(1, 4), st.integers(0, 2**16)),
    st.tuples(st.just("update"), st.integers(0, 3), st.integers(1, 3), st.integers(0, 2**16)),
    st.tuples(st.just("snapshot"), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("compact"), st.just(0), st.just(0), st.just(0)),
)
ops = st.lists(one_op, min_size=1, max_size=25)
configs = st.builds(
    RFMemConfig,
    out_k=st.integers(1, 6),
    probe_k=st.integers(1, 6),
    beam_width=st.integers(1, 3),
    max_rounds=st.integers(1, 3),
    mmr_lambda=st.sampled_from([1.0, 0.9]),
    score_floor=st.sampled_from([-1.0, 0.0]),
)


def apply(ops_list, users, d, probe=None):
    """Run the ops on a bank and on a dict model; returns (bank, {user: {id: unit row}}).

    ``probe(bank, model, step)``, when given, runs after every op (searches in between writes).
    """
    bank = MemoryBank(d)
    model: dict = {}
    for step, (op, ui, m, seed) in enumerate(ops_list):
        if probe is not None and step:
            probe(bank, model, step)
        rng = np.random.default_rng(seed)
        user = users[ui % len(users)]
        live = list(model.get(user, {}))
        if op == "add":
            free = [i for i in ID_POOL if i not in model.get(user, {})]
            ids = [free[j] for j in rng.choice(len(free), size=min(m, len(free)), replace=False)]
            if not ids:
                continue
            # a few exact duplicates of existing rows: ties and degenerate clusters
            v = rng.normal(size=(len(ids), d)) if rng.random() < 0.8 else np.ones((len(ids), d))
            bank.add(user, v, ids)
            rows = model.setdefault(user, {})
            for i, row in zip(ids, l2_normalize_rows(np.asarray(v, np.float32), "v")):
                rows[i] = row
        elif op in ("delete", "update") and live:
            ids = [live[j] for j in rng.choice(len(live), size=min(m, len(live)), replace=False)]
            if op == "delete":
                bank.delete(user, ids)
                for i in ids:
                    del model[user][i]
            else:
                v = rng.normal(size=(len(ids), d))
                bank.update(user, ids, v)
                for i, row in zip(ids, l2_normalize_rows(np.asarray(v, np.float32), "v")):
                    model[user][i] = row
        elif op == "snapshot":
            bank.snapshot()
        elif op == "compact":
            bank.compact()
    return bank, model


@settings(max_examples=50, deadline=None)
@given(
    users=st.lists(user_keys, min_size=1, max_size=4, unique=True),
    d=st.integers(2, 6),
    ops_list=ops,
    q_users=st.lists(st.integers(0, 3), min_size=1, max_size=5),
    q_seed=st.integers(0, 2**16),
    cfg=configs,
)
def test_no_result_crosses_users_or_returns_deleted_items(users, d, ops_list, q_users, q_seed, cfg):
    bank, model = apply(ops_list, users, d)
    snap = bank.snapshot()
    # the snapshot is exactly the live model
    assert list(snap.users) == list(model)
    for u, (user, rows) in enumerate(model.items()):
        a, b = snap.offsets[u], snap.offsets[u + 1]
        assert snap.item_ids[a:b].tolist() == list(rows)
        if rows:
            np.testing.assert_array_equal(snap.vectors[a:b], np.stack(list(rows.values())))
    if not model:
        return
    qu = [list(model)[i % len(model)] for i in q_users]
    Q = np.random.default_rng(q_seed).normal(size=(len(qu), d))
    if bank.num_items == 0:
        with pytest.raises(ValueError, match="empty"):
            search(bank, Q, qu, cfg)
        return
    for be in CPU_BACKENDS:
        for mode in MODES:
            res = search(bank, Q, qu, cfg, mode=mode, backend=be)
            assert res.ids.shape == (len(qu), cfg.out_k) and res.probe_ids.shape == (len(qu), cfg.probe_k)
            for i, user in enumerate(qu):
                u = bank.user_index(user)
                lo, hi = snap.offsets[u], snap.offsets[u + 1]
                rows, ids = res.rows[i], res.ids[i]
                ok = rows >= 0
                assert ((rows[ok] >= lo) & (rows[ok] < hi)).all(), (be, mode, user)  # own segment only
                assert ids[ok].tolist() == snap.item_ids[rows[ok]].tolist()
                assert set(ids[ok].tolist()) <= set(model[user])  # live items of that user only
                assert len(set(rows[ok].tolist())) == int(ok.sum())
                assert all(x is None for x in ids[~ok]) and np.isneginf(res.scores[i][~ok]).all()
                # the probe carries ids and scores only: each must be that user's live item, with its score
                q = Q[i] / np.linalg.norm(Q[i])
                pids = [x for x in res.probe_ids[i] if x is not None]
                assert len(set(pids)) == len(pids)
                for j, x in enumerate(pids):
                    assert x in model[user], (be, mode, user, x)
                    assert abs(float(np.dot(q, model[user][x].astype(np.float64))) - float(res.probe_scores[i][j])) < 1e-5
                n_live = len(model[user])
                assert len(pids) == min(cfg.probe_k, n_live)
                assert len(res.ids_list(i)) <= n_live
                if mode == "dense":
                    assert len(res.ids_list(i)) == min(cfg.out_k, n_live)


@settings(max_examples=30, deadline=None)
@given(
    users=st.lists(user_keys, min_size=1, max_size=3, unique=True),
    ops_list=st.lists(one_op, min_size=8, max_size=30),
    seed=st.integers(0, 2**16),
)
def test_searches_between_writes_never_see_stale_or_foreign_items(users, ops_list, seed):
    rng = np.random.default_rng(seed)
    cfg = RFMemConfig(out_k=4, probe_k=4, beam_width=2, max_rounds=2)

    def probe(bank, model, step):
        if bank.num_items == 0:
            return
        qu = list(model)
        Q = rng.normal(size=(len(qu), 3))
        be = CPU_BACKENDS[step % len(CPU_BACKENDS)]
        res = search(bank, Q, qu, cfg, mode=MODES[step % len(MODES)], backend=be)
        for i, user in enumerate(qu):
            got = res.ids_list(i)
            assert set(got) <= set(model[user]), (be, user, got, list(model[user]))
            if res.mode == "dense":
                assert len(got) == min(cfg.out_k, len(model[user]))

    apply(ops_list, users, 3, probe)
