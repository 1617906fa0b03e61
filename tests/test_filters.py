"""Filtered search (rfmem_fast.filters): the filter language, exact filtered top-k on every backend, created_at.

The oracles are independent of the package: a plain-Python evaluator of the filter
language over the items' metadata (``ref_match``), the fsum exact scores of
tests/_exact_oracle.py for the dense top-k of the matching items, and, for the modes
that route and recollect, the same search over a bank that holds only the matching
items (the definition of "the probe, the recollection rounds and the final list see
only matching items").
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
import torch

from _exact_oracle import exact_f32, near_duplicate_bank
from _lexical_oracle import bm25_scores
from rfmem_fast import MemoryBank, RFMemConfig, search
from rfmem_fast.backends import available, get_backend
from rfmem_fast.backends.native import NativeBackend
from rfmem_fast.filters import LIST_MAX_FRACTION, compile_filters, parse_filter
from rfmem_fast.search import search_tensors

DATA = Path(__file__).parent / "data"
MODES = ("dense", "rfmem", "recollection")
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp()
DAY = 86400.0


# --------------------------------------------------------------------------- the oracle of the language
def _lookup(meta, created, field):
    if field == "created_at":
        return (not math.isnan(created)), created
    v = meta
    for part in field.split("."):
        if not isinstance(v, dict) or part not in v:
            return False, None
        v = v[part]
    return True, v


def _json_eq(a, b):
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b  # Python compares int and float by exact value
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_eq(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_eq(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _instant(x):
    if isinstance(x, datetime):
        return x.timestamp()
    if isinstance(x, str):
        return datetime.fromisoformat(x).timestamp()
    return float(x)


_OPS = {"$gt": lambda a, b: a > b, "$gte": lambda a, b: a >= b, "$lt": lambda a, b: a < b, "$lte": lambda a, b: a <= b}


def _ref_cmp(field, present, v, op, x):
    if op == "$exists":
        return present == x
    if not present:
        return False
    if field == "created_at":
        if op in ("$in", "$nin"):
            hit = any(v == _instant(y) for y in x)
            return hit if op == "$in" else not hit
        if op in ("$eq", "$ne"):
            return (v == _instant(x)) == (op == "$eq")
        return _OPS[op](v, _instant(x))
    if op == "$eq":
        return _json_eq(v, x)
    if op == "$ne":
        return not _json_eq(v, x)
    if op in ("$in", "$nin"):
        hit = any(_json_eq(v, y) for y in x)
        return hit if op == "$in" else not hit
    if isinstance(x, datetime):
        if not isinstance(v, str):
            return False
        try:
            t = datetime.fromisoformat(v)
        except ValueError:
            return False
        t = t if t.tzinfo else t.replace(tzinfo=timezone.utc)
        return _OPS[op](t.timestamp(), x.timestamp())
    if isinstance(x, str):
        return isinstance(v, str) and _OPS[op](v, x)
    return isinstance(v, (int, float)) and not isinstance(v, bool) and _OPS[op](v, x)


def ref_match(meta, created, f):
    """Does an item (metadata dict / None, creation time) match filter ``f``? (plain Python)"""
    for key, cond in f.items():
        if key == "$and":
            if not all(ref_match(meta, created, g) for g in cond):
                return False
        elif key == "$or":
            if not any(ref_match(meta, created, g) for g in cond):
                return False
        elif key == "$not":
            if ref_match(meta, created, cond):
                return False
        else:
            present, v = _lookup(meta, created, key)
            if isinstance(cond, dict) and cond and all(k.startswith("$") for k in cond):
                conds = list(cond.items())
            else:
                conds = [("$eq", cond)]
            if not all(_ref_cmp(key, present, v, op, x) for op, x in conds):
                return False
    return True


# --------------------------------------------------------------------------- random banks and filters
TAGS = ("work", "home", "travel")


def random_meta(rng, j):
    """Metadata of item j: random fields, some missing, a unique 'rank' (set by the caller)."""
    if rng.random() < 0.08:
        return None
    m = {}
    if rng.random() < 0.85:
        m["tag"] = str(rng.choice(TAGS))
    if rng.random() < 0.8:
        m["score"] = int(rng.integers(0, 10)) if rng.random() < 0.7 else float(np.round(rng.uniform(0, 10), 2))
    elif rng.random() < 0.3:
        m["score"] = "n/a"
    if rng.random() < 0.5:
        m["flag"] = bool(rng.random() < 0.5)
    if rng.random() < 0.6:
        m["nested"] = {"lvl": int(rng.integers(0, 4))}
    if rng.random() < 0.5:
        m["date"] = f"2026-0{int(rng.integers(1, 10))}-1{int(rng.integers(0, 10))}"
    return m


def make_bank(seed, sizes, d=16, dtype="float32"):
    """A bank of len(sizes) users with random metadata (a unique 'rank' per item of a user,
    a permutation) and creation times spread over 100 days."""
    rng = np.random.default_rng(seed)
    bank = MemoryBank(d, dtype=dtype)
    for u, n in enumerate(sizes):
        perm = rng.permutation(n)
        metas = []
        for j in range(n):
            m = random_meta(rng, j)
            if m is not None:
                m["rank"] = int(perm[j])
            metas.append(m)
        created = T0 + rng.uniform(0, 100, n) * DAY
        bank.add(f"u{u}", rng.normal(size=(n, d)), [f"u{u}-{j}" for j in range(n)], metadata=metas, created_at=created)
    return bank


def random_filter(rng, depth=0):
    """A random filter of the language (comparisons on every field type, logical operators)."""
    r = rng.random()
    if depth < 2 and r < 0.25:
        op = str(rng.choice(["$and", "$or"]))
        return {op: [random_filter(rng, depth + 1) for _ in range(int(rng.integers(1, 3)))]}
    if depth < 2 and r < 0.32:
        return {"$not": random_filter(rng, depth + 1)}
    kind = int(rng.integers(0, 9))
    if kind == 0:
        return {"tag": str(rng.choice(TAGS))}
    if kind == 1:
        return {"tag": {"$in": [str(t) for t in rng.choice(TAGS, size=2, replace=False)]}}
    if kind == 2:
        lo = int(rng.integers(0, 8))
        return {"score": {"$gte": lo, "$lt": lo + int(rng.integers(1, 5))}}
    if kind == 3:
        return {"score": {"$ne": 5}} if rng.random() < 0.5 else {"score": {"$nin": [3, 4.0]}}
    if kind == 4:
        return {"flag": bool(rng.random() < 0.5)} if rng.random() < 0.6 else {"flag": {"$exists": bool(rng.random() < 0.5)}}
    if kind == 5:
        return {"nested.lvl": {"$lte": int(rng.integers(0, 4))}}
    if kind == 6:
        t = datetime.fromtimestamp(T0 + float(rng.uniform(0, 100)) * DAY, tz=timezone.utc)
        return {"created_at": {str(rng.choice(["$gte", "$lt"])): t if rng.random() < 0.5 else t.isoformat()}}
    if kind == 7:
        return {"date": {"$gte": "2026-05-15"}} if rng.random() < 0.5 else {
            "date": {"$lt": datetime(2026, 4, 1, tzinfo=timezone.utc)}}
    return {"rank": {"$lt": int(rng.integers(0, 40))}}


def matching_rows(bank, user, f):
    """Snapshot rows of ``user`` that ``f`` matches, by the plain-Python oracle."""
    snap = bank.snapshot()
    u = bank.user_index(user)
    a, b = int(snap.offsets[u]), int(snap.offsets[u + 1])
    metas = bank.get_metadata(user)
    created = snap.created_at[a:b]
    return np.array([a + j for j in range(b - a) if f is None or ref_match(metas[j], float(created[j]), f)], dtype=np.int64)


def unit_query(q):
    """The query as the search normalises it: float32, divided by its float64 norm, rounded once."""
    q32 = np.asarray(q, dtype=np.float32)
    q64 = q32.astype(np.float64)
    return (q32 / np.sqrt(np.add.reduce(q64 * q64))).astype(np.float32)


def dense_oracle(bank, q, rows, k):
    """Exact (fsum) scores of the rows, top k by (score desc, row asc): (rows [k], scores [k])."""
    X = bank.snapshot().vectors
    qn = unit_query(q)
    sc = sorted(((exact_f32(qn, X[r]), int(r)) for r in rows), key=lambda t: (-float(t[0]), t[1]))[:k]
    out_r = np.full(k, -1, dtype=np.int64)
    out_s = np.full(k, -np.inf, dtype=np.float32)
    for j, (s, r) in enumerate(sc):
        out_r[j], out_s[j] = r, s
    return out_r, out_s


def sub_bank(bank, rows, dtype="float32"):
    """A one-user bank of exactly these rows (their order and ids kept)."""
    snap = bank.snapshot()
    sub = MemoryBank(bank.dim, dtype=dtype)
    if rows.shape[0]:
        sub.add("only", snap.vectors[rows], list(snap.item_ids[rows]), texts=list(snap.texts[rows]))
    return sub


FIELDS = ("ids", "scores", "route", "rule", "rounds", "mean", "entropy", "probe_ids", "probe_scores")


def assert_same_as_sub_bank(bank, Q, users, filters, cfg, mode, backend, dtype="float32"):
    """The filtered search equals, query by query, the unfiltered search over a bank of only
    the matching items (same backend: bit for bit), and its dense top-k the brute force."""
    res = search(bank, Q, users, cfg, mode=mode, backend=backend, filters=filters)
    for i, user in enumerate(users):
        f = filters[i] if isinstance(filters, list) else filters
        rows = matching_rows(bank, user, f)
        k = cfg.out_k
        if mode == "dense":
            want_r, want_s = dense_oracle(bank, Q[i], rows, k)
            np.testing.assert_array_equal(res.rows[i], want_r)
            np.testing.assert_array_equal(res.scores[i], want_s)
        if mode == "dense" or res.route[i] == 0:  # never fewer than min(k, matching) on the Familiarity path
            assert len(res.ids_list(i)) == min(k, rows.shape[0]), (i, f)
        if rows.shape[0] == 0:
            assert res.ids_list(i) == [] and res.rule_names[i] == ("forced_dense" if mode == "dense" else
                                                                   "forced_recollection" if mode == "recollection" else "no_hits")
            continue
        want = search(sub_bank(bank, rows, dtype), Q[i : i + 1], ["only"], cfg, mode=mode, backend=backend)
        for name in FIELDS:
            got, exp = getattr(res, name)[i], getattr(want, name)[0]
            if got.dtype == object:
                assert got.tolist() == exp.tolist(), (name, i, f, mode)
            else:
                np.testing.assert_array_equal(got, exp, err_msg=f"{name} query {i} filter {f} mode {mode}")
        got_set = set(x for x in res.ids_list(i))
        assert got_set <= set(bank.snapshot().item_ids[rows].tolist())


def cpu_backends():
    names = [n for n in available() if n in ("native", "torch", "reference")]
    out = [(n, n) for n in names]
    if "native" in names:
        out += [("native-gemm", NativeBackend(topk_path="gemm")), ("native-python-driver", NativeBackend(beam_driver="python"))]
    return out


def _cfg():
    return RFMemConfig(out_k=6, probe_k=6, beam_width=2, max_rounds=3)


# --------------------------------------------------------------------------- the language
def test_language_against_the_plain_python_oracle():
    bank = make_bank(1, [120, 45])
    rng = np.random.default_rng(11)
    snap = bank.snapshot()
    fs = [random_filter(rng) for _ in range(150)] + [{}, {"$not": {}}, {"rank": 3}, {"nested": {"lvl": 2}},
                                                     {"score": 5.0}, {"flag": {"$eq": True}}, {"score": {"$gt": 4.5}}]
    for f in fs:
        for user in ("u0", "u1"):
            u = bank.user_index(user)
            got = parse_filter(f).mask(bank, snap, u)
            want = np.zeros(got.shape, dtype=bool)
            want[matching_rows(bank, user, f) - snap.offsets[u]] = True
            np.testing.assert_array_equal(got, want, err_msg=str(f))


def test_semantics_of_missing_fields_numbers_and_values():
    bank = MemoryBank(4)
    metas = [{"n": 1}, {"n": 1.0}, {"n": True}, {"n": "1"}, None, {"m": 2}, {"n": [1, {"a": 2}]}, {"n": None}]
    bank.add("u", np.eye(4)[np.arange(8) % 4] + 0.01 * np.arange(8)[:, None], list(range(8)), metadata=metas,
             created_at=[T0] * 7 + [T0 + 5])
    snap = bank.snapshot()

    def rows(f):
        return np.flatnonzero(parse_filter(f).mask(bank, snap, 0)).tolist()

    assert rows({"n": 1}) == [0, 1]  # numbers by value; true is not 1; "1" is a string
    assert rows({"n": True}) == [2] and rows({"n": "1"}) == [3] and rows({"n": None}) == [7]
    assert rows({"n": {"$ne": 1}}) == [2, 3, 6, 7]  # items WITHOUT the field never match a comparison
    assert rows({"n": {"$nin": [1, "1"]}}) == [2, 6, 7]
    assert rows({"$not": {"n": 1}}) == [2, 3, 4, 5, 6, 7]  # $not includes them
    assert rows({"n": {"$exists": False}}) == [4, 5] and rows({"n": {"$exists": True}}) == [0, 1, 2, 3, 6, 7]
    assert rows({"n": [1.0, {"a": 2.0}]}) == [6]  # whole-value equality, numbers by value inside
    assert rows({"n": {"$gte": 1}}) == [0, 1]  # a range: numbers only (not bools, not strings)
    assert rows({"n": {"$gte": "0"}}) == [3]  # string bound: the string values
    assert rows({"created_at": {"$gt": T0}}) == [7]
    assert rows({"created_at": datetime.fromtimestamp(T0, tz=timezone.utc)}) == list(range(7))
    assert rows({"created_at": {"$in": [T0 + 5, "2020-01-01T00:00:00Z"]}}) == [7]
    assert rows({}) == list(range(8)) and rows({"$and": [{"n": 1}, {"$or": [{"m": 2}, {"n": 1.0}]}]}) == [0, 1]


@pytest.mark.parametrize(
    "f, exc, match",
    [
        ({"score": {"$gte": [1, 2]}}, TypeError, r"filters\['score'\]\['\$gte'\]: expected a number, a string or a datetime, got list"),
        ({"created_at": {"$gte": [1]}}, TypeError, r"filters\['created_at'\]\['\$gte'\]: expected a number of seconds"),
        ({"score": {"$foo": 1}}, ValueError, r"filters\['score'\]\['\$foo'\]: unknown operator '\$foo'"),
        ({"$nor": []}, ValueError, r"filters\['\$nor'\]: unknown operator"),
        ({"$and": []}, ValueError, r"filters\['\$and'\]: expected a non-empty list"),
        ({"$or": {"a": 1}}, TypeError, r"filters\['\$or'\]: expected a list of filters, got dict"),
        ({"$and": [{"a": 1}, 3]}, TypeError, r"filters\['\$and'\]\[1\]: a filter must be a dict, got int"),
        ({"$not": {"a": {"$in": 3}}}, TypeError, r"filters\['\$not'\]\['a'\]\['\$in'\]: expected a list of values, got int"),
        ({"a": {"$exists": 1}}, TypeError, r"filters\['a'\]\['\$exists'\]: expected true or false, got int"),
        ({"a": {"$eq": float("nan")}}, ValueError, r"filters\['a'\]\['\$eq'\]: numbers must be finite"),
        ({"a": {"$lt": float("inf")}}, ValueError, r"filters\['a'\]\['\$lt'\]: numbers must be finite"),
        ({"created_at": {"$gte": "2026-13-01T00:00:00Z"}}, ValueError, r"filters\['created_at'\]\['\$gte'\]: '2026-13-01T00:00:00Z' is not an ISO-8601 date-time"),
        ({"created_at": {"$gte": "2026-11-01"}}, ValueError, r"has no UTC offset"),
        ({"created_at": {"$gte": datetime(2026, 1, 1)}}, ValueError, r"naive datetime"),
        ({"a": datetime(2026, 1, 1, tzinfo=timezone.utc)}, TypeError, r"filters\['a'\]: a datetime compares only with a range"),
        ({"a": {"$gt": 1, "b": 2}}, ValueError, r"filters\['a'\]: mixes operators and plain keys"),
        ({"a..b": 1}, ValueError, r"not a field path"),
        ({3: 1}, TypeError, r"field names must be str"),
        ("tag", TypeError, r"filters must be a dict, a sequence of b dicts / None, or None, got str"),
        ([3], TypeError, r"filters\[0\]: a filter must be a dict, got int"),
        ({"a": {"$eq": {1, 2}}}, TypeError, r"filters\['a'\]\['\$eq'\]: expected a JSON value"),
    ],
)
def test_bad_filters_name_the_part(f, exc, match):
    bank = make_bank(2, [10])
    with pytest.raises(exc, match=match):
        search(bank, np.ones((1, 16)), ["u0"], _cfg(), mode="dense", backend="torch", filters=f)


def test_bad_filters_type_against_the_users_values_and_per_query_lists():
    bank = MemoryBank(4)
    bank.add("s", np.eye(4), list(range(4)), metadata=[{"tag": "a"}, {"tag": "b"}, {"n": 1}, None])
    bank.add("n", np.eye(4), list(range(4)), metadata=[{"tag": 1}, {"tag": 2}, None, None])
    with pytest.raises(TypeError, match=r"filters\['tag'\]\['\$gte'\]: compares a number with the field 'tag', whose values are strings"):
        search(bank, np.ones((1, 4)), ["s"], mode="dense", filters={"tag": {"$gte": 3}})
    with pytest.raises(TypeError, match=r"compares a string with the field 'tag', whose values are numbers"):
        search(bank, np.ones((1, 4)), ["n"], mode="dense", filters={"tag": {"$lt": "b"}})
    with pytest.raises(TypeError, match=r"compares a datetime with the field 'tag', whose values are numbers"):
        search(bank, np.ones((1, 4)), ["n"], mode="dense", filters={"tag": {"$lt": datetime(2026, 1, 1, tzinfo=timezone.utc)}})
    res = search(bank, np.ones((1, 4)), ["n"], RFMemConfig(out_k=4, probe_k=4), mode="dense", filters={"tag": {"$gte": 2}})
    assert res.ids_list(0) == [1]  # a field of the right type for this user: no error
    with pytest.raises(ValueError, match=r"filters\[1\]\['tag'\]\['\$bad'\]: unknown operator"):
        search(bank, np.ones((2, 4)), ["s", "n"], mode="dense", filters=[None, {"tag": {"$bad": 1}}])
    with pytest.raises(ValueError, match="filters has 3 entries but there are 2 queries"):
        search(bank, np.ones((2, 4)), ["s", "n"], mode="dense", filters=[None, None, None])
    with pytest.raises(TypeError, match="filters must be a dict"):
        search(bank, np.ones((2, 4)), ["s", "n"], mode="dense", filters="tag")


# --------------------------------------------------------------------------- exact numbers at any magnitude
def _backend_names():
    return [n for n in available() if n in ("native", "torch", "reference", "exact")]


@pytest.mark.parametrize("backend", _backend_names())
def test_ranges_beyond_2_53_minimal_cases(backend):
    bank = MemoryBank(8)
    bank.add("u", np.random.default_rng(0).normal(size=(4, 8)), ["at", "above", "ns", "ns-1"],
             metadata=[{"n": 2**53}, {"n": 2**53 + 1}, {"t": 1767225600123456789}, {"t": 1767225600123456788}])
    cfg = RFMemConfig(out_k=4, probe_k=4)

    def ids(f):
        return sorted(search(bank, np.ones((1, 8)), ["u"], cfg, mode="dense", backend=backend, filters=f).ids_list(0))

    assert ids({"n": {"$gt": 2**53}}) == ["above"]
    assert ids({"n": {"$gte": 2**53 + 1, "$lte": 2**53 + 1}}) == ["above"]
    assert ids({"t": {"$gt": 1767225600123456788}}) == ["ns"]
    assert ids({"t": {"$gte": 1767225600123456788, "$lt": 1767225600123456789}}) == ["ns-1"]
    assert ids({"n": {"$gt": 9007199254740992.0}}) == ["above"]  # 2**53 + 1 > float(2**53)
    assert ids({"n": {"$lte": 2**53 + 0.5}}) == ["at"] and ids({"n": {"$lt": 2**53 + 0.5}}) == []  # it rounds to 2**53
    # beyond int64 / float64; nothing matches: an empty selection (torch: its compacted view is empty)
    assert ids({"n": {"$gt": 2**70}}) == [] and ids({"n": {"$lt": -(10**400)}}) == []


def test_numbers_compare_exactly_at_every_magnitude():
    bank = MemoryBank(4)
    vals = [2**60, float(2**60), 0, 0.5, -0.5, 2**63 - 1, 2**63, 2**70, -(2**70), 10**400, [2**60], {"a": 2**53 + 1}]
    bank.add("u", np.eye(4)[np.arange(len(vals)) % 4], list(range(len(vals))), metadata=[{"n": v} for v in vals])
    snap = bank.snapshot()

    def rows(f):
        return np.flatnonzero(parse_filter(f).mask(bank, snap, 0)).tolist()

    assert rows({"n": {"$gte": 2**60, "$lte": 2**60}}) == [0, 1] == rows({"n": float(2**60)})
    assert rows({"n": {"$gt": 2**60 - 1, "$lt": 2**60 + 1}}) == [0, 1]
    assert rows({"n": {"$gt": 0, "$lt": 1}}) == [3] and rows({"n": {"$gt": -0.5, "$lt": 0.5}}) == [2]
    assert rows({"n": {"$gte": 2**63 - 1, "$lte": 2**63}}) == [5, 6]  # int64's edge, both sides
    assert rows({"n": {"$gt": 2**63 - 1}}) == [6, 7, 9] and rows({"n": {"$gt": float(2**63)}}) == [7, 9]
    assert rows({"n": {"$lt": -(2**69)}}) == [8] and rows({"n": {"$gte": 10**400}}) == [9]
    assert rows({"n": {"$gt": 1e308}}) == [9]  # 10**400 is beyond every float
    assert rows({"n": [float(2**60)]}) == [10]  # inside lists and objects too
    assert rows({"n": {"$in": [{"a": 2**53 + 1}]}}) == [11] and rows({"n": {"a": float(2**53 + 1)}}) == []
    assert rows({"n": {"$nin": [2**60, 0.5, 10**400]}}) == [2, 4, 5, 6, 7, 8, 10, 11]
    with pytest.raises(ValueError, match=r"filters\['created_at'\]\['\$gt'\]: expected a finite number of seconds"):
        parse_filter({"created_at": {"$gt": 10**400}})


#: centres of the randomized values: float64's exact-int edge, int64's edges, a nanosecond
#: timestamp, beyond int64, and 0
_EDGES = (0, 2**53, -(2**53), 2**63, -(2**63), 2**64, 1767225600123456789, 2**70, -(2**70))


def _edge_number(rng):
    """An int or a float within a few units of an edge (rounded, adjacent or halves)."""
    c = _EDGES[int(rng.integers(len(_EDGES)))]
    d = int(rng.integers(-3, 4))
    r = rng.random()
    if r < 0.5:
        return c + d
    if r < 0.75:
        return float(c + d)
    if r < 0.9:
        return math.nextafter(float(c), math.inf if d >= 0 else -math.inf)
    return float(c) + d / 2


def _edge_filter(rng, present):
    """A random comparison of field 'n' against edge numbers (ranges, equality, membership)."""
    def bound():
        r = rng.random()
        if r < 0.05:
            return 10**400 if rng.random() < 0.5 else -(10**400)
        if r < 0.4 and present:  # an item's own value, or it as the other type
            v = present[int(rng.integers(len(present)))]
            return v if rng.random() < 0.5 else (float(v) if isinstance(v, int) and abs(v) < 2**1000 else v)
        return _edge_number(rng)

    kind = int(rng.integers(0, 6))
    if kind == 0:
        return {"n": {str(rng.choice(["$gt", "$gte", "$lt", "$lte"])): bound()}}
    if kind == 1:
        lo, hi = bound(), bound()
        return {"n": {"$gte": lo, "$lte": hi}} if rng.random() < 0.5 else {"n": {"$gt": lo, "$lt": hi}}
    if kind == 2:
        return {"n": bound()}
    if kind == 3:
        return {"n": {"$ne": bound()}}
    return {"n": {"$in" if kind == 4 else "$nin": [bound() for _ in range(int(rng.integers(1, 4)))]}}


def _py_match(meta, cond):
    """Does metadata ``meta`` match ``{"n": cond}``? Python's own ==, <, > on the stored value."""
    if meta is None or "n" not in meta:
        return False
    v = meta["n"]
    conds = cond.items() if isinstance(cond, dict) else [("$eq", cond)]
    for op, x in conds:
        if op in _OPS:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and _OPS[op](v, x)
        elif op in ("$eq", "$ne"):
            ok = (v == x) == (op == "$eq")
        else:
            ok = any(v == y for y in x) == (op == "$in")
        if not ok:
            return False
    return True


def _edge_bank_items(rng, n):
    """n items' metadata: edge numbers, with a few strings, missing fields and no metadata."""
    metas = []
    for _ in range(n):
        r = rng.random()
        metas.append(None if r < 0.04 else {"m": 1} if r < 0.08 else {"n": "s"} if r < 0.12
                     else {"n": _edge_number(rng)})
    return metas


@pytest.mark.parametrize("backend", _backend_names())
def test_numbers_against_python_on_every_backend(backend):
    rng = np.random.default_rng(2053)
    d, sizes = 8, {"big": 48, "small": 20}
    bank = MemoryBank(d)
    metas = {}
    for user, n in sizes.items():
        metas[user] = _edge_bank_items(rng, n)
        if user == "small":  # numbers float64 holds exactly: the vectorised path alone
            metas[user] = [{"n": int(rng.integers(-5, 6)) if rng.random() < 0.5 else float(rng.integers(-10, 11)) / 2}
                           for _ in range(n)]
        bank.add(user, rng.normal(size=(n, d)), [f"{user}-{j}" for j in range(n)], metadata=metas[user])
    users = [("big", "small")[j % 4 == 3] for j in range(40)]
    filters = []
    for user in users:
        present = [m["n"] for m in metas[user] if m and isinstance(m.get("n"), (int, float))]
        filters.append(_edge_filter(rng, present))
    cfg = RFMemConfig(out_k=max(sizes.values()), probe_k=4)
    res = search(bank, rng.normal(size=(len(users), d)), users, cfg, mode="dense", backend=backend, filters=filters)
    matched = 0
    for i, (user, f) in enumerate(zip(users, filters)):
        want = {f"{user}-{j}" for j, m in enumerate(metas[user]) if _py_match(m, f["n"])}
        assert set(res.ids_list(i)) == want, (i, f)
        matched += len(want)
    assert matched > 100  # the filters match something


def test_numbers_against_python_through_memory():
    from rfmem_fast import Memory

    rng = np.random.default_rng(2063)
    n = 40
    metas = _edge_bank_items(rng, n)
    mem = Memory(encoder=False, dim=8)
    try:
        ids = mem.add(None, "ana", vectors=rng.normal(size=(n, 8)), ids=[f"m{j}" for j in range(n)], metadata=metas)
        present = [m["n"] for m in metas if m and isinstance(m.get("n"), (int, float))]
        for _ in range(30):
            f = _edge_filter(rng, present)
            hits = mem.search(rng.normal(size=8), "ana", k=n, mode="dense", filters=f)
            assert {h.id for h in hits} == {ids[j] for j, m in enumerate(metas) if _py_match(m, f["n"])}, f
    finally:
        mem.close()


# --------------------------------------------------------------------------- exact filtered search
def _rank_filters(n_u, k):
    """Filters matching 0, 1, k - 1, k and all of a user's ranked items (rank is a permutation)."""
    return [{"rank": {"$lt": m}} for m in (0, 1, k - 1, k, n_u)] + [{}]


@pytest.mark.parametrize("label, backend", cpu_backends(), ids=[b[0] for b in cpu_backends()])
@pytest.mark.parametrize("mode", MODES)
def test_filtered_search_is_exact_on_every_backend(label, backend, mode):
    if label == "reference" and mode != "dense":
        sizes, nq = [40, 7], 6  # scikit-learn KMeans per problem: a smaller case
    else:
        sizes, nq = [70, 7, 140], 12
    bank = make_bank(3, sizes)
    cfg = _cfg()
    rng = np.random.default_rng(5)
    users = [f"u{int(u)}" for u in rng.integers(0, len(sizes), nq)]
    Q = rng.normal(size=(nq, 16))
    filters = []
    for j, user in enumerate(users):
        n_u = bank.user_size(user)
        choices = _rank_filters(n_u, cfg.out_k) + [random_filter(rng) for _ in range(3)] + [None]
        filters.append(choices[j % len(choices)])
    assert_same_as_sub_bank(bank, Q, users, filters, cfg, mode, backend)
    # one filter for the whole batch
    assert_same_as_sub_bank(bank, Q, users, {"tag": {"$in": ["work", "home"]}}, cfg, mode, backend)


@pytest.mark.parametrize("backend", [b for b in ("native", "torch") if b in available()])
def test_half_precision_bank_and_list_and_mask_modes(backend):
    bank = make_bank(4, [300, 60], dtype="float16")
    cfg = _cfg()
    users = ["u0"] * 6 + ["u1"] * 2
    Q = np.random.default_rng(6).normal(size=(8, 16))
    # selectivities on both sides of the list / mask rule
    fs = [{"rank": {"$lt": m}} for m in (0, 1, 5, 60, 200, 300)] + [{"rank": {"$lt": 10}}, {"rank": {"$gte": 5}}]
    sel = compile_filters(bank, bank.snapshot(), bank.segments_for(users), fs)
    lm = sel.list_mode()
    assert lm.any() and (~lm).any() and LIST_MAX_FRACTION == 0.25
    for mode in ("dense", "rfmem"):
        assert_same_as_sub_bank(bank, Q, users, fs, cfg, mode, backend, dtype="float16")


@pytest.mark.skipif("native" not in available(), reason="native backend not built")
def test_native_threads_row_parts_rescans_and_gemm_with_filters():
    """A long user split into row parts over 2 threads, GEMM-path and scan-path batches,
    and near-duplicate rows (whose kept lists fill with near-ties, so both the segment
    rescan of a mask-mode query and the list rescan of a list-mode one run): every
    filtered query equals the reference (filter, then brute force), and a sample the
    independent fsum oracle."""
    bank, Q0, _ = near_duplicate_bank(7, 16, 8192)
    n = bank.user_size("dups")
    bank.set_metadata("dups", bank.item_ids_of("dups"), [{"b": int(j % 10), "rank": int(j)} for j in range(n)])
    users = ["dups"] * 60  # 12 queries per selection: lists on "auto" (gemm_pays: from 18 at AVX-512), masks on "gemm"
    Q = np.tile(Q0, (10, 1))[:60]
    fs = [{"b": {"$lt": 5}}, {"b": 3}, {"rank": {"$lt": 3}}, {"b": {"$in": [1, 2, 3, 4, 5, 6, 7, 8]}}, {"b": {"$lt": 2}}] * 12
    for k in (5, 12):
        cfg = RFMemConfig(out_k=k, probe_k=k)
        ref = search(bank, Q, users, cfg, mode="dense", backend="reference", filters=fs)
        for i in range(0, 60, 13):
            want_r, want_s = dense_oracle(bank, Q[i], matching_rows(bank, users[i], fs[i]), k)
            np.testing.assert_array_equal(ref.rows[i], want_r)
            np.testing.assert_array_equal(ref.scores[i], want_s)
        for be in (NativeBackend(num_threads=2), NativeBackend(num_threads=2, topk_path="scan"), NativeBackend(num_threads=1),
                   NativeBackend(num_threads=2, topk_path="gemm")):  # fmt: skip
            res = search(bank, Q, users, cfg, mode="dense", backend=be, filters=fs)
            np.testing.assert_array_equal(res.rows, ref.rows)
            np.testing.assert_array_equal(res.scores, ref.scores)
            one = search(bank, Q[:1], users[:1], cfg, mode="dense", backend=be, filters=fs[1])  # alone: the same
            np.testing.assert_array_equal(one.rows[0], search(bank, Q[:1], users[:1], cfg, mode="dense",
                                                                backend="reference", filters=fs[1]).rows[0])  # fmt: skip


@pytest.mark.parametrize("fusion", ["convex", "rrf", "zscore"])
def test_lexical_channel_drops_hits_outside_the_filter(fusion):
    rng = np.random.default_rng(9)
    words = ["apple", "river", "stone", "cloud", "tiger", "piano", "lemon", "glass"]
    bank = MemoryBank(16)
    n = 50
    texts = [" ".join(rng.choice(words, size=4)) for _ in range(n)]
    bank.add("u", rng.normal(size=(n, 16)), list(range(n)), texts=texts,
             metadata=[{"keep": bool(j % 3 == 0)} for j in range(n)])
    cfg = RFMemConfig(out_k=8, probe_k=8, lexical_weight=0.5, fusion=fusion, lexical_depth=20)
    Q = rng.normal(size=(4, 16))
    qt = ["apple river", "tiger", "piano glass lemon", "nothing known"]
    f = {"keep": True}
    allow = np.array([j % 3 == 0 for j in range(n)])
    for be in [b for b in ("native", "torch", "reference") if b in available()]:
        res = search(bank, Q, ["u"] * 4, cfg, mode="dense", backend=be, query_texts=qt, filters=f)
        X = bank.snapshot().vectors
        for i in range(4):
            qn = unit_query(Q[i])
            dense = np.array([float(exact_f32(qn, X[r])) for r in range(n)])
            lex = np.where(allow, bm25_scores(texts, qt[i]), 0.0)  # the user's BM25, hits outside dropped
            idx = np.flatnonzero(allow)
            d, lx = dense[idx], lex[idx]
            w = cfg.lexical_weight
            if fusion == "rrf":
                D = max(cfg.lexical_depth, cfg.out_k, cfg.probe_k)
                dorder = np.lexsort((idx, -d))[:D]
                drank = np.zeros(idx.size, dtype=np.int64)
                drank[dorder] = np.arange(1, dorder.size + 1)
                hits = np.flatnonzero(lx > 0)
                lorder = hits[np.lexsort((idx[hits], -lx[hits]))][:D]
                lrank = np.zeros(idx.size, dtype=np.int64)
                lrank[lorder] = np.arange(1, lorder.size + 1)
                kk = cfg.lexical_rrf_k
                fused = np.where(drank > 0, 1.0 / (kk + drank), 0.0) + np.where(lrank > 0, 1.0 / (kk + lrank), 0.0)
            elif fusion == "convex":
                mx = lx.max(initial=0.0)
                fused = d + w * (lx / mx if mx > 0 and cfg.lexical_norm != "raw" else lx)
            else:
                mu = lx.sum() / idx.size
                sd = math.sqrt(max((lx * lx).sum() / idx.size - mu * mu, 0.0))
                mean_d = float(qn.astype(np.float64) @ X[idx].astype(np.float64).mean(axis=0))
                gap = max(float(d.max()) - mean_d, 0.0)
                fused = d + ((w * gap / sd) * lx if sd > 0 else 0.0)
            order = np.lexsort((idx, -fused))[: cfg.out_k]
            assert res.rows[i].tolist() == idx[order].tolist(), (be, i)
            np.testing.assert_allclose(res.scores[i], fused[order].astype(np.float32), rtol=1e-6, atol=1e-7)
            assert set(res.ids_list(i)) <= {j for j in range(n) if allow[j]}


def test_torch_output_search_tensors_and_selection_reuse():
    bank = make_bank(12, [50, 20])
    snap = bank.snapshot()
    Q = np.random.default_rng(3).normal(size=(3, 16))
    users = ["u0", "u1", "u0"]
    fs = [{"tag": "work"}, None, {"rank": {"$lt": 4}}]
    cfg = _cfg()
    want = search(bank, Q, users, cfg, mode="rfmem", backend="torch", filters=fs)
    got = search(bank, torch.tensor(Q, dtype=torch.float32), users, cfg, mode="rfmem", backend="torch",
                 output="torch", filters=fs).to_result()
    assert got.ids.tolist() == want.ids.tolist() and np.array_equal(got.scores, want.scores)
    be = get_backend("torch")
    view = be.view(bank)
    assert view.snapshot is snap
    sel = compile_filters(bank, snap, bank.segments_for(users), fs)
    Qn = torch.tensor(Q / np.linalg.norm(Q, axis=1, keepdims=True), dtype=torch.float32)
    res = search_tensors(be, view, Qn, torch.from_numpy(bank.segments_for(users)), cfg, "rfmem", host_output=True,
                         selection=sel)  # fmt: skip
    assert res["ids"].tolist() == want.ids.tolist()
    assert compile_filters(bank, snap, bank.segments_for(users), [None] * 3) is None  # unfiltered: the plain path
    again = compile_filters(bank, snap, bank.segments_for(users), fs)
    assert again.rows.tolist() == sel.rows.tolist()
    bank.set_metadata("u0", ["u0-0"], [{"tag": "work", "rank": 0}])  # metadata change: compiled afresh
    after = compile_filters(bank, bank.snapshot(), bank.segments_for(users), fs)
    assert snap.offsets[0] + 0 in after.rows[after.off[0] : after.off[1]]


@pytest.mark.skipif("native" not in available(), reason="native backend not built")
def test_native_binding_refuses_malformed_selections():
    from rfmem_fast import _native

    X = np.eye(8, dtype=np.float32)
    off = np.array([0, 5, 8], dtype=np.int64)
    Q = X[:2].copy()
    qseg = np.array([0, 1], dtype=np.int64)
    good = dict(qsel=np.array([0, -1], dtype=np.int64), sel_seg=np.array([0], dtype=np.int64),
                sel_off=np.array([0, 2], dtype=np.int64), sel_rows=np.array([1, 3], dtype=np.int64),
                sel_mask=np.zeros(0, dtype=np.uint8), sel_mask_off=np.array([-1], dtype=np.int64))
    s, r = _native.segmented_topk(X, off, Q, qseg, 3, **good)
    assert r[0].tolist() == [1, 3, -1] and r[1].tolist() == [5, 6, 7]
    mask = dict(good, sel_mask=np.array([0, 1, 0, 1, 0], dtype=np.uint8), sel_mask_off=np.array([0], dtype=np.int64))
    assert _native.segmented_topk(X, off, Q, qseg, 3, **mask)[1][0].tolist() == [1, 3, -1]
    bad = [
        (dict(good, sel_rows=np.array([1, 6], dtype=np.int64)), "increase inside the selection's segment"),
        (dict(good, sel_rows=np.array([3, 1], dtype=np.int64)), "increase inside"),
        (dict(good, qsel=np.array([0, 0], dtype=np.int64)), "names a selection of segment 0 for a query of segment 1"),
        (dict(good, qsel=np.array([2, -1], dtype=np.int64)), "neither -1 nor a selection index"),
        (dict(mask, sel_mask=np.array([1, 1, 0, 1, 0], dtype=np.uint8)), "sel_mask must mark exactly its sel_rows"),
        (dict(mask, sel_mask_off=np.array([3], dtype=np.int64)), "sel_mask_off must be -1"),
        ({k: v for k, v in good.items() if k != "sel_mask"}, "must be given together"),
    ]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            _native.segmented_topk(X, off, Q, qseg, 3, **kw)


# --------------------------------------------------------------------------- created_at
def test_created_at_add_update_delete_compact_and_snapshot():
    bank = MemoryBank(4)
    bank.add("u", np.eye(4), ["a", "b", "c", "d"], created_at=[10.0, 20.0, 30.0, 40.0])
    bank.add("u", np.ones((1, 4)), ["e"])  # default: now
    snap = bank.snapshot()
    assert snap.created_at.dtype == np.float64 and snap.created_at[:4].tolist() == [10.0, 20.0, 30.0, 40.0]
    assert abs(snap.created_at[4] - datetime.now(timezone.utc).timestamp()) < 60
    bank.update("u", ["b"], np.ones((1, 4)))  # kept
    bank.update("u", ["c"], np.ones((1, 4)), created_at=33.5)  # replaced
    bank.delete("u", ["a"])
    assert bank.created_at_of("u", ["b", "c", "d"]).tolist() == [20.0, 33.5, 40.0]
    bank.compact()
    assert bank.snapshot().created_at[:3].tolist() == [20.0, 33.5, 40.0]
    with pytest.raises(ValueError, match=r"created_at\[1\] must be finite \(or NaN: unknown\)"):
        bank.add("u", np.eye(2, 4), ["x", "y"], created_at=[1.0, float("inf")])
    bank.add("u", np.eye(1, 4), ["nan"], created_at=float("nan"))  # NaN: unknown
    assert np.isnan(bank.created_at_of("u", ["nan"])[0])
    bank.delete("u", ["nan"])
    with pytest.raises(TypeError, match="created_at must be None, a number"):
        bank.add("u", np.eye(1, 4), ["x"], created_at="2026-01-01")
    with pytest.raises(ValueError, match="created_at has 1 entries but there are 2 items"):
        bank.add("u", np.eye(2, 4), ["x", "y"], created_at=[1.0])
    assert "x" not in bank.item_ids_of("u")  # nothing written


@pytest.mark.parametrize("mmap", [False, True])
def test_created_at_store_round_trip_and_older_stores(tmp_path, mmap):
    bank = make_bank(13, [30, 12])
    bank.save(tmp_path / "s")
    back = MemoryBank.load(tmp_path / "s", mmap=mmap)
    np.testing.assert_array_equal(back.snapshot().created_at, bank.snapshot().created_at)
    f = {"created_at": {"$lt": T0 + 50 * DAY}}
    Q = np.random.default_rng(1).normal(size=(2, 16))
    a = search(bank, Q, ["u0", "u1"], _cfg(), mode="dense", filters=f)
    b = search(back, Q, ["u0", "u1"], _cfg(), mode="dense", filters=f)
    assert a.ids.tolist() == b.ids.tolist()
    back.add("u0", np.ones((1, 16)), ["new"], created_at=T0)  # a loaded (memory-mapped) bank takes writes
    assert back.created_at_of("u0", ["new"]).tolist() == [T0]
    # a store written before creation times (format 1): every time unknown (NaN)
    old = MemoryBank.load(DATA / "store_v1_float32", mmap=mmap)
    s = old.snapshot()
    assert np.isnan(s.created_at).all()
    user = s.users[0]
    n = old.user_size(user)
    q = s.vectors[:1]
    none = search(old, q, [user], RFMemConfig(out_k=3, probe_k=3), mode="dense", filters={"created_at": {"$gte": 0}})
    assert none.ids_list(0) == []
    unknown = search(old, q, [user], RFMemConfig(out_k=3, probe_k=3), mode="dense",
                     filters={"created_at": {"$exists": False}})  # fmt: skip
    assert len(unknown.ids_list(0)) == min(3, n)
    old.save(tmp_path / "again")
    man = json.loads(next((tmp_path / "again").glob("snap-*/manifest.json")).read_text())
    assert man["format_version"] == 4 and "created_at.npy" in man["files"]
    assert np.isnan(MemoryBank.load(tmp_path / "again").snapshot().created_at).all()


# --------------------------------------------------------------------------- triton (interpreter, own process)
_TRITON_CHILD = r"""
import numpy as np, sys
sys.path.insert(0, {tests!r})
from test_filters import make_bank, assert_same_as_sub_bank, _rank_filters, RFMemConfig
from rfmem_fast.backends.triton_backend import TritonBackend
bank = make_bank(21, [24, 9])
cfg = RFMemConfig(out_k=4, probe_k=4, beam_width=2, max_rounds=2)
users = ["u0", "u1", "u0", "u0", "u1"]
Q = np.random.default_rng(2).normal(size=(5, 16))
fs = [{{"rank": {{"$lt": 0}}}}, {{"rank": {{"$lt": 3}}}}, {{"rank": {{"$lt": 4}}}}, None, {{"tag": "work"}}]
be = TritonBackend("cpu")
for mode in ("dense", "rfmem"):
    assert_same_as_sub_bank(bank, Q, users, fs, cfg, mode, be)
print("TRITON-FILTERS-OK")
"""


def test_triton_backend_filters_in_the_interpreter():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the triton backend compiled (tests/test_gpu.py)")
    code = _TRITON_CHILD.format(tests=str(Path(__file__).parent))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "TRITON-FILTERS-OK" in res.stdout, (res.stdout + res.stderr)[-6000:]


@pytest.mark.skipif("native" not in available(), reason="native backend not built")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_native_recollect_kernel_selection_equals_the_compacted_driver(dtype):
    """NativeBackend.recollect runs a filtered batch on the compacted rows of its
    selections; the C++ driver's own selection support (every round's top-k applying
    the selection, list and mask modes) gives the same rows, scores and rounds."""
    from rfmem_fast import _native
    from rfmem_fast.backends.native import _draws_by_clusters
    from rfmem_fast.recollection import recollection_capacity

    bank = make_bank(31, [300, 80, 40], dtype=dtype)
    rng = np.random.default_rng(4)
    users = [f"u{int(u)}" for u in rng.integers(0, 3, 24)]
    Q = torch.from_numpy(np.stack([unit_query(q) for q in rng.normal(size=(24, 16))]))
    fs = [{"rank": {"$lt": m}} for m in (0, 2, 30, 100, 160, 290)] * 4
    fs[5] = None  # an unfiltered query in the batch
    cfg = RFMemConfig(out_k=8, probe_k=8, beam_width=3, max_rounds=4, mmr_lambda=0.9)
    be = NativeBackend()
    view = be.view(bank)
    seg = bank.segments_for(users)
    sel = compile_filters(bank, view.snapshot, seg, fs)
    assert sel.list_mode().any() and (~sel.list_mode()).any()
    qseg = torch.from_numpy(seg)
    k0 = max(cfg.probe_k, cfg.beam_width * cfg.fanout)
    s0, r0, *_ = be.probe(view, Q, qseg, k0, cfg.probe_k, cfg.temperature, cfg.entropy, sel=sel)
    want = be.recollect(view, Q, qseg, cfg, level0=(s0, r0), sel=sel)
    X, off = be._bank(view)
    width = recollection_capacity(cfg) + 1
    rows, scores, rounds = _native.recollect(
        X, off, Q.numpy(), seg, s0.numpy(), r0.numpy(), cfg.beam_width, cfg.fanout, cfg.max_rounds, cfg.out_k,
        float(cfg.alpha), float(cfg.mmr_lambda), float(cfg.score_floor), cfg.kmeans_iters, float(cfg.kmeans_tol),
        _draws_by_clusters(int(cfg.kmeans_seed), int(cfg.beam_width)), width, 1, view.row_norm_max, be.memory_budget,
        None, **be._scan_args(view), **be._sel_args(view, sel),
    )  # fmt: skip
    np.testing.assert_array_equal(rows, want.hit_rows.numpy())
    np.testing.assert_array_equal(scores[:, : cfg.out_k], want.scores.numpy())
    np.testing.assert_array_equal(rounds, want.rounds.numpy())
    assert (rows[:, 0] >= 0).sum() > 10  # the queries found something
    for i in range(24):  # never a row outside the query's selection
        p = sel.qsel[i]
        if p >= 0:
            assert set(rows[i][rows[i] >= 0].tolist()) <= set(sel.rows[sel.off[p] : sel.off[p + 1]].tolist())


# --------------------------------------------------------------------------- the facade
def test_memory_created_at_items_filters_and_replay(tmp_path):
    from _serving_helpers import WordChunkEncoder

    from rfmem_fast import Memory

    mem = Memory(tmp_path / "m", encoder=WordChunkEncoder(16), chunk_overlap=2)
    t1 = datetime(2026, 11, 1, 9, 30, tzinfo=timezone.utc)
    long_text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda"  # chunked: 3 rows
    ids = mem.add(["alpha one", "beta two", "gamma three", long_text], "u", ids=["a", "b", "c", "long"],
                  metadata=[{"tag": "work"}, {"tag": "home"}, {"tag": "work"}, {"tag": "home"}],
                  created_at=[t1, "2026-11-02T00:00:00+02:00", t1.timestamp() + 3 * DAY, t1 + timedelta(days=10)])
    assert mem.bank.user_size("u") > 4  # the long text's chunk rows
    with pytest.raises(ValueError, match=r"created_at: naive datetime"):
        mem.add(["x"], "u", created_at=datetime(2026, 1, 1))
    with pytest.raises(ValueError, match=r"created_at\[1\]: '2026-11-01' has no UTC offset"):
        mem.add(["x", "y"], "u", created_at=[t1, "2026-11-01"])
    with pytest.raises(TypeError, match=r"created_at\[0\]: expected a number of seconds"):
        mem.add(["x"], "u", created_at=[[1]])
    items = {i.id: i for i in mem.get(ids, "u")}
    assert items["a"].created_at == t1 and items["a"].created_at.tzinfo is not None
    assert items["b"].created_at == datetime(2026, 11, 1, 22, 0, tzinfo=timezone.utc)
    assert items["a"].to_dict()["created_at"] == "2026-11-01T09:30:00+00:00"
    now = mem.get(mem.add(["delta now"], "u", ids=["d"]), "u")[0].created_at
    assert abs((now - datetime.now(timezone.utc)).total_seconds()) < 60
    # filtered searches: only matching items, the chunk rows of an item counting as it
    work = mem.search("alpha one", "u", k=5, mode="dense", filters={"tag": "work"})
    assert {h.id for h in work} == {"a", "c"} and all(h.metadata["tag"] == "work" for h in work)
    late = mem.search("kappa lambda", "u", k=5, mode="dense", filters={"created_at": {"$gte": "2026-11-05T00:00:00Z"}})
    assert {h.id for h in late} == {"long", "d"}
    home_early = mem.search("kappa lambda", "u", k=5, mode="dense",
                            filters={"tag": "home", "created_at": {"$lt": t1 + timedelta(days=5)}})
    assert [h.id for h in home_early] == ["b"]  # the long item (home, but late) is not returned via its chunks
    plain = mem.search("alpha one", "u", k=5, mode="dense")
    assert len(plain) == 5 and mem.search("alpha one", "u", k=5, mode="dense", filters={"tag": "work"})[0].id == work[0].id
    for mode in ("rfmem", "recollection"):
        assert {h.id for h in mem.search("alpha one", "u", k=5, mode=mode, filters={"tag": "work"})} <= {"a", "c"}
    batch = mem.search_batch(["alpha one", "beta two"], "u", k=3, mode="dense", filters=[{"tag": "home"}, None])
    assert {h.id for h in batch[0]} == {"b", "long"} and len(batch[1]) == 3
    with pytest.raises(ValueError, match=r"filters\['tag'\]\['\$bad'\]: unknown operator"):
        mem.search("alpha", "u", filters={"tag": {"$bad": 1}})
    with pytest.raises(ValueError, match=r"filters\[1\]\['\$and'\]: expected a non-empty list"):
        mem.search_batch(["a", "b"], "u", filters=[None, {"$and": []}])
    mem.update("long", "u", metadata={"tag": "work"})  # the chunk rows follow their item's metadata
    assert "long" in {h.id for h in mem.search("kappa lambda", "u", k=5, mode="dense", filters={"tag": "work"})}
    mem._lock_file.close()  # a crash: the log alone holds the writes
    again = Memory(tmp_path / "m", encoder=WordChunkEncoder(16), chunk_overlap=2)
    assert {i.id: i.created_at for i in again.get_all("u")} == {i.id: i.created_at for i in mem.get_all("u")}
    assert {h.id for h in again.search("kappa lambda", "u", k=5, mode="dense",
                                       filters={"created_at": {"$gte": "2026-11-05T00:00:00Z"}})} == {"long", "d"}
    again.close()


def _small_memory():
    from _serving_helpers import HashEncoder
    from rfmem_fast import Memory

    mem = Memory(None, encoder=HashEncoder(16), max_wait_ms=1.0)
    mem.add(["a one", "b two", "c three", "d four"], "alice", ids=["a", "b", "c", "d"],
            metadata=[{"tag": "work", "n": 1}, {"tag": "home", "n": 2}, {"tag": "work", "n": 3}, {"tag": "home"}],
            created_at=[T0, T0 + DAY, T0 + 2 * DAY, T0 + 3 * DAY])
    mem.add(["bob work"], "bob", ids=["z"], metadata=[{"tag": "work"}])
    return mem


def test_http_search_filters_and_created_at():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from rfmem_fast.serving.app import create_app

    mem = _small_memory()
    with TestClient(create_app(mem, no_auth=True)) as c:
        r = c.post("/v1/users/alice/search", json={"query": "a one", "k": 4, "mode": "dense", "filters": {"tag": "work"}})
        assert r.status_code == 200 and [h["id"] for h in r.json()["hits"]] == ["a", "c"]
        r = c.post("/v1/users/alice/search", json={"query": "a one", "k": 4, "mode": "dense",
                                                   "filters": {"created_at": {"$gte": "2026-01-02T12:00:00Z"}}})
        assert {h["id"] for h in r.json()["hits"]} == {"c", "d"}
        r = c.post("/v1/users/alice/search/batch", json={"queries": ["a one", "b two"], "k": 2, "mode": "dense",
                                                         "filters": [{"n": {"$gte": 2}}, None]})
        assert {h["id"] for h in r.json()["results"][0]["hits"]} == {"b", "c"} and len(r.json()["results"][1]["hits"]) == 2
        bad = c.post("/v1/users/alice/search", json={"query": "a", "filters": {"n": {"$gte": [1]}}})
        assert bad.status_code == 422
        assert "filters['n']['$gte']: expected a number, a string or a datetime, got list" in json.dumps(bad.json())
        bad = c.post("/v1/users/alice/search/batch", json={"queries": ["a", "b"], "filters": [None, {"$or": []}]})
        assert bad.status_code == 422 and "filters[1]['$or']: expected a non-empty list" in json.dumps(bad.json())
        bad = c.post("/v1/users/alice/search/batch", json={"queries": ["a", "b"], "filters": [None]})
        assert bad.status_code == 422 and "filters has 1 entries but there are 2 queries" in json.dumps(bad.json())
        typed = c.post("/v1/users/alice/search", json={"query": "a", "filters": {"tag": {"$gt": 3}}})
        assert typed.status_code == 422 and "whose values are strings" in typed.json()["detail"]
        added = c.post("/v1/users/alice/memories", json={"texts": ["e five"], "ids": ["e"],
                                                         "created_at": "2026-03-01T10:00:00+01:00"})
        assert added.status_code == 201
        item = c.get("/v1/users/alice/memories/e").json()
        assert item["created_at"] == "2026-03-01T09:00:00+00:00"
        bad = c.post("/v1/users/alice/memories", json={"texts": ["f"], "created_at": "March"})
        assert bad.status_code == 422 and "created_at: 'March' is not an ISO-8601 date-time" in json.dumps(bad.json())
    mem.close()


def test_mcp_search_memories_filters():
    pytest.importorskip("mcp")
    import anyio

    from rfmem_fast.serving.mcp_server import McpScope, create_server

    mem = _small_memory()
    srv = create_server(mem, McpScope(user="alice"))

    async def run():
        out = await srv.call_tool("search_memories", {"query": "a one", "k": 4, "mode": "dense", "filters": {"tag": "work"}})
        assert [h["id"] for h in out.structured_content["hits"]] == ["a", "c"]  # never bob's 'work' item
        listed = await srv.call_tool("get_memory", {"id": "a"})
        assert listed.structured_content["created_at"] == "2026-01-01T00:00:00+00:00"
        with pytest.raises(Exception, match=r"filters\['tag'\]\['\$bad'\]: unknown operator"):
            await srv.call_tool("search_memories", {"query": "a", "filters": {"tag": {"$bad": 1}}})

    anyio.run(run)
    mem.close()


def test_langchain_and_llamaindex_filters():
    lc = pytest.importorskip("rfmem_fast.integrations.langchain")
    mem = _small_memory()
    r = lc.RFMemRetriever(memory=mem, user_id="alice", k=4, mode="dense", search_kwargs={"filters": {"tag": "home"}})
    assert [d.id for d in r.invoke("b two")] == ["b", "d"]
    assert [d.id for d in r.invoke("b two", filters={"n": 3})] == ["c"]  # per call
    with pytest.raises(Exception, match=r"search_kwargs\['filters'\]\['n'\]\['\$in'\]: expected a list"):
        lc.RFMemRetriever(memory=mem, user_id="alice", search_kwargs={"filters": {"n": {"$in": 3}}})
    li = pytest.importorskip("rfmem_fast.integrations.llamaindex")
    from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilter, MetadataFilters

    mf = MetadataFilters(filters=[MetadataFilter(key="tag", value="work"),
                                  MetadataFilter(key="n", value=2, operator=FilterOperator.GTE)])
    assert li.metadata_filters_to_filter(mf) == {"$and": [{"tag": {"$eq": "work"}}, {"n": {"$gte": 2}}]}
    assert [n.node.metadata["rfmem"]["id"] for n in li.RFMemRetriever(mem, "alice", k=4, mode="dense", filters=mf).retrieve("a one")] == ["c"]
    nor = MetadataFilters(filters=[MetadataFilter(key="tag", value="work")], condition=FilterCondition.NOT)
    assert {n.node.metadata["rfmem"]["id"] for n in li.RFMemRetriever(mem, "alice", k=4, mode="dense", filters=nor).retrieve("a")} == {"b", "d"}
    empty = MetadataFilters(filters=[MetadataFilter(key="n", value=None, operator=FilterOperator.IS_EMPTY)])
    assert [n.node.metadata["rfmem"]["id"] for n in li.RFMemRetriever(mem, "alice", k=4, mode="dense", filters=empty).retrieve("d")] == ["d"]
    with pytest.raises(ValueError, match=r"filters.filters\[0\]: the operator 'contains' has no equivalent"):
        li.metadata_filters_to_filter(MetadataFilters(filters=[MetadataFilter(key="tag", value="w", operator=FilterOperator.CONTAINS)]))
    mem.close()


@pytest.mark.skipif("native" not in available(), reason="native backend not built")
def test_bench_filters_script_tiny(tmp_path):
    """bench/bench_filters.py at tiny sizes writes every cell (no timing is asserted)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_filters", Path(__file__).parent.parent / "bench" / "bench_filters.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "f.json"
    assert mod.main(["--users", "2", "--chunks", "64", "--queries", "3", "--batch", "8", "--reps", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    for mode in ("dense", "rfmem"):
        assert set(doc["single_p50_ms"][mode]) >= {"unfiltered", "1%", "10%", "50%", "100%"}
        assert all(v > 0 for v in doc["batch_qps"][mode].values())
    assert {"1%_sub_bank", "50%_sub_bank"} <= set(doc["single_p50_ms"]["rfmem"])
    assert doc["machine"]["simd_level"] in (0, 1, 2) and doc["command"] and doc["loadavg"]
    assert set(doc["goals"]["single_dense_met"]) == {"1%", "10%", "50%"}
