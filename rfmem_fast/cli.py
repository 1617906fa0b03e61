"""The ``rfmem`` command.

``rfmem eval personabench --data DIR [--noise 0.0] [--modes dense,recollection,rfmem]
[--backend auto] [--out FILE] [--json FILE] [--no-latency] [--set FIELD=VALUE ...]``
runs the PersonaBench evaluation (RFMEM_SPEC.md sections 6-7) and prints the table
(needs the ``text`` extra for the encoder). ``rfmem bench ...`` runs the benchmark
suite (:mod:`rfmem_fast.bench.cli`; the ``bench`` extra). ``rfmem --version`` prints
the version.

``rfmem serve --path DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY]`` serves a
:class:`rfmem_fast.Memory` over HTTP (:mod:`rfmem_fast.serving.cli`; the ``serve`` extra).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Sequence

from .backends import BACKEND_NAMES
from .config import RFMemConfig
from .search import MODES


def _config_from_sets(sets: Sequence[str]) -> RFMemConfig:
    """RFMemConfig from ``FIELD=VALUE`` strings (values parsed as the field's type)."""
    fields = {f.name: f for f in dataclasses.fields(RFMemConfig)}
    kwargs = {}
    for item in sets:
        name, sep, raw = item.partition("=")
        if not sep or name not in fields:
            raise SystemExit(f"--set expects FIELD=VALUE with FIELD one of {sorted(fields)}, got {item!r}")
        default = getattr(RFMemConfig(), name)
        try:
            kwargs[name] = type(default)(raw) if not isinstance(default, str) else raw
        except ValueError:
            raise SystemExit(f"--set {name}: cannot parse {raw!r} as {type(default).__name__}") from None
    try:
        return RFMemConfig(**kwargs)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"--set: {e}") from None


def _parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"--modes must be a comma list of {MODES}, got {text!r}")
    return modes


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``rfmem`` (sub-commands ``eval``, ``serve`` and, when present, ``bench``)."""
    from . import __version__

    p = argparse.ArgumentParser(prog="rfmem", description="Fast RF-Mem retrieval: evaluation and benchmarks.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    ev = sub.add_parser("eval", help="evaluate retrieval on a dataset")
    evsub = ev.add_subparsers(dest="dataset", required=True)
    pb = evsub.add_parser("personabench", help="PersonaBench (RFMEM_SPEC.md section 6)")
    pb.add_argument("--data", required=True, help="folder holding synthetic_data/ (e.g. shared/data/personabench/eval_data_v1)")
    pb.add_argument("--noise", type=float, default=0.0, help="noise level: 0.0, 0.3, 0.5 or 0.7 (default 0.0)")
    pb.add_argument("--modes", type=_parse_modes, default=list(MODES), help="comma list of dense,recollection,rfmem")
    pb.add_argument(
        "--backend", default="auto", choices=BACKEND_NAMES, metavar="NAME",
        help=f"{' | '.join(BACKEND_NAMES)} (default auto: the first of rfmem_fast.available_backends())",
    )  # fmt: skip
    pb.add_argument("--out", help="write one JSON line per question (the golden file's keys) here")
    pb.add_argument("--json", dest="json_out", help="write the figures (metrics, latency, machine) as JSON here")
    pb.add_argument("--no-latency", action="store_true", help="skip the single-query latency loop")
    pb.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override an RFMemConfig field")
    try:
        from .bench import cli as bench_cli  # optional: the benchmark suite
    except ImportError:
        bench_cli = None
    if bench_cli is not None:
        bench_cli.add_parser(sub)
    from .serving import cli as serve_cli  # the HTTP service (FastAPI imported only when run)

    serve_cli.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rfmem``. Returns the process exit code."""
    args = build_parser().parse_args(argv)
    args.from_command_line = argv is None  # sub-commands may re-execute the process (serve)
    if args.command == "eval":
        from .evaluate import format_report, report_json, run_personabench, write_records

        config = _config_from_sets(args.set)
        try:
            rep = run_personabench(
                args.data,
                noise=args.noise,
                modes=args.modes,
                backend=args.backend,
                config=config,
                latency=not args.no_latency,
                progress=lambda s: print(s, file=sys.stderr),
            )
        except (FileNotFoundError, ValueError, ImportError, RuntimeError) as e:
            print(f"rfmem: error: {e}", file=sys.stderr)
            return 2
        print(format_report(rep))
        if args.out:
            write_records(rep.records, args.out)
            print(f"wrote {len(rep.records)} records to {args.out}")
        if args.json_out:
            doc = report_json(rep)
            doc["command"] = "rfmem " + " ".join(sys.argv[1:] if argv is None else argv)
            with open(args.json_out, "w") as f:
                json.dump(doc, f, indent=2)
            print(f"wrote figures to {args.json_out}")
        return 0
    return args.func(args)  # sub-commands registered by optional modules


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
