"""``rfmem tune hybrid``: nested leave-one-user-out CV of the fusion grid across datasets.

The procedure is checked against a direct re-computation: every candidate's per-question
recall from :func:`evaluate_dataset`, the documented objective, and the folds written out
as loops here (tests/_fake_encoder.py's bag-of-words encoder: no model, seconds).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from _fake_encoder import BagOfWords, patch_encoder
from rfmem_fast.cli import main
from rfmem_fast.datasets.base import Dataset, Question, User
from rfmem_fast.datasets.locomo import locomo_score
from rfmem_fast.evaluate_datasets import evaluate_dataset
from rfmem_fast.tuning_datasets import DatasetCondition, hybrid_candidates, hybrid_tune_json, tune_hybrid

WORDS = ("violin garden nurse leeds puppy rex ocean piano kite lemon mango paris london sister birthday "
         "marathon bakery sailing chess poetry tokyo salsa camping guitar").split()  # fmt: skip


def _dataset(name: str, seed: int, n_users: int = 3, n_items: int = 20) -> Dataset:
    """Users whose items mix a few topic words; questions name one item's words (lexical cues)."""
    rng = np.random.default_rng(seed)
    users, questions = [], []
    for u in range(n_users):
        key = f"{name}{u}"
        texts = [" ".join(rng.choice(WORDS, size=4, replace=False)) + f" note {j}" for j in range(n_items)]
        ids = [f"{key}:{j}" for j in range(n_items)]
        users.append(User(key, ids, texts))
        for qn in range(4):
            j = int(rng.integers(n_items))
            words = texts[j].split()[:2]
            questions.append(Question(f"{key}/{qn}", f"what about {words[0]} and {words[1]}?", key, [ids[j]], "1"))
    return Dataset(name, users, questions, ("recall", "ndcg"), locomo_score)


def _conditions():
    enc = BagOfWords(dim=8)  # few buckets: the dense channel blurs words, the lexical one does not
    return [DatasetCondition("a", _dataset("a", 1), enc, "a:"), DatasetCondition("b", _dataset("b", 2), enc, "b:")]


def test_nested_cv_equals_a_direct_computation():
    conds = _conditions()
    fams = ["convex raw", "zscore"]
    res = tune_hybrid(conds, families=fams, k=3, cache_dir=None)
    cands = hybrid_candidates(fams)
    rec = {c.label: np.stack([evaluate_dataset(c.dataset, c.encoder, cfg, mode="rfmem", k=3, cache_dir=None).recall
                              for _, cfg in cands]) for c in conds}  # fmt: skip
    qusers = {c.label: np.array([c.group + q.user_key for q in c.dataset.questions if q.scored]) for c in conds}
    users = sorted(set(np.concatenate(list(qusers.values())).tolist()))
    assert res.users == users and len(users) == 6

    def choose(train, allowed):
        best, best_obj = None, -np.inf
        for j in range(len(cands)):
            if not allowed[j]:
                continue
            g = [(rec[c][j][np.isin(qusers[c], train)] - rec[c][0][np.isin(qusers[c], train)]).mean() for c in rec]
            obj = round(float(np.mean(g) + min(g)), 12)
            if obj > best_obj:
                best, best_obj = j, obj
        return best

    fam_of = [f for f, _ in cands]
    for fam in ["convex raw", "zscore", "all"]:
        allowed = [fam == "all" or f == fam for f in fam_of]
        held = {c: np.zeros(rec[c].shape[1]) for c in rec}
        for u in users:
            j = choose([v for v in users if v != u], allowed)
            for c in rec:
                held[c][qusers[c] == u] = rec[c][j][qusers[c] == u]
        for c in rec:
            assert res.nested[fam][c] == pytest.approx(held[c].mean(), abs=1e-12)
    j = choose(users, [True] * len(cands))
    assert res.recommended == cands[j][1] and res.recommended_family == cands[j][0]
    assert res.dense == {c: pytest.approx(rec[c][0].mean()) for c in rec}
    doc = json.loads(json.dumps(hybrid_tune_json(res)))
    assert doc["recommended"]["config"]["lexical_weight"] == res.recommended.lexical_weight
    assert set(doc["nested_cv"]) == {"dense", "convex raw", "zscore", "all"}


def test_the_lexical_channel_helps_where_words_are_the_cue():
    """The tiny datasets are built so that the dense channel (8 hash buckets) blurs the
    question's words: every lexical family beats dense there, on held-out users too."""
    res = tune_hybrid(_conditions(), families=["convex raw", "zscore"], k=3, cache_dir=None)
    for fam in ("convex raw", "zscore", "all"):
        for c in ("a", "b"):
            assert res.nested[fam][c] > res.dense[c]


def test_bad_arguments_are_refused():
    conds = _conditions()
    with pytest.raises(ValueError, match="objective"):
        tune_hybrid(conds, objective="max")
    with pytest.raises(ValueError, match="unknown hybrid families"):
        tune_hybrid(conds, families=["bm42"])
    with pytest.raises(ValueError, match="conditions"):
        tune_hybrid([])
    with pytest.raises(ValueError, match="k must be"):
        tune_hybrid(conds, k=0)


def test_rfmem_tune_hybrid_cli(tmp_path, monkeypatch, capsys):
    assert main(["tune", "hybrid"]) == 2
    assert "give at least one of" in capsys.readouterr().err
    patch_encoder(monkeypatch)
    folder = tmp_path / "locomo"
    folder.mkdir()
    for n, seed in ((7, 3), (8, 4)):  # two conversations in LoCoMo's file format
        d = _dataset(str(n), seed, n_users=1)
        turns = [{"speaker": "Ann", "dia_id": i, "text": t} for i, t in zip(d.users[0].item_ids, d.users[0].item_texts)]
        qa = [{"question": q.text, "answer": "x", "evidence": q.ground_truth, "category": 1} for q in d.questions]
        doc = {"speaker_a": "Ann", "speaker_b": "Bob", "session_1_date_time": "1 May, 2023", "session_1": turns, "qa": qa}
        (folder / f"{n}.json").write_text(json.dumps(doc))
    out = tmp_path / "tune.json"
    assert main(["tune", "hybrid", "--locomo", str(folder), "--families", "convex raw", "--k", "3",
                 "--json", str(out)]) == 0  # fmt: skip
    assert "recommended (the pick on all users)" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["minilm"]["conditions"] == ["locomo"] and doc["minilm"]["users"] == ["locomo:7", "locomo:8"]


def _threaded(ds: Dataset) -> Dataset:
    """``ds`` with every user's items in threads of 5 consecutive items (positions 0..4)."""
    users = [User(u.key, u.item_ids, u.item_texts, [f"t{j // 5}" for j in range(len(u))], [j % 5 for j in range(len(u))])
             for u in ds.users]  # fmt: skip
    return Dataset(ds.name, users, ds.questions, ds.metric_names, ds.scorer)


def test_context_grid_and_nested_cv_equal_a_direct_computation():
    from rfmem_fast.tuning_datasets import CONTEXT_GRID, context_candidates, format_hybrid_tune, tune_context

    bases = [{"fusion": "convex", "lexical_norm": "raw", "lexical_weight": 0.03}]
    cands = context_candidates(bases)
    g = CONTEXT_GRID
    n_ctx = (len(g["context_weight"]) - 1) * len(g["context_radius"]) * len(g["thread_weight"]) + len(g["thread_weight"]) - 1
    assert [f for f, _ in cands[:2]] == ["dense", "fusion"] and len(cands) == 2 + n_ctx
    assert all(c.context_on for f, c in cands if f == "context")
    assert len({(c.context_weight, c.context_radius if c.context_weight > 0 else 0, c.thread_weight) for _, c in cands[2:]}) == n_ctx
    enc = BagOfWords(dim=8)
    conds = [DatasetCondition("a", _threaded(_dataset("a", 3, n_users=2, n_items=15)), enc, "a:"),
             DatasetCondition("b", _threaded(_dataset("b", 4, n_users=2, n_items=15)), enc, "b:")]  # fmt: skip
    res = tune_context(conds, bases=bases, k=3, cache_dir=None)
    rec = {c.label: np.stack([evaluate_dataset(c.dataset, c.encoder, cfg, mode="rfmem", k=3, cache_dir=None).recall
                              for _, cfg in cands]) for c in conds}  # fmt: skip
    qusers = {c.label: np.array([c.group + q.user_key for q in c.dataset.questions if q.scored]) for c in conds}
    users = sorted(set(np.concatenate(list(qusers.values())).tolist()))

    def choose(train):
        objs = []
        for j in range(len(cands)):
            gains = [(rec[c][j][np.isin(qusers[c], train)] - rec[c][0][np.isin(qusers[c], train)]).mean() for c in rec]
            objs.append(round(float(np.mean(gains) + min(gains)), 12))
        return int(np.argmax(objs))

    held = {c: np.zeros(rec[c].shape[1]) for c in rec}
    for u in users:
        j = choose([v for v in users if v != u])
        for c in rec:
            held[c][qusers[c] == u] = rec[c][j][qusers[c] == u]
    for c in rec:
        assert res.nested["all"][c] == pytest.approx(held[c].mean(), abs=1e-12)
    assert res.recommended == cands[choose(users)][1]
    assert "context tuning" in format_hybrid_tune(res, "context")
