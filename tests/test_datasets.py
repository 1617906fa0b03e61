"""The loader interface (rfmem_fast.datasets.base), the LoCoMo loader and `rfmem eval locomo`.

No test here runs the sentence encoder: the end-to-end ones use a tiny deterministic
bag-of-words encoder (tests/_fake_encoder.py)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from _fake_encoder import BagOfWords, patch_encoder
from _shared import shared_dir

from rfmem_fast.cli import main
from rfmem_fast.config import RFMemConfig
from rfmem_fast.datasets.base import Dataset, MemoryDataset, MemoryQuestion, MemoryUser, Question, User, check_dataset
from rfmem_fast.datasets.embedded import dataset_embeddings
from rfmem_fast.datasets.locomo import load_locomo, locomo_score, locomo_turn_text, parse_evidence
from rfmem_fast.evaluate_datasets import evaluate_dataset, run_dataset


def _locomo_dir() -> Path:
    shared = shared_dir()
    path = shared / "data" / "locomo" if shared else None
    if path is None or not (path / "26.json").is_file():
        pytest.skip("LoCoMo data absent (shared/data/locomo)")
    return path


def _conv(sessions: dict[int, list[dict]], qa: list[dict]) -> dict:
    doc: dict = {"speaker_a": "Ann", "speaker_b": "Bob", "qa": qa}
    for n, turns in sessions.items():
        doc[f"session_{n}_date_time"] = f"10:00 am on {n} May, 2023"
        doc[f"session_{n}"] = turns
    return doc


def _tiny_locomo(tmp_path: Path) -> Path:
    """Two conversations: "7" (two sessions, one image turn, malformed evidence) and "8"."""
    folder = tmp_path / "locomo"
    folder.mkdir()
    seven = _conv(
        {
            2: [{"speaker": "Bob", "dia_id": "D2:1", "text": "I adopted a puppy called Rex."},
                {"speaker": "Ann", "dia_id": "D2:2", "text": "Look at my garden!", "blip_caption": "a photo of roses",
                 "img_url": ["http://x"], "query": "roses"}],
            1: [{"speaker": "Ann", "dia_id": "D1:1", "text": "I started learning the violin."},
                {"speaker": "Bob", "dia_id": "D1:2", "text": "I work as a nurse in Leeds."}],
        },  # fmt: skip
        [
            {"question": "What instrument does Ann learn?", "answer": "violin", "evidence": ["D1:1"], "category": 4},
            {"question": "What is Bob's puppy called and where does he work?", "answer": "Rex, Leeds",
             "evidence": ["D2:1; D1:2"], "category": 1},
            {"question": "Which roses does Ann grow in her garden?", "answer": "roses", "evidence": ["D2:2", "D9:9"], "category": 2},
            {"question": "What did Bob say about cats?", "evidence": ["D1:2"], "category": 5, "adversarial_answer": "x"},
            {"question": "When?", "answer": "May", "evidence": [], "category": 3},
        ],
    )  # fmt: skip
    eight = _conv(
        {1: [{"speaker": "Cy", "dia_id": "D1:1", "text": "I bake sourdough bread every Sunday."},
             {"speaker": "Di", "dia_id": "D1:2", "text": "I ran a marathon in Berlin."}]},
        [{"question": "Where did Di run a marathon?", "answer": "Berlin", "evidence": ["D1:2"], "category": 4}],
    )  # fmt: skip
    (folder / "7.json").write_text(json.dumps(seven))
    (folder / "8.json").write_text(json.dumps(eight))
    return folder


# ----------------------------------------------------------------- the interface


def test_every_loader_satisfies_the_interface(tmp_path):
    from rfmem_fast.datasets.longmemeval import load_longmemeval

    lo = load_locomo(_tiny_locomo(tmp_path))
    lme = load_longmemeval(Path(__file__).parent / "data" / "longmemeval_tiny.json")
    for d in (lo, lme):
        assert isinstance(d, MemoryDataset)
        assert all(isinstance(u, MemoryUser) for u in d.users)
        assert all(isinstance(q, MemoryQuestion) for q in d.questions)
        check_dataset(d)
        assert "recall" in d.metric_names and "ndcg" in d.metric_names


def test_personabench_satisfies_the_interface_with_unchanged_figures():
    from rfmem_fast.datasets import load_personabench
    from rfmem_fast.metrics import recall_ndcg_at_k

    shared = shared_dir()
    path = shared / "data" / "personabench" / "eval_data_v1" if shared else None
    if path is None or not (path / "synthetic_data").is_dir():
        pytest.skip("PersonaBench data absent")
    pb = load_personabench(path)
    assert isinstance(pb, MemoryDataset) and pb.name == "personabench"
    check_dataset(pb)
    u, q = pb.users[0], pb.questions[0]
    assert isinstance(u, MemoryUser) and isinstance(q, MemoryQuestion)
    assert u.item_ids is u.chunk_ids and u.item_texts is u.chunk_texts
    assert q.text == q.question and q.ground_truth is q.gt_segment_ids and q.user_key == u.key
    assert [x.scored for x in pb.questions] == [x.is_evaluated for x in pb.questions]
    assert len({x.qid for x in pb.questions}) == len(pb.questions)  # unique across communities
    ranked = u.chunk_ids[:10]
    for x in pb.questions[:20]:
        assert pb.score(x, ranked, 10) == dict(zip(("recall", "ndcg"), recall_ndcg_at_k(ranked, x.gt_segment_ids, 10)))


def test_check_dataset_names_what_is_wrong():
    u = User("a", ["1", "2"], ["x"])
    d = Dataset("bad", [u], [], ("recall", "ndcg"), scorer=lambda q, r, k: {})
    with pytest.raises(ValueError, match="'a' has 2 ids but 1 texts"):
        check_dataset(d)
    d = Dataset("bad", [User("a", ["1"], ["x"])], [Question("q", "t", "b", [], "c")], ("recall", "ndcg"), scorer=None)
    with pytest.raises(ValueError, match="asks user 'b'"):
        check_dataset(d)
    with pytest.raises(TypeError, match="'metric_names'"):
        check_dataset(object.__new__(type("X", (), {"name": "x", "users": [], "questions": [], "score": None})))
    with pytest.raises(ValueError, match="metric_names must include"):
        check_dataset(Dataset("bad", [], [], ("recall",), scorer=None))


# ----------------------------------------------------------------- LoCoMo


def test_locomo_protocol_on_a_tiny_conversation(tmp_path):
    d = load_locomo(_tiny_locomo(tmp_path))
    assert d.name == "locomo" and [u.key for u in d.users] == ["7", "8"]
    seven = d.users[0]
    # sessions in N order (session_1 before session_2 although the file lists 2 first), turns in file order
    assert seven.item_ids == ["D1:1", "D1:2", "D2:1", "D2:2"]
    assert seven.item_texts[0] == "[10:00 am on 1 May, 2023] Ann: I started learning the violin."
    assert seven.item_texts[3] == "[10:00 am on 2 May, 2023] Ann: Look at my garden! [shares a photo of roses]"
    # category 5 and evidence-less questions left out
    assert [q.qid for q in d.questions] == ["7/0", "7/1", "7/2", "8/0"]
    assert [q.category for q in d.questions] == ["4", "1", "2", "4"]
    assert all(q.scored for q in d.questions)
    # malformed evidence: split and stripped; an absent id kept (counts as missed)
    assert d.questions[1].ground_truth == ["D2:1", "D1:2"]
    assert d.questions[2].ground_truth == ["D2:2", "D9:9"]
    assert d.stats == {"evidence_split": 1, "evidence_absent": 1, "left_out_adversarial": 1, "left_out_no_evidence": 1}
    assert any("split" in n for n in d.notes) and any("missed" in n for n in d.notes)
    # the absent id caps that question's recall at 1/2
    assert d.score(d.questions[2], seven.item_ids, 10)["recall"] == 0.5
    assert [u.key for u in load_locomo(tmp_path / "locomo", conversations=["8"]).users] == ["8"]


def test_parse_evidence_and_turn_text():
    assert parse_evidence(["D8:6; D9:17"]) == (["D8:6", "D9:17"], 1)
    assert parse_evidence(["D1:2, D1:3", " D1:2 ", "D4:1"]) == (["D1:2", "D1:3", "D4:1"], 1)
    assert parse_evidence(["", " ; "]) == ([], 0)
    assert locomo_turn_text({"speaker": "A", "text": "hi"}, "d") == "[d] A: hi"
    assert locomo_turn_text({"speaker": "A", "text": "hi", "blip_caption": "a cat"}, "d") == "[d] A: hi [shares a cat]"


def test_locomo_metrics_by_hand():
    q = Question("c/0", "?", "c", ["a", "b", "z"], "1")
    # top-3 holds a (rank 1) and b (rank 3); z never appears
    got = locomo_score(q, ["a", "x", "b", "y"], 3)
    assert got["recall"] == pytest.approx(2 / 3)
    assert got["ndcg"] == pytest.approx((1 + 1 / math.log2(4)) / (1 + 1 / math.log2(3) + 1 / math.log2(4)))
    assert locomo_score(q, ["a", "x", "b", "y"], 1) == {"recall": pytest.approx(1 / 3), "ndcg": 1.0}
    assert locomo_score(q, [], 10) == {"recall": 0.0, "ndcg": 0.0}
    with pytest.raises(ValueError, match="k must be >= 1"):
        locomo_score(q, ["a"], 0)


def test_locomo_bad_input_names_the_field(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_locomo(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="holds no LoCoMo"):
        load_locomo(tmp_path)
    bad = tmp_path / "1.json"
    bad.write_text(json.dumps({"session_1": [{"speaker": "A", "text": "x"}], "session_1_date_time": "d", "qa": []}))
    with pytest.raises(ValueError, match="'dia_id'"):
        load_locomo(tmp_path)
    bad.write_text(json.dumps({"session_1": [{"speaker": "A", "dia_id": "D1:1", "text": "x"}], "qa": []}))
    with pytest.raises(ValueError, match="'session_1_date_time'"):
        load_locomo(tmp_path)
    bad.write_text(json.dumps({"session_1": []}))
    with pytest.raises(ValueError, match="no 'qa' list"):
        load_locomo(tmp_path)
    bad.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_locomo(tmp_path)
    with pytest.raises(FileNotFoundError, match="9.json"):
        load_locomo(tmp_path, conversations=["9"])


def test_locomo_real_data_counts():
    d = load_locomo(_locomo_dir())
    assert [u.key for u in d.users] == ["26", "30", "41", "42", "43"]
    assert len(d.questions) == 760
    assert sum(len(u) for u in d.users) == 2760
    # the malformed entries of these five files: "D8:6; D9:17" (26), "D10:19" and "D" (42), "D:11:26" (43)
    assert d.stats["evidence_split"] == 1 and d.stats["evidence_absent"] == 3
    q = next(q for q in d.questions if q.info["evidence_raw"] == ["D8:6; D9:17"])
    assert q.user_key == "26" and q.ground_truth == ["D8:6", "D9:17"]


# ----------------------------------------------------------------- evaluation end to end


def test_evaluate_dataset_returns_per_question_arrays(tmp_path):
    d = load_locomo(_tiny_locomo(tmp_path))
    enc = BagOfWords()
    emb = dataset_embeddings(d, encoder=enc, cache_dir=tmp_path / "cache")
    assert emb.Q.shape == (4, enc.dim + 1) and emb.n_items == 6 and not emb.cached
    again = dataset_embeddings(d, encoder=enc, cache_dir=tmp_path / "cache")
    assert again.cached and np.array_equal(again.Q, emb.Q)
    s = evaluate_dataset(d, emb, RFMemConfig(), mode="dense", k=1)
    assert list(s.qids) == ["7/0", "7/1", "7/2", "8/0"] and list(s.users) == ["7", "7", "7", "8"]
    assert list(s.categories) == ["4", "1", "2", "4"]
    assert s.recall.dtype == np.float64 and s.recall.shape == (4,)
    # the violin, the roses and the marathon are found at rank 1; the two-id question gets one of its two
    assert s.result.ids_list(0)[0] == "D1:1" and s.recall[0] == 1.0
    assert s.recall[2] == 0.5 and s.recall[3] == 1.0
    for j, i in enumerate(s.index):
        assert s.metrics["recall"][j] == d.score(d.questions[i], s.result.ids_list(j), 1)["recall"]
    fold = evaluate_dataset(d, emb, RFMemConfig(), mode="dense", k=1, users=["8"])
    assert list(fold.qids) == ["8/0"]
    wide = evaluate_dataset(d, emb, RFMemConfig(out_k=2), mode="rfmem", k=4)  # k > out_k: a run with out_k = 4
    assert all(len(wide.result.ids_list(j)) == (4 if wide.users[j] == "7" else 2) for j in range(4))
    with pytest.raises(ValueError, match="mode must be"):
        evaluate_dataset(d, emb, mode="fast")
    with pytest.raises(ValueError, match="another dataset"):
        evaluate_dataset(load_locomo(tmp_path / "locomo"), emb)


def test_lexical_texts_passed_only_with_a_lexical_weight(tmp_path, monkeypatch):
    import rfmem_fast.evaluate_datasets as ev

    d = load_locomo(_tiny_locomo(tmp_path))
    emb = dataset_embeddings(d, encoder=BagOfWords(), cache_dir=None)
    seen = []

    def fake_search(bank, Q, users, config, mode, backend, **kw):
        seen.append(kw)
        return real(bank, Q, users, RFMemConfig(out_k=config.out_k), mode=mode, backend=backend)

    real = ev.search
    monkeypatch.setattr(ev, "search", fake_search)
    evaluate_dataset(d, emb, RFMemConfig(), mode="dense")

    class Lexical:  # a config of the lexical channel, before RFMemConfig has the field
        out_k, lexical_weight = 10, 0.3

        def replace(self, **kw):
            return self

    evaluate_dataset(d, emb, Lexical(), mode="dense")
    assert seen[0] == {} and seen[1] == {"query_texts": [q.text for q in d.questions]}


def test_cli_eval_locomo(tmp_path, capsys, monkeypatch):
    patch_encoder(monkeypatch)
    folder = _tiny_locomo(tmp_path)
    out, figs = tmp_path / "r.jsonl", tmp_path / "f.json"
    rc = main(["eval", "locomo", "--data", str(folder), "--no-cache", "--k", "1,2", "--out", str(out), "--json", str(figs)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "locomo: 2 users, 6 items, 4 questions (4 scored)" in text and "dense recall@1" in text and "oracle" in text
    doc = json.loads(figs.read_text())
    assert doc["dataset"] == "locomo" and doc["ks"] == [1, 2] and set(doc["modes"]) == {"dense", "recollection", "rfmem"}
    assert doc["modes"]["dense"]["metrics"]["Overall"]["recall"] == pytest.approx((1 + 0.5 + 0.5 + 1) / 4)
    assert doc["modes"]["dense"]["metrics"]["Overall"]["count"] == 4 and "command" in doc
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 4 and recs[1]["ground_truth"] == ["D2:1", "D1:2"] and "rfmem_ids" in recs[0]
    rep = run_dataset(load_locomo(folder), modes=["dense"], ks=[2], encoder=BagOfWords(), cache_dir=None)
    assert list(rep.metrics_at) == ["dense"] and rep.k == 2
    assert main(["eval", "locomo", "--data", str(tmp_path / "none"), "--no-cache"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_eval_says_which_configuration_ran(tmp_path, capsys, monkeypatch):
    """`rfmem eval` prints a configuration line (preset, channels and fusion, router) first
    and names the hybrid modes "dense+bm25" / "rfmem+bm25" (the Recollection path stays
    dense), in the tables and in --json; the default preset (the paper's) keeps the names."""
    patch_encoder(monkeypatch)
    folder = _tiny_locomo(tmp_path)
    figs = tmp_path / "f.json"
    assert main(["eval", "locomo", "--data", str(folder), "--no-cache", "--k", "1", "--preset", "recommended",
                 "--json", str(figs)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    head = ("configuration: preset recommended (minilm); hybrid dense + BM25, fusion convex, lexical_weight 0.03, "
            "lexical_norm raw; theta_high -1, theta_low -1, tau 0 (never recollects); "
            "context_weight 0.5, context_radius 2, thread_weight 0.3")  # fmt: skip
    assert text.splitlines()[0] == head
    assert "dense+bm25 recall@1" in text and "rfmem+bm25 recall@1" in text and "recollection recall@1" in text
    assert "recollection+bm25" not in text and " dense recall@1" not in text and "oracle recall@1" in text
    doc = json.loads(figs.read_text())
    assert (doc["preset"], doc["configuration"]) == ("recommended", head)
    assert {m: v["label"] for m, v in doc["modes"].items()} == {"dense": "dense+bm25", "rfmem": "rfmem+bm25",
                                                                "recollection": "recollection"}  # fmt: skip
    assert doc["config"] == RFMemConfig.recommended().to_dict()
    assert main(["eval", "locomo", "--data", str(folder), "--no-cache", "--k", "1", "--json", str(figs),
                 "--set", "lexical_weight=0.1", "--set", "merge=rrf", "--preset", "recommended",
                 "--encoder", "/models/all-mpnet-base-v2"]) == 0  # fmt: skip
    doc = json.loads(figs.read_text())
    assert doc["configuration"] == ("configuration: preset recommended (mpnet) with --set lexical_weight=0.1 merge=rrf; "
                                    "hybrid dense + BM25, fusion convex, lexical_weight 0.1, lexical_norm raw; "
                                    "theta_high -1, theta_low -1, tau 0 (never recollects); merge rrf; "
                                    "context_weight 0.2, context_radius 2, thread_weight 0.5")  # fmt: skip
    assert doc["modes"]["recollection"]["label"] == "recollection+bm25"  # a merge mixes the fused probe list in
    capsys.readouterr()
    assert main(["eval", "locomo", "--data", str(folder), "--no-cache", "--k", "1", "--json", str(figs)]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0] == ("configuration: preset default (the paper's); dense only (lexical_weight 0); "
                                    "theta_high 0.6, theta_low 0.2, tau 0.2")  # fmt: skip
    assert "+bm25" not in text and "dense recall@1" in text
    doc = json.loads(figs.read_text())
    assert doc["preset"] == "default" and {v["label"] for v in doc["modes"].values()} == {"dense", "rfmem", "recollection"}


def test_personabench_report_names_the_hybrid_modes():
    """format_report / format_noise_summary / report_json of `rfmem eval personabench` label
    the modes as :func:`mode_label` does (built from a report, no data needed)."""
    from rfmem_fast.evaluate import EvalReport, ModeReport, format_noise_summary, format_report, report_json

    def rep(config):
        m = {"Overall": {"recall": 0.5, "ndcg": 0.25, "count": 2}}
        modes = {x: ModeReport(metrics=m, batch_ms_per_query=1.0, metrics_at={10: m}) for x in ("rfmem", "dense", "recollection")}
        return EvalReport(modes=modes, oracle=m, records=[], n_questions=2, n_evaluated=2, n_users=1, n_chunks=3,
                          encode_chunks_s=0.0, backend="native", config=config, k=10, machine={}, ks=[10], oracle_at={10: m})  # fmt: skip

    hy, paper = rep(RFMemConfig.recommended()), rep(RFMemConfig())
    text = format_report(hy)
    assert "dense+bm25 R@10" in text and "rfmem+bm25 N@10" in text and "recollection R@10" in text and "oracle R@10" in text
    assert "\ndense+bm25 " in text  # the latency table too
    assert format_noise_summary([hy]).splitlines()[1].split() == ["noise", "rfmem+bm25", "dense+bm25", "recollection", "oracle"]
    doc = report_json(hy)
    assert [doc["modes"][m]["label"] for m in ("rfmem", "dense", "recollection")] == ["rfmem+bm25", "dense+bm25", "recollection"]
    assert doc["configuration"].startswith("configuration: hybrid dense + BM25, fusion convex")
    assert "+bm25" not in format_report(paper) + format_noise_summary([paper])
    assert report_json(paper)["modes"]["dense"]["label"] == "dense"


def test_cli_eval_locomo_real_data_dense(tmp_path, capsys):
    """Dense Recall@10 of MiniLM on the five conversations: 0.5401 (0.5394 with "D8:6; D9:17" kept
    as one unmatchable id; the loader splits it). Runs only with cached embeddings
    ($RFMEM_TEST_EMBEDDINGS holding the locomo-*.npz of MiniLM): encoding takes minutes here."""
    import os

    keep = os.environ.get("RFMEM_TEST_EMBEDDINGS")
    if not keep or not list(Path(keep).glob("locomo-*.npz")):
        pytest.skip("no cached LoCoMo embeddings in $RFMEM_TEST_EMBEDDINGS")
    figs = tmp_path / "f.json"
    rc = main(["eval", "locomo", "--data", str(_locomo_dir()), "--modes", "dense", "--k", "10", "--cache-dir", keep,
               "--json", str(figs)])  # fmt: skip
    assert rc == 0
    doc = json.loads(figs.read_text())
    if not doc["embeddings_cached"]:
        pytest.skip("the cache held no MiniLM LoCoMo embeddings (encoded now)")
    assert doc["modes"]["dense"]["metrics"]["Overall"]["recall"] == pytest.approx(0.5401, abs=5e-4)


def test_personabench_through_the_generic_evaluation(pb_embedded, pb_cache_dir):
    """PersonaBench via the loader interface: the same cache file as personabench_embeddings
    and the figures of `rfmem eval personabench` (dense Recall@10 0.5385, 230 scored)."""
    from rfmem_fast.datasets import load_personabench

    shared = shared_dir()
    path = shared / "data" / "personabench" / "eval_data_v1" if shared else None
    if path is None or not (path / "synthetic_data").is_dir():
        pytest.skip("PersonaBench data absent")
    pb = load_personabench(path)
    emb = dataset_embeddings(pb, encoder=None, cache_dir=pb_cache_dir)
    assert emb.cached and Path(emb.cache_file).name.startswith("personabench-")
    assert np.array_equal(emb.Q, pb_embedded.queries)
    s = evaluate_dataset(pb, emb, RFMemConfig(), mode="dense", k=10)
    assert len(s.recall) == 230 and s.recall.mean() == pytest.approx(0.5385, abs=5e-5)
    assert set(s.categories) >= {"Preference_hard", "Basic_information_easy"}


def test_encoder_identity_tells_runtime_and_precision_apart(tmp_path):
    """The embedding cache is keyed by model folder, precision and runtime: torch float32 keeps
    the bare fingerprint, every other (backend, dtype, long_texts) gets its own identity."""
    from types import SimpleNamespace

    from rfmem_fast.datasets.embedded import encoder_identity
    from rfmem_fast.models import model_fingerprint

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    fp = model_fingerprint(folder)

    def ident(**kw):
        return encoder_identity(SimpleNamespace(model_path=str(folder), **kw))[1]

    assert ident(dtype="float32", backend="torch") == fp
    assert ident() == fp  # no dtype / backend attributes: the reference
    assert ident(dtype="bfloat16", backend="torch") == fp + "-bfloat16"
    assert ident(dtype="float32", backend="onnx", long_texts="onnx") == fp + "-onnx-float32"
    assert ident(dtype="int8", backend="onnx", long_texts="onnx") == fp + "-onnx-int8"
    assert ident(dtype="float32", backend="onnx", long_texts="torch") == fp + "-onnx-float32-long-torch"
    ids = {ident(dtype=d, backend=b, long_texts=lt) for d, b, lt in
           [("float32", "torch", "torch"), ("bfloat16", "torch", "torch"), ("float32", "onnx", "onnx"),
            ("int8", "onnx", "onnx"), ("float32", "onnx", "torch")]}
    assert len(ids) == 5
