"""Judge encoder options against the float32 reference: :mod:`rfmem_fast.encoder_judge`.

For each candidate option (``--options``, default
``onnx:float32,onnx:int8,torch:bfloat16,torch:float16,torch:float32``: ``backend:dtype`` of
:class:`rfmem_fast.encoders.TextEncoder`, MiniLM unless ``--model``) and for each dataset
(``--datasets``, default PersonaBench at noise 0.0 / 0.3 / 0.5 / 0.7 and the LoCoMo
conversations), the items and questions are embedded by the option
(:func:`rfmem_fast.datasets.embedded.dataset_embeddings`, cached under
``~/.cache/rfmem_fast/embeddings`` by the encoder's identity: model, runtime, precision)
and searched with three configurations: the paper's ``RFMemConfig()`` in mode "rfmem"
(``paper-rfmem``) and "dense" (``paper-dense``), and ``RFMemConfig.recommended(model)``
in mode "rfmem" (``recommended``). The reference is the torch float32 encoder of the same
model (its cached embeddings). :func:`rfmem_fast.encoder_judge.judge` then checks, per
dataset and configuration, (a) mean paired Recall@10 difference within one standard
error of the paired differences, (b) >= 95 % identical top-10 lists, (c) >= 99 %
identical RF-Mem routes, and gives the verdict.

Special options:

* ``torch:float32`` is encoded afresh (no cache): the reference's own run-to-run
  difference (the cached reference may come from an earlier version of the encoder's
  passes); a judge that fails it is broken;
* ``null:<1-cos>`` (e.g. ``null:1e-5``): no encoder, the reference embeddings each turned
  by a random direction (seed ``--seed``) to cosine ``1 - <1-cos>``: how the judge treats a
  difference of pure chance of that size (the int8 graph's questions have a mean
  ``1 - cos`` of about 1.2e-4).

Also recorded per option and dataset: cosine of every item and question embedding to the
reference (min, mean), encoding seconds (when encoded now). The JSON (``--out``, default
``bench/results/local/encoder-judge.json``) holds the CPU model and SIMD flags, versions,
``uptime`` before and after, the command, the criteria and every figure; a markdown table
is printed.

    python bench/bench_encoder_judge.py --out bench/results/encoder-judge-amd-epyc-zen4.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_encoder_backends import _turned, cpu_flags  # noqa: E402  (the noise-band perturbation, the SIMD flags)
from rfmem_fast.bench.cli import ENCODER_MODULES, _loadavg, versions  # noqa: E402
from rfmem_fast.evaluate import machine_info  # noqa: E402

DEFAULT_OPTIONS = "onnx:float32,onnx:int8,torch:bfloat16,torch:float16,torch:float32"
DEFAULT_DATASETS = "personabench-0.0,personabench-0.3,personabench-0.5,personabench-0.7,locomo"


def uptime() -> str:
    """The ``uptime`` line (load averages over 1, 5, 15 minutes), or "" where it does not run."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def load_dataset(name: str, pb_dir: Path, locomo_dir: Path) -> Any:
    """``personabench-<noise>`` or ``locomo`` loaded by the package's loaders.

    Raises:
        ValueError: an unknown name.
    """
    from rfmem_fast.datasets import load_personabench
    from rfmem_fast.datasets.locomo import load_locomo

    if name.startswith("personabench-"):
        return load_personabench(pb_dir, noise=float(name.split("-", 1)[1]))
    if name == "locomo":
        return load_locomo(locomo_dir)
    raise ValueError(f"--datasets: unknown dataset {name!r} (personabench-<noise> or locomo)")


class Turned:
    """A stand-in encoder whose embeddings are the reference's turned at random (option ``null:``).

    :meth:`embed` turns each distinct text's vector by the angle arccos(1 - ``delta``)
    towards a random orthogonal direction (:func:`bench_encoder_backends._turned`); a text
    met twice (a question asked by several users) gets the same vector both times, as from
    an encoder."""

    def __init__(self, delta: float, seed: int) -> None:
        self.delta, self.rng = delta, np.random.default_rng(seed)

    def turn(self, V: np.ndarray, texts: list[str]) -> np.ndarray:
        """float32 [n, d]: the rows of ``V`` (unit, one per text) turned, equal texts alike."""
        first: dict[str, int] = {}
        rows = np.array([first.setdefault(t, i) for i, t in enumerate(texts)], dtype=np.int64)
        uniq = np.unique(rows)
        out = np.empty_like(V)
        out[uniq] = _turned(V[uniq], 1.0 - self.delta, self.rng)
        return out[rows]

    def embed(self, ref: Any, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(X, Q) of the reference embeddings ``ref`` (items ``X`` in user order) turned."""
        items = [t for u in ref.dataset.users for t in u.item_texts]
        return self.turn(X, items), self.turn(ref.Q, [q.text for q in ref.dataset.questions])


def configurations(model: str) -> dict[str, tuple[Any, str]]:
    """``{name: (RFMemConfig, mode)}``: the paper's config in modes rfmem and dense, the recommended one."""
    from rfmem_fast.config import RFMemConfig
    from rfmem_fast.models import recommended_alias

    return {"paper-rfmem": (RFMemConfig(), "rfmem"), "paper-dense": (RFMemConfig(), "dense"),
            "recommended": (RFMemConfig.recommended(recommended_alias(model)), "rfmem")}


def runs_of(emb: Any, configs: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    """``{configuration: SearchRun}`` of one embedded dataset."""
    from rfmem_fast.encoder_judge import JUDGE_K, search_run
    from rfmem_fast.evaluate_datasets import evaluate_dataset

    return {name: search_run(evaluate_dataset(emb.dataset, emb, cfg, mode, k=JUDGE_K), JUDGE_K)
            for name, (cfg, mode) in configs.items()}


def with_vectors(ref: Any, X: np.ndarray, Q: np.ndarray) -> Any:
    """The reference's DatasetEmbeddings with other item / question vectors (bank rebuilt)."""
    import dataclasses

    from rfmem_fast.datasets.embedded import _build_bank

    return dataclasses.replace(ref, bank=_build_bank(ref.dataset.users, X), Q=np.ascontiguousarray(Q, np.float32),
                               cached=False, cache_file=None, model_id="turned", encode_items_s=0.0,
                               encode_questions_s=0.0)


def bank_vectors(emb: Any) -> np.ndarray:
    """float32 [n_items, d]: the items' vectors in user order, as the bank holds them."""
    return np.asarray(emb.bank.snapshot().vectors)  # one segment per user, added in user order


def main(argv: list[str] | None = None) -> int:
    from rfmem_fast.bench.workloads import default_personabench_dir
    from rfmem_fast.datasets.embedded import dataset_embeddings, default_embedding_cache_dir
    from rfmem_fast.encoder_judge import JUDGE_CRITERIA, JUDGE_K, judge
    from rfmem_fast.encoders import AUTO_ENCODER_RULE, TextEncoder, check_backend, int8_dot, resolve_backend
    from rfmem_fast.models import resolve_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--options", default=DEFAULT_OPTIONS, help="comma list of backend:dtype or null:<1-cos>")
    p.add_argument("--datasets", default=DEFAULT_DATASETS, help="comma list of personabench-<noise> and locomo")
    p.add_argument("--model", default="minilm", help="encoder model: alias or folder (default minilm)")
    p.add_argument("--data", default=None, help="PersonaBench eval_data_v1 folder (default: ../shared/...)")
    p.add_argument("--locomo", default=None, help="LoCoMo folder (default: the shared data's locomo)")
    p.add_argument("--cache-dir", default=None, help="embedding cache (default ~/.cache/rfmem_fast/embeddings)")
    p.add_argument("--threads", type=int, default=None, help="encoder threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the null: options")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "local" / "encoder-judge.json"))
    args = p.parse_args(argv)
    options: list[tuple[str, str]] = []
    for item in (x.strip() for x in args.options.split(",") if x.strip()):
        backend, _, dtype = item.partition(":")
        if backend == "null":
            try:
                if not 0.0 < float(dtype) < 1.0:
                    raise ValueError
            except ValueError:
                p.error(f"--options {item!r}: null:<1-cos> takes a number in (0, 1)")
            options.append((backend, dtype))
            continue
        try:
            check_backend(backend, dtype or "float32", "--options backend", "--options dtype")
        except (TypeError, ValueError) as e:
            p.error(str(e))
        options.append((backend, dtype or "float32"))
    pb_dir = Path(args.data) if args.data else default_personabench_dir()
    locomo_dir = Path(args.locomo) if args.locomo else (pb_dir.parents[1] / "locomo" if pb_dir else None)
    names = [x.strip() for x in args.datasets.split(",") if x.strip()]
    if pb_dir is None or any(n.startswith("personabench") for n in names) and not pb_dir.is_dir():
        print("PersonaBench not found: pass --data", file=sys.stderr)
        return 2
    if "locomo" in names and (locomo_dir is None or not locomo_dir.is_dir()):
        print("LoCoMo not found: pass --locomo", file=sys.stderr)
        return 2
    cache = Path(args.cache_dir) if args.cache_dir else default_embedding_cache_dir()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    model = resolve_model(args.model)
    vers = versions(ENCODER_MODULES)
    doc: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": {**machine_info(), "simd": cpu_flags()}, "versions": vers,
        "load": {"uptime_start": uptime(), "loadavg_start": _loadavg()},
        "settings": {"options": [":".join(o) for o in options], "datasets": names, "model": model,
                     "reference": "torch:float32 (cached embeddings)", "k": JUDGE_K, "seed": args.seed,
                     "configurations": {"paper-rfmem": "RFMemConfig(), mode rfmem",
                                        "paper-dense": "RFMemConfig(), mode dense",
                                        "recommended": "RFMemConfig.recommended(), mode rfmem"}},
        "criteria": {**JUDGE_CRITERIA, "definition": (
            "per dataset and configuration: (a) |mean(d)| <= 1 x SE, d = per-question Recall@10 candidate - "
            "reference over the scored questions, SE = std(d, ddof=1) / sqrt(n) (standard error of the mean paired "
            "difference); (b) fraction of questions whose top-10 ids are identical in order >= 0.95; (c) fraction "
            "of questions with the same RF-Mem route (configurations in mode rfmem) >= 0.99")},
        "auto": {"resolves_to": ":".join(resolve_backend("auto", "auto")), "int8_dot": int8_dot(),
                 "rule": AUTO_ENCODER_RULE},
        "options": {},
    }
    configs = configurations(args.model)
    datasets = {n: load_dataset(n, pb_dir, locomo_dir) for n in names}
    ref_emb = {}
    ref_runs: dict[str, dict[str, Any]] = {}
    for n, ds in datasets.items():
        t0 = time.perf_counter()
        ref_emb[n] = dataset_embeddings(ds, encoder=model, cache_dir=cache, say=say)
        ref_runs[n] = runs_of(ref_emb[n], configs)
        say(f"reference {n}: {'cached' if ref_emb[n].cached else 'encoded'}, searched in {time.perf_counter() - t0:.1f} s")
    for backend, dtype in options:
        label = f"{backend}:{dtype}"
        say(f"== {label}")
        entry: dict[str, Any] = {"datasets": {}}
        cand_runs: dict[str, dict[str, Any]] = {}
        if backend == "null":
            turn = Turned(float(dtype), args.seed)
            entry["runs_as"] = f"reference embeddings turned to cosine 1 - {dtype} (seed {args.seed})"
        else:
            enc = TextEncoder(model, show_progress=False, backend=backend, dtype=dtype, num_threads=args.threads)
            entry["runs_as"] = f"{enc.backend}:{enc.dtype}" + (f" (long texts: {enc.long_texts})"
                                                               if enc.backend == "onnx" else "")
            fresh = backend == "torch" and dtype == "float32"  # the reference re-encoded: no cache
            entry["cache"] = "none (re-encoded)" if fresh else str(cache)
        for n, ds in datasets.items():
            ref = ref_emb[n]
            if backend == "null":
                X, Q = turn.embed(ref, bank_vectors(ref))
                emb = with_vectors(ref, X, Q)
            else:
                emb = dataset_embeddings(ds, encoder=enc, cache_dir=None if fresh else cache, say=say)
            cos_x = (bank_vectors(emb) * bank_vectors(ref)).sum(1)
            cos_q = (emb.Q * ref.Q).sum(1)
            cand_runs[n] = runs_of(emb, configs)
            entry["datasets"][n] = {
                "items": int(cos_x.size), "questions": int(cos_q.size), "cached": bool(emb.cached),
                "encode_items_s": float(emb.encode_items_s), "encode_questions_s": float(emb.encode_questions_s),
                "items_cos_min": float(cos_x.min()), "items_cos_mean": float(cos_x.mean()),
                "questions_cos_min": float(cos_q.min()), "questions_cos_mean": float(cos_q.mean()),
            }
            say(f"  {n}: cos min items {cos_x.min():.6f} questions {cos_q.min():.6f}"
                f" ({'cached' if emb.cached else f'encoded in {emb.encode_items_s + emb.encode_questions_s:.0f} s'})")
        verdict = judge(ref_runs, cand_runs)
        entry["verdict"] = verdict.to_dict()
        doc["options"][label] = entry
        say(f"  verdict {label}: {'PASS' if verdict.passed else 'FAIL'}")
        for line in verdict.failures():
            say(f"    {line}")
        doc["load"]["uptime_end"] = uptime()
        doc["load"]["loadavg_end"] = _loadavg()
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2))  # after every option: a stopped run keeps what it measured
    print(f"wrote {args.out}")
    print("| option | dataset | configuration | n | R@10 ref | diff (points) | SE | t | (a) | top-10 = | (b) "
          "| routes = | (c) |")
    print("|---" * 13 + "|")
    for label, entry in doc["options"].items():
        for n, by in entry["verdict"]["comparisons"].items():
            for cfg, c in by.items():
                r = "-" if c["identical_routes"] is None else f"{c['identical_routes']:.4f}"
                t = c["t"] if isinstance(c["t"], str) else f"{c['t']:+.2f}"
                print(f"| {label} | {n} | {cfg} | {c['n']} | {c['recall_reference']:.2f} | "
                      f"{c['mean_diff_points']:+.2f} | {c['se_points']:.2f} | {t} | {'ok' if c['recall_ok'] else 'FAIL'} "
                      f"| {c['identical_top']:.4f} | {'ok' if c['top_ok'] else 'FAIL'} | {r} | "
                      f"{'ok' if c['routes_ok'] else 'FAIL'} |")
    print("| option | verdict |\n|---|---|")
    for label, entry in doc["options"].items():
        print(f"| {label} | {'PASS' if entry['verdict']['passed'] else 'FAIL'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
