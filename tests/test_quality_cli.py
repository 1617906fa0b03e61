"""Retrieval quality end to end: the evaluation harness (k list, route quality,
leave-one-user-out routers, JSON), `rfmem calibrate`, `rfmem tune`, `rfmem models`, and
the encoders installed here. PersonaBench embeddings come from the session cache
(conftest.pb_cache_dir), so nothing here encodes PersonaBench again."""
from __future__ import annotations

import json

import numpy as np
import pytest
from _shared import shared_dir

from rfmem_fast import RFMemConfig
from rfmem_fast.cli import main
from rfmem_fast.evaluate import run_personabench
from rfmem_fast.models import available_models, resolve_model
from rfmem_fast.routing import ProbeSettings, ProbeSignals, fit_router, load_router, question_recalls


@pytest.fixture(scope="module")
def data_dir(pb_embedded):  # pb_embedded fills the session's embedding cache
    return str(shared_dir() / "data" / "personabench" / "eval_data_v1")


def test_eval_with_the_latency_loop_and_the_default_encoder_name(data_dir, pb_cache_dir, pb_embedded, tmp_path, capsys):
    """The README's main job runs the single-query latency loop with ``--encoder`` at its
    default ("minilm", a str: it has an ``encode`` method too and once crashed the loop);
    ``--latency-questions`` times the first few questions only. Without the loop, no
    latency columns are printed."""
    figs = tmp_path / "lat.json"
    rc = main(["eval", "personabench", "--data", data_dir, "--cache-dir", str(pb_cache_dir),
               "--latency-questions", "3", "--json", str(figs)])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "search p50" in text and "nan" not in text
    doc = json.loads(figs.read_text())
    for m in ("dense", "recollection", "rfmem"):
        lat = doc["modes"][m]
        assert lat["search_ms"]["p50"] > 0 and lat["encode_search_ms"]["p50"] >= lat["search_ms"]["p50"]
    rc = main(["eval", "personabench", "--data", data_dir, "--cache-dir", str(pb_cache_dir), "--no-latency",
               "--modes", "dense"])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "search p50" not in text and "nan" not in text
    with pytest.raises(SystemExit):
        main(["eval", "personabench", "--data", data_dir, "--latency-questions", "0"])
    with pytest.raises(ValueError, match="latency_questions"):
        run_personabench(data_dir, latency_questions=0)


def test_eval_k_list_route_quality_and_loo_router(data_dir, pb_cache_dir, pb_embedded, tmp_path, capsys):
    figs = tmp_path / "q.json"
    rc = main(["eval", "personabench", "--data", data_dir, "--cache-dir", str(pb_cache_dir), "--no-latency",
               "--k", "5,10,20", "--cv", "users", "--router", "logistic", "--set", "merge=interleave",
               "--json", str(figs)])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "Route quality" in text and "R@20" in text and "leave-one-user-out" in text
    doc = json.loads(figs.read_text())
    assert doc["ks"] == [5, 10, 20] and doc["cv"] == "users" and doc["embeddings_cached"]
    for m in ("dense", "recollection", "rfmem"):
        assert set(doc["modes"][m]["metrics_at"]) == {"5", "10", "20"}
    rq = doc["route_quality"]
    assert sum(sum(v.values()) for v in rq["confusion"].values()) == 230
    dense = doc["modes"]["dense"]["metrics"]["Overall"]["recall"]
    reco = doc["modes"]["recollection"]["metrics"]["Overall"]["recall"]
    rf = doc["modes"]["rfmem"]["metrics"]["Overall"]["recall"]
    assert abs(dense - 0.5385) < 1e-3 and abs(reco - 0.5501) < 1e-3  # recollection with merge=interleave: 0.5501
    assert doc["oracle"]["Overall"]["recall"] >= max(dense, reco) - 1e-12
    assert rq["recall_lost"] == pytest.approx(rq["oracle_recall"] - rf, abs=1e-9)
    assert doc["oracle_at"]["20"]["Overall"]["recall"] >= doc["oracle_at"]["10"]["Overall"]["recall"]

    # honesty: each user is routed by a router fitted without that user's questions
    rep = run_personabench(data_dir, modes=["rfmem"], config=RFMemConfig(merge="interleave"), latency=False,
                           cache_dir=pb_cache_dir, cv="users", router_kind="threshold")  # fmt: skip
    pb = pb_embedded
    from rfmem_fast import search

    cfg = RFMemConfig(merge="interleave")
    d = search(pb.bank, pb.queries, pb.users, cfg, mode="dense", backend="torch")
    r = search(pb.bank, pb.queries, pb.users, cfg, mode="recollection", backend="torch")
    gts = [q.gt_segment_ids for q in pb.questions]
    sig, dr, rr = ProbeSignals.from_result(d), question_recalls(d, gts, 10), question_recalls(r, gts, 10)
    users = np.asarray(pb.users)
    ev = np.array([q.is_evaluated for q in pb.questions])
    routes = np.array([rec["route"] == "recollection" for rec in rep.records])
    for u in dict.fromkeys(pb.users):
        train = (users != u) & ev
        rt = fit_router("threshold", sig.take(np.flatnonzero(train)), dr[train], rr[train], ProbeSettings())
        want, _ = rt.route(sig.take(np.flatnonzero(users == u)))
        np.testing.assert_array_equal(routes[users == u], want.astype(bool))


def test_eval_refuses_in_sample_router_fit(data_dir, pb_cache_dir, capsys):
    rc = main(["eval", "personabench", "--data", data_dir, "--cache-dir", str(pb_cache_dir), "--no-latency", "--router", "mlp"])
    assert rc == 2 and "--cv users" in capsys.readouterr().err


def test_calibrate_personabench_then_evaluate_flags_in_sample(data_dir, pb_cache_dir, tmp_path, capsys):
    out = tmp_path / "router.json"
    rc = main(["calibrate", "personabench", "--data", data_dir, "--cache-dir", str(pb_cache_dir),
               "--kind", "threshold", "--set", "merge=interleave", "--out", str(out)])  # fmt: skip
    assert rc == 0
    router, meta = load_router(out, with_meta=True)
    assert router.kind == "threshold" and len(meta["fitted_on"]["users"]) == 6
    assert meta["summary"]["questions"] == 230
    capsys.readouterr()
    rc = main(["eval", "personabench", "--data", data_dir, "--cache-dir", str(pb_cache_dir), "--no-latency",
               "--modes", "rfmem", "--set", f"router={out}", "--set", "merge=interleave"])  # fmt: skip
    assert rc == 0
    assert "in-sample" in capsys.readouterr().out
    # a corrupt router file is a clean error, not a traceback
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "rfmem_fast.router", "version": 1')
    with pytest.raises(SystemExit, match="not valid JSON"):
        main(["eval", "personabench", "--data", data_dir, "--set", f"router={bad}"])


def test_calibrate_custom_data(tmp_path, capsys):
    from _shared import write_custom_questions

    write_custom_questions(tmp_path, seed=0, n=40, noise=0.2)
    out = tmp_path / "r.json"
    rc = main(["calibrate", "custom", "--store", str(tmp_path / "store"), "--queries", str(tmp_path / "q.npy"),
               "--labels", str(tmp_path / "labels.jsonl"), "--kind", "threshold", "--out", str(out), "--backend", "torch"])  # fmt: skip
    assert rc == 0 and load_router(out).kind == "threshold"
    (tmp_path / "labels.jsonl").write_text('{"who": 1}\n')
    assert main(["calibrate", "custom", "--store", str(tmp_path / "store"), "--queries", str(tmp_path / "q.npy"),
                 "--labels", str(tmp_path / "labels.jsonl"), "--out", str(out)]) == 2  # fmt: skip
    assert "line 1" in capsys.readouterr().err


def test_tune_quick_grid_nested_cv(data_dir, pb_cache_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RFMEM_CACHE", str(pb_cache_dir))
    figs = tmp_path / "tune.json"
    rc = main(["tune", "personabench", "--data", data_dir, "--grid", "quick", "--no-timing", "--top", "3", "--json", str(figs)])
    assert rc == 0
    assert "Nested leave-one-user-out" in capsys.readouterr().out
    doc = json.loads(figs.read_text())
    assert len(doc["folds"]) == 6 and len(doc["top"]) == 3
    cv = doc["cv"]["minilm noise 0.0"]
    assert cv["dense"] == pytest.approx(0.5385, abs=1e-3)
    # every held-out user's recall comes from a config chosen without that user
    held = [f["held_out_recall"]["minilm noise 0.0"] for f in doc["folds"]]
    assert all(0.0 <= h <= 1.0 for h in held)


def test_models_list(capsys):
    assert main(["models", "list"]) == 0
    assert "minilm" in capsys.readouterr().out.split()


@pytest.mark.parametrize("name", available_models())
def test_installed_encoders_embed(name):
    pytest.importorskip("sentence_transformers")
    from rfmem_fast.encoders import TextEncoder

    enc = TextEncoder(resolve_model(name), show_progress=False)
    v = enc.encode(["my sister's birthday is in May", "I bought running shoes"])
    assert v.shape == (2, {"minilm": 384, "mpnet": 768}[name])
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert float(v[0] @ v[1]) < 0.9


@pytest.mark.slow
@pytest.mark.parametrize("name", available_models())
def test_eval_every_installed_encoder(name, data_dir, tmp_path):
    """Slow: encodes PersonaBench with each installed encoder (MPNet: minutes on a CPU)."""
    rep = run_personabench(data_dir, encoder=name, latency=False, cache_dir=None if name != "minilm" else tmp_path)
    assert rep.n_evaluated == 230
    assert 0.3 < rep.modes["dense"].metrics["Overall"]["recall"] < 0.8
