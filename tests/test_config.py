"""RFMemConfig: spec defaults and validation."""
from __future__ import annotations

import pytest

from rfmem_fast import RFMemConfig


def test_defaults_are_the_golden_config():
    c = RFMemConfig()
    assert (c.probe_k, c.out_k, c.temperature, c.entropy) == (10, 10, 20.0, "mean")
    assert (c.theta_high, c.theta_low, c.tau) == (0.6, 0.2, 0.2)
    assert (c.alpha, c.beam_width, c.fanout, c.max_rounds) == (0.5, 4, 1, 10)
    assert (c.mmr_lambda, c.score_floor, c.kmeans_seed) == (0.9, 0.0, 42)
    assert c.max_candidates() == (4 + 10 - 1) * 1


def test_paper_text_preset_and_replace():
    p = RFMemConfig.paper_text()
    assert p.max_rounds == 3 and p.mmr_lambda == 1.0
    assert RFMemConfig().replace(alpha=0.7).alpha == 0.7
    with pytest.raises(ValueError, match="alpha"):
        RFMemConfig().replace(alpha=2.0)
    assert RFMemConfig().to_dict()["beam_width"] == 4


@pytest.mark.parametrize(
    "field, value",
    [
        ("probe_k", 0), ("out_k", -1), ("temperature", 0.0), ("temperature", float("nan")),
        ("entropy", "shannon"), ("theta_high", 1.5), ("theta_low", -2.0), ("tau", -0.1),
        ("alpha", 1.01), ("beam_width", 0), ("beam_width", 65), ("fanout", 0), ("max_rounds", 0),
        ("mmr_lambda", -0.1), ("score_floor", 2.0), ("kmeans_seed", -1), ("kmeans_iters", 0),
        ("kmeans_tol", -1e-3),
    ],
)  # fmt: skip
def test_out_of_range_field_is_named(field, value):
    with pytest.raises(ValueError, match=field):
        RFMemConfig(**{field: value})


@pytest.mark.parametrize("field, value", [("probe_k", 2.5), ("beam_width", True), ("alpha", "0.5")])
def test_wrong_type_is_named(field, value):
    with pytest.raises(TypeError, match=field):
        RFMemConfig(**{field: value})


def test_theta_order_checked():
    with pytest.raises(ValueError, match="theta_low"):
        RFMemConfig(theta_low=0.7, theta_high=0.6)


def test_frozen():
    with pytest.raises(Exception):
        RFMemConfig().alpha = 0.1  # type: ignore[misc]


def test_presets():
    assert RFMemConfig.paper() == RFMemConfig()
    r = RFMemConfig.recommended()
    # hybrid dense + BM25, never recollecting (docs "Hybrid retrieval": the cross-dataset nested-CV choice)
    assert (r.profile_weight, r.theta_high, r.theta_low, r.merge, r.reranker) == (0.0, -1.0, -1.0, "none", None)
    assert (r.fusion, r.lexical_norm, r.lexical_weight) == ("convex", "raw", 0.03)
    assert (r.alpha, r.beam_width, r.fanout, r.max_rounds, r.mmr_lambda) == (0.5, 4, 1, 10, 0.9)
    m = RFMemConfig.recommended("mpnet")
    assert (m.fusion, m.lexical_norm, m.lexical_weight, m.theta_high, m.theta_low) == ("convex", "raw", 0.04, -1.0, -1.0)
    assert (m.context_weight, m.context_radius, m.thread_weight) == (0.2, 2, 0.5)
    assert (r.context_weight, r.context_radius, r.thread_weight) == (0.5, 2, 0.3)
    assert RFMemConfig.paper().profile_weight == 0.0 and RFMemConfig.paper().reranker is None
    assert RFMemConfig.recommended(out_k=5).out_k == 5
    with pytest.raises(ValueError, match="encoder"):
        RFMemConfig.recommended("bert")


def test_preset_names_a_configuration_by_comparing_every_field_but_out_k():
    """preset() is "recommended" / "paper" / "paper_text" for the presets (any out_k: the
    default k), "custom" as soon as any other field differs from all of them."""
    import dataclasses

    assert RFMemConfig().preset() == RFMemConfig.paper().preset() == "paper"
    assert RFMemConfig.paper(out_k=3).preset() == "paper"
    assert RFMemConfig.recommended().preset() == RFMemConfig.recommended("mpnet", out_k=50).preset() == "recommended"
    assert RFMemConfig.paper_text().preset() == "paper_text"
    assert RFMemConfig.recommended(lexical_weight=0.05).preset() == "custom"
    assert RFMemConfig(router="calibrated.json").preset() == "custom"
    # every field but out_k, moved off the paper's value, makes a custom configuration
    base = RFMemConfig()
    changed = {"probe_k": 11, "temperature": 19.5, "entropy": "sum", "theta_high": 0.7, "theta_low": 0.1,
               "tau": 0.3, "alpha": 0.4, "beam_width": 3, "fanout": 2, "max_rounds": 9, "mmr_lambda": 0.8,
               "score_floor": -0.1, "kmeans_seed": 7, "kmeans_iters": 100, "kmeans_tol": 1e-3, "merge": "rrf",
               "rrf_k": 30.0, "rescore_weight": 0.4, "router": "r.json", "expansion_weight": 2.0,
               "profile_weight": 0.3, "reranker": "x.json", "lexical_weight": 0.5, "fusion": "rrf",
               "lexical_norm": "raw", "lexical_rrf_k": 5.0, "lexical_depth": 50, "context_weight": 0.5,
               "context_radius": 3, "thread_weight": 0.3, "second_stage": "stage.json"}
    assert set(changed) == {f.name for f in dataclasses.fields(RFMemConfig)} - {"out_k"}
    for name, value in changed.items():
        assert base.replace(**{name: value}).preset() == "custom", name
    summary = RFMemConfig.recommended(out_k=5).summary()
    assert summary == {"preset": "recommended", "out_k": 5, "lexical_weight": 0.03, "fusion": "convex", "probe_k": 10,
                       "theta_high": -1.0, "theta_low": -1.0, "tau": 0.0, "max_rounds": 10, "score_floor": 0.0,
                       "merge": "none", "context_weight": 0.5, "context_radius": 2, "thread_weight": 0.3,
                       "router": False, "reranker": False, "second_stage": True}
    assert RFMemConfig(router="/secret/path.json").summary()["router"] is True  # no path on a status page
