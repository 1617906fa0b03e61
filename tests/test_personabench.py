"""Tests of the PersonaBench loader (RFMEM_SPEC.md section 6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _shared import shared_dir

from rfmem_fast.datasets import (
    PBQuestion,
    PersonaBench,
    chunk_text,
    load_personabench,
    noise_tag,
    resolve_synthetic_dir,
    strip_keys,
)


@pytest.fixture(scope="module")
def data_dir() -> Path:
    shared = shared_dir()
    if shared is None:
        pytest.skip("shared folder absent (set RFMEM_SHARED or place it beside the checkout)")
    path = shared / "data" / "personabench" / "eval_data_v1"
    if not (path / "synthetic_data").is_dir():
        pytest.skip(f"PersonaBench data absent: {path}")
    return path


@pytest.fixture(scope="module")
def pb(data_dir: Path) -> PersonaBench:
    return load_personabench(data_dir, noise=0.0)


@pytest.fixture(scope="module")
def golden(golden_rows: list[dict]) -> list[dict]:
    return golden_rows  # conftest.py


# ----------------------------------------------------------------- real data


def test_counts(pb: PersonaBench) -> None:
    assert len(pb.users) == 6
    assert len(pb.questions) == 263
    assert len(pb.evaluated) == 230
    assert all(q.type != "Subjective" for q in pb.evaluated)
    assert pb.noise == 0.0
    assert [u.key for u in pb.users[:3]] == [
        "0/Jennifer Moran",
        "0/David Hess",
        "0/Nicholas Torres",
    ]
    assert all(u.key.startswith("1/") for u in pb.users[3:])
    for u in pb.users:
        assert len(u.chunk_ids) == len(u.chunk_texts) > 0
        assert len(set(u.chunk_ids)) == len(u.chunk_ids)
        assert pb.user(u.key) is u
    q0 = pb.questions[0]
    assert (q0.community, q0.user, q0.q_id) == (0, "Jennifer Moran", "000000000")
    assert q0.user_key == "0/Jennifer Moran"
    assert q0.question == "Where did I go to school?"
    assert sum(len(pb.questions_of(u.key)) for u in pb.users) == 263


def test_other_locations_of_data_dir(data_dir: Path, pb: PersonaBench) -> None:
    direct = load_personabench(data_dir / "synthetic_data", communities=(0,), users_per_community=1)
    parent = load_personabench(data_dir.parent, communities=(0,), users_per_community=1)
    assert direct.users[0] == parent.users[0] == pb.users[0]
    assert resolve_synthetic_dir(data_dir) == (data_dir / "synthetic_data").resolve()


def test_golden_ids_belong_to_user(pb: PersonaBench, golden: list[dict]) -> None:
    assert len(golden) == len(pb.questions)
    for q, g in zip(pb.questions, golden):
        assert (q.community, q.user, q.q_id) == (g["community"], g["user"], g["q_id"])
        assert q.question == g["question"]
        assert (q.type, q.difficulty) == (g["type"], g["difficulty"])
        assert q.gt_segment_ids == g["gt_segment_ids"]
        ids = set(pb.user(q.user_key).chunk_ids)
        assert set(g["probe_segment_ids"]) <= ids
        for alt_ids in g["gt_segment_ids"].values():
            assert set(alt_ids) <= ids, (q.q_id, alt_ids)


def test_chunk_order_and_text(data_dir: Path, pb: PersonaBench) -> None:
    priv = data_dir / "synthetic_data" / "community_0" / "private_data" / "noise_0.0"

    def load(name: str) -> list:
        with open(priv / f"{name}.json", encoding="utf-8") as f:
            return next(r["Data"] for r in json.load(f) if r["Name"] == "Jennifer Moran")

    conv = [e for sub in load("conversation_data_all") for e in sub["Conversations"]]
    uai = load("user_ai_interaction_data_all")
    ph = load("purchase_history_data_all")
    entries = conv + uai + ph
    user = pb.users[0]
    assert user.chunk_ids == [e["segment_id"] for e in entries]

    # one known entry, spelled out: the first purchase-history session
    entry = ph[0]
    assert "session" in entry and "segment_id" in entry
    expected = json.dumps(
        {k: v for k, v in entry.items() if k not in ("session", "segment_id")},
        separators=(",", ":"),
    )
    i = user.chunk_ids.index(entry["segment_id"])
    assert user.chunk_texts[i] == expected
    assert '"session"' not in user.chunk_texts[i]
    # every chunk is ascii JSON without the removed keys
    for text in user.chunk_texts:
        assert text.isascii()
        obj = json.loads(text)
        assert "session" not in obj and "segment_id" not in obj


def test_nested_key_removal() -> None:
    entry = {
        "session": "s1",
        "segment_id": "000",
        "time": "t",
        "conversation": [
            {"role": "A", "content": "é", "session": "x", "meta": {"segment_id": 1, "k": [
                {"session": 2, "v": 3}
            ]}},
            "plain",
            ["session", {"segment_id": 4}],
        ],
    }
    stripped = strip_keys(entry)
    assert stripped == {
        "time": "t",
        "conversation": [
            {"role": "A", "content": "é", "meta": {"k": [{"v": 3}]}},
            "plain",
            ["session", {}],  # a *value* "session" stays; only keys are removed
        ],
    }
    assert entry["session"] == "s1"  # input untouched
    text = chunk_text(entry)
    assert text == json.dumps(stripped, separators=(",", ":"))
    assert "\\u00e9" in text  # default ensure_ascii


def test_noise_tag() -> None:
    assert noise_tag(0.0) == "0.0"
    assert noise_tag(0) == "0.0"
    assert noise_tag(0.3) == "0.3"
    assert noise_tag(0.7) == "0.7"
    with pytest.raises(ValueError):
        noise_tag(-0.1)
    with pytest.raises(TypeError):
        noise_tag("0.3")  # type: ignore[arg-type]


def test_noise_03_loads(data_dir: Path) -> None:
    b = load_personabench(data_dir, noise=0.3, communities=(0,), users_per_community=1)
    assert b.noise == 0.3 and len(b.users) == 1 and b.users[0].chunk_ids


# ----------------------------------------------------------------- errors


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="synthetic_data"):
        load_personabench(tmp_path / "nope")
    with pytest.raises(FileNotFoundError):
        load_personabench(tmp_path)  # exists but holds no data


def test_unknown_noise_level(data_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"noise level 0\.9.*0\.0.*0\.3"):
        load_personabench(data_dir, noise=0.9)


def test_unknown_community(data_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match="community 7"):
        load_personabench(data_dir, communities=(7,))


def _write_community(root: Path, conv: object, gt: object, info: object | None = None) -> Path:
    c = root / "synthetic_data" / "community_0"
    (c / "eval_info").mkdir(parents=True)
    priv = c / "private_data" / "noise_0.0"
    priv.mkdir(parents=True)
    if info is None:
        info = [{"Name": "U", "Eval_Info": {"qa": [
            {"q_id": "q1", "question": "?", "answer": "a", "type": "Social", "difficulty": "easy"}
        ]}}]
    (c / "eval_info" / "eval_info_all.json").write_text(json.dumps(info))
    (c / "eval_info" / "qa_gt_context_all_noise_0.0.json").write_text(
        gt if isinstance(gt, str) else json.dumps(gt)
    )
    (priv / "conversation_data_all.json").write_text(
        conv if isinstance(conv, str) else json.dumps(conv)
    )
    (priv / "user_ai_interaction_data_all.json").write_text(json.dumps([]))
    (priv / "purchase_history_data_all.json").write_text(
        json.dumps([{"Name": "U", "Data": [{"segment_id": "p1", "session": "s", "x": 1}]}])
    )
    return root


_GT = [{"q_id": "q1", "segment_id": {"a": ["c1"]}}]


def _conv(*ids: str) -> list:
    return [{"Name": "U", "Data": [{"Target_name": "V", "Conversations": [
        {"segment_id": i, "session": "s", "conversation": []} for i in ids
    ]}]}]


def test_synthetic_minimal(tmp_path: Path) -> None:
    b = load_personabench(_write_community(tmp_path, _conv("c1", "c2"), _GT), communities=(0,))
    (u,) = b.users
    assert u.chunk_ids == ["c1", "c2", "p1"]  # no user-AI entry for U: no chunks from it
    assert u.chunk_texts[2] == '{"x":1}'
    (q,) = b.questions
    assert isinstance(q, PBQuestion) and q.gt_segment_ids == {"a": ["c1"]}


def test_duplicate_segment_ids(tmp_path: Path) -> None:
    root = _write_community(tmp_path, _conv("c1", "c1"), _GT)
    with pytest.raises(ValueError, match="duplicate segment id 'c1'"):
        load_personabench(root, communities=(0,))


def test_bad_json_names_file(tmp_path: Path) -> None:
    root = _write_community(tmp_path, "{not json", _GT)
    with pytest.raises(ValueError, match="conversation_data_all.json"):
        load_personabench(root, communities=(0,))


def test_missing_key_names_file(tmp_path: Path) -> None:
    root = _write_community(tmp_path, _conv("c1"), [{"q_id": "q1"}])
    with pytest.raises(ValueError, match="qa_gt_context_all_noise_0.0.json.*segment_id"):
        load_personabench(root, communities=(0,))


def test_missing_ground_truth_names_file(tmp_path: Path) -> None:
    root = _write_community(tmp_path, _conv("c1"), [{"q_id": "other", "segment_id": {}}])
    with pytest.raises(ValueError, match="qa_gt_context_all_noise_0.0.json.*'q1'"):
        load_personabench(root, communities=(0,))


def test_bad_arguments(tmp_path: Path) -> None:
    root = _write_community(tmp_path, _conv("c1"), _GT)
    with pytest.raises(ValueError):
        load_personabench(root, users_per_community=0)
    with pytest.raises(ValueError):
        load_personabench(root, communities=(0, 0))
