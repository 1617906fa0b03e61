"""Tests of rfmem_fast.metrics (RFMEM_SPEC.md sections 6 and 7)."""

from __future__ import annotations

import json
import math

import pytest
from _shared import shared_dir

from rfmem_fast.metrics import (
    aggregate,
    ndcg_at_k,
    question_category,
    recall_at_k,
    recall_ndcg_at_k,
)


def _dcg(positions: list[int]) -> float:
    return sum(1.0 / math.log2(i + 2) for i in positions)


# ----------------------------------------------------------------- hand-computed cases


def test_single_alternative_hit_and_miss() -> None:
    gt = {"Harvard": ["a"]}
    assert recall_at_k(["x", "a", "y"], gt, 10) == 1.0
    assert ndcg_at_k(["x", "a", "y"], gt, 10) == pytest.approx(1.0 / math.log2(3))
    assert recall_ndcg_at_k(["a"], gt, 1) == (1.0, 1.0)
    assert recall_ndcg_at_k(["x", "y"], gt, 10) == (0.0, 0.0)


def test_single_alternative_several_ids() -> None:
    # one alternative listing 2 ids -> 2 combinations of one id each; best is taken
    gt = {"alt": ["a", "b"]}
    assert recall_at_k(["x", "b"], gt, 10) == 1.0
    assert ndcg_at_k(["x", "b"], gt, 10) == pytest.approx(_dcg([1]) / _dcg([0]))


def test_several_alternatives_max_over_combos() -> None:
    # combos: {a, c}, {a, d}, {b, c}, {b, d}
    gt = {"p": ["a", "b"], "q": ["c", "d"]}
    retrieved = ["b", "x", "d", "a"]
    # {b, d} fully retrieved -> recall 1; DCG of {b,d} at positions 0, 2
    assert recall_at_k(retrieved, gt, 10) == 1.0
    idcg2 = _dcg([0, 1])
    assert ndcg_at_k(retrieved, gt, 10) == pytest.approx(_dcg([0, 2]) / idcg2)
    # the max is per metric: recall best from {b, d} / {a, d}; ndcg best from {b, d}
    assert recall_at_k(["a", "x", "x2", "c"], gt, 3) == 0.5


def test_recall_and_ndcg_maximised_independently() -> None:
    # combos: {d, h, e} (recall 2/3, best recall) and {d, e} (recall 1/2, best NDCG)
    gt = {"p": ["d"], "q": ["h", "d"], "r": ["e"]}
    ret = ["d", "w", "x", "y", "v", "f", "a", "z", "b", "h"]
    r, n = recall_ndcg_at_k(ret, gt, 10)
    ndcg_dhe = _dcg([0, 9]) / _dcg([0, 1, 2])
    ndcg_de = _dcg([0]) / _dcg([0, 1])
    assert ndcg_de > ndcg_dhe
    assert r == pytest.approx(2 / 3)
    assert n == pytest.approx(ndcg_de)


def test_duplicates_in_retrieved() -> None:
    gt = {"p": ["a", "b"], "q": ["c"]}  # combos {a, c}, {b, c}
    ret = ["a", "a", "c"]
    r, n = recall_ndcg_at_k(ret, gt, 10)
    assert r == 1.0  # recall counts the set
    assert n == pytest.approx(_dcg([0, 1, 2]) / _dcg([0, 1]))  # DCG counts each position
    assert recall_at_k(["a", "a"], {"p": ["a", "b"], "q": ["c"]}, 10) == 0.5


def test_k_smaller_than_list() -> None:
    gt = {"p": ["a"], "q": ["b"]}  # single combo {a, b}
    ret = ["a", "x", "b"]
    assert recall_at_k(ret, gt, 2) == 0.5
    assert ndcg_at_k(ret, gt, 2) == pytest.approx(1.0 / _dcg([0, 1]))
    assert recall_at_k(ret, gt, 3) == 1.0
    # k = 1 caps IDCG at one position
    assert ndcg_at_k(["a"], gt, 1) == pytest.approx(1.0)
    assert recall_at_k(["a"], gt, 1) == 0.5
    # k larger than the list is fine
    assert recall_at_k(ret, gt, 100) == 1.0


def test_empty_gt_and_empty_retrieved() -> None:
    assert recall_ndcg_at_k(["a"], {}, 10) == (0.0, 0.0)
    assert recall_at_k([], {"p": ["a"]}, 10) == 0.0
    assert ndcg_at_k([], {"p": ["a"]}, 10) == 0.0
    # an alternative with no ids yields no combination
    assert recall_ndcg_at_k(["a"], {"p": ["a"], "q": []}, 10) == (0.0, 0.0)


@pytest.mark.parametrize("k", [0, -1])
def test_k_invalid_value(k: int) -> None:
    with pytest.raises(ValueError, match="k"):
        recall_at_k(["a"], {"p": ["a"]}, k)
    with pytest.raises(ValueError, match="k"):
        ndcg_at_k(["a"], {"p": ["a"]}, k)
    with pytest.raises(ValueError, match="k"):
        recall_ndcg_at_k(["a"], {}, k)  # validated even when gt is empty


@pytest.mark.parametrize("k", [1.5, "3", None, True])
def test_k_invalid_type(k: object) -> None:
    with pytest.raises(TypeError, match="k"):
        recall_at_k(["a"], {"p": ["a"]}, k)  # type: ignore[arg-type]


def test_question_category() -> None:
    assert question_category("Basic information", "easy") == "Basic_information_easy"
    assert question_category("Basic information", "hard") == "Basic_information_easy"
    assert question_category("Preference", "hard") == "Preference_hard"
    assert question_category("Preference", "easy") == "Preference_easy"
    assert question_category("Social", "hard") == "Social_easy"


def test_aggregate() -> None:
    rows = [("A", 1.0, 0.5), ("B", 0.0, 0.0), ("A", 0.5, 0.25)]
    out = aggregate(rows)
    assert list(out) == ["A", "B", "Overall"]
    assert out["A"] == {"recall": 0.75, "ndcg": 0.375, "count": 2}
    assert out["B"] == {"recall": 0.0, "ndcg": 0.0, "count": 1}
    assert out["Overall"]["recall"] == pytest.approx(0.5)
    assert out["Overall"]["ndcg"] == pytest.approx(0.25)
    assert out["Overall"]["count"] == 3
    assert aggregate([]) == {"Overall": {"recall": 0.0, "ndcg": 0.0, "count": 0}}
    with pytest.raises(ValueError):
        aggregate([("A", 1.0)])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        aggregate([("A", float("nan"), 0.0)])


# ----------------------------------------------------------------- golden (section 7)


@pytest.fixture(scope="module")
def golden_rows() -> list[dict]:
    shared = shared_dir()
    if shared is None:
        pytest.skip("shared folder absent (set RFMEM_SHARED or place it beside the checkout)")
    path = shared / "golden" / "personabench_noise0.0.jsonl"
    if not path.is_file():
        pytest.skip(f"golden file absent: {path}")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize(
    "field, expected",
    [("dense_ids", 0.5385), ("recollection_ids", 0.5322), ("rfmem_ids", 0.5352)],
)
def test_golden_overall_recall(golden_rows: list[dict], field: str, expected: float) -> None:
    assert len(golden_rows) == 263
    rows = [
        (
            question_category(g["type"], g["difficulty"]),
            *recall_ndcg_at_k(g[field], g["gt_segment_ids"], 10),
        )
        for g in golden_rows
        if g["type"] != "Subjective"
    ]
    assert len(rows) == 230
    overall = aggregate(rows)["Overall"]
    assert overall["count"] == 230
    assert abs(overall["recall"] - expected) < 0.005


def test_golden_oracle_recall(golden_rows: list[dict]) -> None:
    # oracle router: best of dense and recollection per question (spec section 7)
    vals = [
        max(
            recall_at_k(g["dense_ids"], g["gt_segment_ids"], 10),
            recall_at_k(g["recollection_ids"], g["gt_segment_ids"], 10),
        )
        for g in golden_rows
        if g["type"] != "Subjective"
    ]
    assert abs(sum(vals) / len(vals) - 0.5870) < 0.005
