"""The encoder judge (rfmem_fast.encoder_judge) on synthetic runs with known answers.

Every figure is checked against a plain numpy computation of the same definition; no encoder
and no search runs here."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from rfmem_fast.encoder_judge import JUDGE_CRITERIA, SearchRun, compare_runs, judge, search_run

N = 100


def _reference(seed: int = 0, n: int = N, routes: bool = True) -> SearchRun:
    rng = np.random.default_rng(seed)
    recall = rng.integers(0, 5, n) / 4.0  # a quarter-step recall, as with 4 evidence items
    top = [tuple(f"item{j}" for j in rng.permutation(40)[:10]) for _ in range(n)]
    rts = tuple(rng.choice(["familiarity", "recollection"], n)) if routes else None
    return SearchRun(qids=tuple(f"q{i}" for i in range(n)), recall=recall, top=tuple(top), routes=rts)


def _with(run: SearchRun, **changes) -> SearchRun:
    fields = {"qids": run.qids, "recall": run.recall.copy(), "top": run.top, "routes": run.routes}
    fields.update(changes)
    return SearchRun(**fields)


def _swap_first_two(top, rows):
    out = list(top)
    for i in rows:
        a, b, *rest = out[i]
        out[i] = (b, a, *rest)
    return tuple(out)


def test_a_candidate_equal_to_the_reference_passes():
    ref = _reference()
    c = compare_runs(ref, _with(ref))
    assert c.passed and c.recall_ok and c.top_ok and c.routes_ok
    assert (c.mean_diff_points, c.se_points, c.t, c.changed_recall) == (0.0, 0.0, 0.0, 0)
    assert c.identical_top == 1.0 and c.identical_top_set == 1.0 and c.identical_routes == 1.0
    assert c.recall_reference == pytest.approx(100 * ref.recall.mean()) and c.failures() == []


def test_many_changed_lists_fail_b_only():
    ref = _reference()
    rows = np.arange(0, N, 10)[:8]  # 8 of 100 lists reordered: 0.92 < 0.95
    c = compare_runs(ref, _with(ref, top=_swap_first_two(ref.top, rows)))
    oracle = np.mean([ref.top[i] == _swap_first_two(ref.top, rows)[i] for i in range(N)])
    assert c.identical_top == pytest.approx(oracle) == pytest.approx(0.92)
    assert c.identical_top_set == 1.0  # the same ids, another order
    assert not c.top_ok and c.recall_ok and c.routes_ok and not c.passed
    assert [line[:3] for line in c.failures()] == ["(b)"]
    # 5 of 100 reordered: exactly on the 0.95 line, which passes
    assert compare_runs(ref, _with(ref, top=_swap_first_two(ref.top, range(5)))).top_ok


def test_a_shifted_recall_fails_a():
    ref = _reference()
    rec = ref.recall.copy()
    lower = np.flatnonzero(rec >= 0.25)[:12]
    rec[lower] -= 0.25  # 12 questions lose a quarter, none gains
    c = compare_runs(ref, _with(ref, recall=rec))
    d = rec - ref.recall
    mean, se = d.mean(), d.std(ddof=1) / math.sqrt(N)
    assert c.mean_diff_points == pytest.approx(100 * mean) and c.se_points == pytest.approx(100 * se)
    assert c.t == pytest.approx(mean / se) and c.changed_recall == 12
    assert abs(mean) > se and not c.recall_ok and c.top_ok and not c.passed
    assert c.failures()[0].startswith("(a)")


def test_one_changed_recall_sits_on_the_line_and_two_alike_cross_it():
    """One change: |mean| = |x| / n = SE exactly; two in the same direction: |mean| > SE."""
    ref = _reference()
    rec = ref.recall.copy()
    i, j = np.flatnonzero(rec >= 0.25)[:2]
    rec[i] -= 0.25
    one = compare_runs(ref, _with(ref, recall=rec))
    assert one.recall_ok and one.se_points == pytest.approx(25.0 / N) and abs(one.t) == pytest.approx(1.0)
    rec[j] -= 0.25
    assert not compare_runs(ref, _with(ref, recall=rec)).recall_ok
    # two opposite changes cancel: mean 0, within any SE
    rec[j] = ref.recall[j]
    k = np.flatnonzero(rec <= 0.75)[-1]
    rec[k] += 0.25
    both = compare_runs(ref, _with(ref, recall=rec))
    assert both.mean_diff_points == 0.0 and both.se_points > 0 and both.recall_ok and both.changed_recall == 2


def test_changed_routes_fail_c():
    ref = _reference()
    flip = {"familiarity": "recollection", "recollection": "familiarity"}
    two = tuple(flip[r] if i < 2 else r for i, r in enumerate(ref.routes))
    c = compare_runs(ref, _with(ref, routes=two))
    assert c.identical_routes == pytest.approx(0.98) and not c.routes_ok and not c.passed
    assert c.failures()[0].startswith("(c)")
    one = tuple(flip[r] if i < 1 else r for i, r in enumerate(ref.routes))
    assert compare_runs(ref, _with(ref, routes=one)).routes_ok  # 0.99: on the line


def test_a_dense_run_has_no_routes_to_check():
    ref = _reference(routes=False)
    c = compare_runs(ref, _with(ref))
    assert c.identical_routes is None and c.routes_ok


def test_candidate_order_does_not_matter():
    ref = _reference()
    perm = np.random.default_rng(3).permutation(N)
    rec = ref.recall.copy()
    rec[:12] = np.clip(rec[:12] - 0.25, 0, 1)
    cand = SearchRun(qids=tuple(ref.qids[p] for p in perm), recall=rec[perm], top=tuple(ref.top[p] for p in perm),
                     routes=tuple(ref.routes[p] for p in perm))
    want = compare_runs(ref, _with(ref, recall=rec))
    got = compare_runs(ref, cand)
    assert got == want


def test_judge_passes_only_if_every_dataset_and_configuration_passes():
    ref = {"pb-0.0": {"rfmem": _reference(0), "dense": _reference(1, routes=False)},
           "locomo": {"rfmem": _reference(2)}}
    same = {ds: {cfg: _with(r) for cfg, r in by.items()} for ds, by in ref.items()}
    v = judge(ref, same)
    assert v.passed and v.datasets_passed == {"pb-0.0": True, "locomo": True} and v.failures() == []
    worse = {ds: dict(by) for ds, by in same.items()}
    worse["locomo"]["rfmem"] = _with(ref["locomo"]["rfmem"], top=_swap_first_two(ref["locomo"]["rfmem"].top, range(10)))
    v = judge(ref, worse)
    assert not v.passed and v.datasets_passed == {"pb-0.0": True, "locomo": False}
    assert v.failures() and v.failures()[0].startswith("locomo / rfmem: (b)")
    doc = json.loads(json.dumps(v.to_dict()))
    assert doc["passed"] is False and doc["criteria"] == JUDGE_CRITERIA
    assert doc["comparisons"]["locomo"]["rfmem"]["identical_top"] == pytest.approx(0.9)


def test_an_infinite_t_is_written_as_a_string():
    """Every question loses the same 0.25: the differences do not vary, SE = 0, t = -inf."""
    ref = _reference()
    c = compare_runs(_with(ref, recall=np.full(N, 0.5)), _with(ref, recall=np.full(N, 0.25)))
    assert c.mean_diff_points == pytest.approx(-25.0) and c.se_points == 0.0
    assert c.t == -math.inf and not c.recall_ok and c.to_dict()["t"] == "-inf"


def test_search_run_from_scores():
    res = SimpleNamespace(ids_list=lambda j: [f"i{j}", f"i{j + 1}", 7][: 2 + j], route_names=["familiarity",
                                                                                              "recollection"])
    scores = SimpleNamespace(qids=np.array(["a", "b"], dtype=object), recall=np.array([0.5, 1.0]), result=res,
                             mode="rfmem")
    run = search_run(scores)
    assert run.qids == ("a", "b") and run.top == (("i0", "i1"), ("i1", "i2", "7"))
    assert run.routes == ("familiarity", "recollection") and run.recall.tolist() == [0.5, 1.0]
    assert search_run(SimpleNamespace(**{**vars(scores), "mode": "dense"})).routes is None
    with pytest.raises(TypeError, match="no 'result'"):
        search_run(SimpleNamespace(qids=[], recall=[], mode="rfmem"))


def test_mismatched_question_sets_raise_naming_the_argument():
    ref = _reference()
    fewer = SearchRun(qids=ref.qids[:-1], recall=ref.recall[:-1], top=ref.top[:-1], routes=ref.routes[:-1])
    with pytest.raises(ValueError, match=r"candidate must hold the reference's questions: 1 missing .*'q99'"):
        compare_runs(ref, fewer)
    other = _with(ref, qids=ref.qids[:-1] + ("zz",))
    with pytest.raises(ValueError, match=r"candidate.*1 missing.*1 extra .*'zz'"):
        compare_runs(ref, other)
    with pytest.raises(ValueError, match=r"^d / c: candidate must hold"):
        judge({"d": {"c": ref}}, {"d": {"c": fewer}})
    with pytest.raises(ValueError, match=r"candidate must hold the reference's datasets: missing \['d'\]"):
        judge({"d": {"c": ref}}, {"e": {"c": ref}})
    with pytest.raises(ValueError, match=r"candidate\['d'\] must hold the reference's configurations"):
        judge({"d": {"c": ref}}, {"d": {"x": ref}})
    with pytest.raises(ValueError, match="reference must hold at least one dataset"):
        judge({}, {})


@pytest.mark.parametrize("field, value, match", [
    ("recall", np.zeros(N - 1), r"recall must hold one value per question \(100 qids\), got 99"),
    ("top", tuple([("a",)] * (N - 1)), r"top must hold one list per question \(100 qids\), got 99"),
    ("routes", ("familiarity",) * (N - 1), r"routes must hold one route per question"),
    ("routes", ("familiarity",) * (N - 1) + ("dense",), r"routes must be names of .* got 'dense'"),
    ("recall", np.full(N, 1.5), r"recall must be finite values in \[0, 1\]"),
    ("recall", np.full(N, np.nan), r"recall must be finite values in \[0, 1\]"),
    ("qids", ("q0",) * N, r"qids must be distinct, 'q0' appears more than once"),
])
def test_bad_runs_raise_naming_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        _with(_reference(), **{field: value})


def test_other_input_errors():
    ref = _reference()
    with pytest.raises(TypeError, match=r"top\[0\] must be a sequence of item ids"):
        _with(ref, top=(5,) * N)
    with pytest.raises(TypeError, match="candidate must be a SearchRun"):
        compare_runs(ref, {"qids": ref.qids})
    with pytest.raises(TypeError, match="reference must be a SearchRun"):
        compare_runs(None, ref)
    with pytest.raises(ValueError, match="candidate has no routes"):
        compare_runs(ref, _with(ref, routes=None))
    with pytest.raises(ValueError, match="at least 2 questions"):
        one = SearchRun(qids=("q",), recall=[0.5], top=(("a",),))
        compare_runs(one, one)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        compare_runs(ref, ref, k=0)
    with pytest.raises(TypeError, match="k must be an int >= 1"):
        compare_runs(ref, ref, k=2.5)
    with pytest.raises(TypeError, match=r"candidate must be a mapping"):
        judge({"d": {"c": ref}}, {"d": ref})


def test_bench_null_option_turns_each_text_to_the_asked_cosine():
    """bench_encoder_judge's ``null:<1-cos>`` option: every row at cosine 1 - delta to the
    reference, a text met twice turned alike (as an encoder would embed it)."""
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench"
    sys.path.insert(0, str(bench))
    try:
        from bench_encoder_judge import Turned
    finally:
        sys.path.remove(str(bench))
    rng = np.random.default_rng(5)
    V = rng.standard_normal((6, 16))
    V /= np.linalg.norm(V, axis=1, keepdims=True)
    V[4] = V[1]  # the same text twice: the same reference vector
    texts = ["a", "b", "c", "d", "b", "e"]
    out = Turned(1e-4, seed=0).turn(V.astype(np.float32), texts)
    cos = (out.astype(np.float64) * V).sum(1)
    np.testing.assert_allclose(cos, 1 - 1e-4, atol=2e-6)
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-6)
    assert np.array_equal(out[1], out[4]) and not np.array_equal(out[0], V[0].astype(np.float32))
