#!/usr/bin/env python
"""Print a benchmark JSON (``rfmem bench``'s report, by default bench/results/local/bench-*.json) as markdown tables, for the README.

    python bench/to_markdown.py bench/results/local/bench-20250101-120000.json
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from rfmem_fast.bench.report import build_tables, format_markdown  # noqa: E402


def main(argv: list[str]) -> int:
    """Print the markdown of each JSON file named in ``argv``; returns the exit code."""
    if not argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    for path in argv:
        with open(path, encoding="utf-8") as f:
            print(format_markdown(build_tables(json.load(f))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
