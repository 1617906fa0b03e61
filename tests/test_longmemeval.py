"""The LongMemEval loader and metrics against hand-computed values.

tests/data/longmemeval_tiny.json is hand-written in the published format (three questions:
one evidence session with a has_answer turn and a turn without; two evidence sessions and
one "answer_" session none of whose user turns has the answer; one abstention question).
The metrics follow the authors' src/retrieval/eval_utils.py: their DCG weighs ranks 1 and
2 both 1 (r[0] + sum_{i>=1} r[i] / log2(i + 1))."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from _fake_encoder import BagOfWords, patch_encoder

from rfmem_fast.cli import main
from rfmem_fast.config import RFMemConfig
from rfmem_fast.datasets.longmemeval import (
    evaluate_retrieval,
    evaluate_retrieval_turn2session,
    lme_dcg,
    load_longmemeval,
    session_items,
)
from rfmem_fast.evaluate_datasets import evaluate_dataset

TINY = Path(__file__).parent / "data" / "longmemeval_tiny.json"


# ----------------------------------------------------------------- metric functions


def test_dcg_weighs_the_first_two_ranks_one():
    assert lme_dcg([1, 1, 1], 3) == pytest.approx(1 + 1 + 1 / math.log2(3))
    assert lme_dcg([0, 0, 0, 1], 4) == pytest.approx(0.5)
    assert lme_dcg([1, 1, 1], 1) == 1.0 and lme_dcg([], 5) == 0.0


def test_evaluate_retrieval_by_hand():
    corpus = ["x", "y", "a1", "a2", "z"]
    ranked = ["x", "a1", "y", "a2", "z"]
    correct = ["a1", "a2"]
    assert evaluate_retrieval(ranked, correct, corpus, 1) == (0.0, 0.0, 0.0)
    # top 3 = {x, a1, y}: any, not all; DCG [0, 1, 0] = 1, ideal [1, 1, 0] = 2
    assert evaluate_retrieval(ranked, correct, corpus, 3) == (1.0, 0.0, pytest.approx(0.5))
    # top 4 adds a2 at rank 4: DCG 1 + 1/log2(4) = 1.5, ideal 2
    assert evaluate_retrieval(ranked, correct, corpus, 4) == (1.0, 1.0, pytest.approx(0.75))
    # no ground truth: recall_all is all([]) = 1, NDCG 0 (as the authors' code)
    assert evaluate_retrieval(ranked, [], corpus, 3) == (0.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="k must be >= 1"):
        evaluate_retrieval(ranked, correct, corpus, 0)


def test_turn2session_raises_k_to_k_distinct_sessions():
    corpus = ["s1_1", "s1_3", "answer_2_1", "noans_2_3", "s3_1"]
    ranked = ["s1_1", "s1_3", "noans_2_3", "answer_2_1", "s3_1"]
    correct = ["answer_2_1"]
    # k=2: the top must hold 2 sessions -> k raised to 3 ({s1, noans_2}): the evidence session is missed
    assert evaluate_retrieval_turn2session(ranked, correct, corpus, 2) == (0.0, 0.0, 0.0)
    # k=3 -> raised to 4 ({s1, noans_2, answer_2}); DCG [0, 0, 0, 1] = 0.5; ideal over the stripped corpus = 1
    assert evaluate_retrieval_turn2session(ranked, correct, corpus, 3) == (1.0, 1.0, pytest.approx(0.5))
    # k above the number of sessions: raised up to len(corpus) + 1, everything retrieved
    assert evaluate_retrieval_turn2session(ranked, correct, corpus, 10)[:2] == (1.0, 1.0)


# ----------------------------------------------------------------- loader


def test_session_granularity_keys_and_texts():
    d = load_longmemeval(TINY, "session")
    assert d.name == "longmemeval" and [u.key for u in d.users] == ["q_dog", "q_moves", "q_cat_abs"]
    dog, moves, cat = d.questions
    assert d.users[0].item_ids == ["sharegpt_hike_0", "answer_dog_1", "ultrachat_pasta"]
    # user turns only, joined by one space
    assert d.users[0].item_texts[1] == "My dog is named Biscuit. He loves long walks in the park."
    # an "answer_" session without a has_answer user turn becomes "noans_"
    assert d.users[1].item_ids == ["answer_moves_1", "sharegpt_tax_2", "answer_moves_2", "noans_moves_3"]
    assert moves.ground_truth.correct == ("answer_moves_1", "answer_moves_2")
    assert dog.ground_truth.correct == ("answer_dog_1",)
    assert [q.scored for q in d.questions] == [True, True, False]  # "_abs": not scored
    assert [q.category for q in d.questions] == ["single-session-user", "multi-session", "single-session-user"]
    assert moves.info["answer_session_ids"] == ["answer_moves_1", "answer_moves_2"]
    assert d.stats["abstention"] == 1 and d.metric_names == ("recall", "ndcg", "recall_any", "recall_all", "ndcg_any")


def test_turn_granularity_keys():
    d = load_longmemeval(TINY, "turn")
    # user turns only, numbered by their index in the session (assistant turns counted) + 1
    assert d.users[0].item_ids == ["sharegpt_hike_0_1", "answer_dog_1_1", "noans_dog_1_3", "ultrachat_pasta_1"]
    assert d.users[0].item_texts[2] == "He loves long walks in the park."
    assert d.users[1].item_ids == ["answer_moves_1_1", "sharegpt_tax_2_1", "answer_moves_2_2", "noans_moves_3_1"]
    assert d.questions[1].ground_truth.correct == ("answer_moves_1_1", "answer_moves_2_2")
    assert "session_recall_all" in d.metric_names
    assert session_items([{"role": "user", "content": "hi"}], "answer_z", "turn") == (["noans_z_1"], ["hi"])


def test_scores_of_the_tiny_file_by_hand():
    d = load_longmemeval(TINY, "session")
    moves = d.questions[1]
    ranked = ["sharegpt_tax_2", "answer_moves_2", "noans_moves_3", "answer_moves_1"]
    got = d.score(moves, ranked, 2)
    assert got == {"recall": 0.0, "ndcg": pytest.approx(0.5), "recall_any": 1.0, "recall_all": 0.0, "ndcg_any": pytest.approx(0.5)}
    assert d.score(moves, ranked, 4)["recall_all"] == 1.0 and d.score(moves, ranked, 4)["ndcg_any"] == pytest.approx(0.75)
    t = load_longmemeval(TINY, "turn")
    ranked = ["noans_moves_3_1", "answer_moves_2_2", "sharegpt_tax_2_1", "answer_moves_1_1"]
    one = t.score(t.questions[1], ranked, 1)
    assert all(one[m] == 0.0 for m in ("recall_any", "recall_all", "ndcg_any", "session_recall_any", "session_ndcg_any"))
    two = t.score(t.questions[1], ranked, 2)
    assert (two["recall_any"], two["recall_all"], two["ndcg_any"]) == (1.0, 0.0, pytest.approx(0.5))
    assert (two["session_recall_any"], two["session_recall_all"], two["session_ndcg_any"]) == (1.0, 0.0, pytest.approx(0.5))


def test_bad_files_name_the_field(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_longmemeval(tmp_path / "none.json")
    p = tmp_path / "f.json"
    good = json.loads(TINY.read_text())
    cases = [
        ({"a": 1}, "top level must be a list"),
        ([{k: v for k, v in good[0].items() if k != "haystack_sessions"}], "has no 'haystack_sessions'"),
        ([{**good[0], "haystack_session_ids": good[0]["haystack_session_ids"][:2]}], "as long as 'haystack_session_ids'"),
        ([{**good[0], "question": 3}], "'question' must be a str"),
        ([good[0], good[0]], "repeated 'question_id'"),
        ([{**good[0], "haystack_sessions": [[{"role": "user"}]] * 3}], "has no str 'content'"),
        ([{**good[0], "haystack_sessions": [[{"role": "user", "content": "x", "has_answer": "yes"}]] * 3}], "'has_answer'"),
        ([], "no question"),
    ]
    for doc, msg in cases:
        p.write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=msg):
            load_longmemeval(p)
    p.write_text("[")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_longmemeval(p)
    with pytest.raises(ValueError, match="granularity"):
        load_longmemeval(TINY, "word")


def test_a_repeated_session_keeps_its_first_occurrence(tmp_path):
    doc = json.loads(TINY.read_text())[:1]
    e = doc[0]
    e["haystack_session_ids"].append("sharegpt_hike_0")
    e["haystack_sessions"].append([{"role": "user", "content": "a second copy"}])
    e["haystack_dates"].append("2023/05/29 (Mon) 09:00")
    p = tmp_path / "dup.json"
    p.write_text(json.dumps(doc))
    d = load_longmemeval(p)
    assert d.users[0].item_ids == ["sharegpt_hike_0", "answer_dog_1", "ultrachat_pasta"]
    assert d.stats["duplicate_items_dropped"] == 1 and any("dropped" in n for n in d.notes)


# ----------------------------------------------------------------- end to end


def test_dense_on_the_tiny_file():
    d = load_longmemeval(TINY, "session")
    s = evaluate_dataset(d, BagOfWords(), RFMemConfig(), mode="dense", k=1, cache_dir=None)
    assert list(s.qids) == ["q_dog", "q_moves"]  # the abstention question is not scored
    assert list(s.metrics["recall_any"]) == [1.0, 1.0] and list(s.metrics["recall_all"]) == [1.0, 0.0]
    assert s.result.ids_list(1)[:2] == ["answer_moves_1", "answer_moves_2"]
    s2 = evaluate_dataset(d, BagOfWords(), RFMemConfig(), mode="dense", k=2, cache_dir=None)
    assert list(s2.metrics["recall_all"]) == [1.0, 1.0] and list(s2.metrics["ndcg_any"]) == [1.0, 1.0]
    t = load_longmemeval(TINY, "turn")
    st = evaluate_dataset(t, BagOfWords(), RFMemConfig(), mode="dense", k=1, cache_dir=None)
    assert st.result.ids_list(0)[0] == "answer_dog_1_1"
    assert st.metrics["recall_all"][0] == 1.0 and st.metrics["session_recall_all"][0] == 1.0


def test_cli_eval_longmemeval(tmp_path, capsys, monkeypatch):
    patch_encoder(monkeypatch)
    figs = tmp_path / "f.json"
    rc = main(["eval", "longmemeval", "--data", str(TINY), "--granularity", "turn", "--no-cache", "--k", "1,2",
               "--modes", "dense", "--json", str(figs)])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "longmemeval: 3 users, 10 items, 3 questions (2 scored)" in text
    assert "dense: category" in text and "recall_all@1" in text and "session_ndcg_any@2" in text
    doc = json.loads(figs.read_text())
    m = doc["modes"]["dense"]["metrics_at"]["2"]["Overall"]
    assert m["count"] == 2 and m["recall_all"] == 1.0 and m["recall"] == m["recall_all"]
    assert main(["eval", "longmemeval", "--data", str(tmp_path / "none.json"), "--no-cache"]) == 2
    assert "LongMemEval file not found" in capsys.readouterr().err
