"""The loaders' conversation structure (item threads and positions) and the evaluation banks
that carry it: LoCoMo (sessions, turn order), LongMemEval (turn granularity: sessions, turn
index; session granularity: none), PersonaBench (sessions ordered per partner / kind)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _shared import shared_dir

from rfmem_fast.datasets.base import check_dataset, user_threads
from rfmem_fast.datasets.embedded import _build_bank
from rfmem_fast.datasets.locomo import load_locomo
from rfmem_fast.datasets.longmemeval import load_longmemeval

TINY = Path(__file__).parent / "data" / "longmemeval_tiny.json"
SHARED = shared_dir()


def test_locomo_threads_are_sessions_in_turn_order(tmp_path):
    doc = {
        "speaker_a": "A", "speaker_b": "B",
        "session_1_date_time": "1 May", "session_1": [
            {"speaker": "A", "dia_id": "D1:1", "text": "hi"}, {"speaker": "B", "dia_id": "D1:2", "text": "yo"}],
        "session_2_date_time": "2 May", "session_2": [{"speaker": "A", "dia_id": "D2:1", "text": "again"}],
        "qa": [{"question": "q?", "answer": "a", "evidence": ["D1:2"], "category": 1}],
    }  # fmt: skip
    (tmp_path / "7.json").write_text(json.dumps(doc))
    ds = load_locomo(tmp_path)
    check_dataset(ds)
    u = ds.users[0]
    assert u.item_ids == ["D1:1", "D1:2", "D2:1"]
    assert user_threads(u) == (["session_1", "session_1", "session_2"], [0, 1, 0])
    bank = _build_bank(ds.users, np.random.default_rng(0).normal(size=(3, 4)))
    assert bank.threads_of("7") == ["session_1", "session_1", "session_2"] and bank.positions_of("7") == [0, 1, 0]


def test_longmemeval_turns_are_threaded_by_session():
    turns = load_longmemeval(TINY, granularity="turn")
    check_dataset(turns)
    for u in turns.users:
        threads, positions = user_threads(u)
        assert len(threads) == len(u.item_ids)
        for i, t, p in zip(u.item_ids, threads, positions):
            sid, _, j = i.rpartition("_")
            assert t.replace("answer", "noans") == sid.replace("answer", "noans") and p == int(j) - 1
    sessions = load_longmemeval(TINY, granularity="session")
    assert all(user_threads(u) == (None, None) for u in sessions.users)
    bank = _build_bank(turns.users, np.random.default_rng(1).normal(size=(sum(len(u) for u in turns.users), 4)))
    u = turns.users[0]
    assert bank.threads_of(u.key) == user_threads(u)[0]


@pytest.mark.skipif(SHARED is None or not (SHARED / "data" / "personabench").is_dir(), reason="no shared PersonaBench data")
def test_personabench_sessions_are_threaded_by_partner_and_kind():
    from rfmem_fast.datasets.personabench import load_personabench

    pb = load_personabench(SHARED / "data" / "personabench", noise=0.0, communities=(0,), users_per_community=1)
    u = pb.users[0]
    threads, positions = user_threads(u)
    assert len(threads) == len(u.chunk_ids) == len(positions)
    kinds = {t.split("/")[0] for t in threads}
    assert kinds == {"conversation", "user_ai_interaction", "purchase_history"}
    for t in set(threads):  # each thread's sessions are numbered 0, 1, ... in file order
        assert [p for x, p in zip(threads, positions) if x == t] == list(range(threads.count(t)))
