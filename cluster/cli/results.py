"""``specserve results``: render the benchmark output files (``specserve bench --out``, default bench_out/) as
the Markdown results page (docs/results.md), with :mod:`cluster.bench.results`."""
from __future__ import annotations

from pathlib import Path

from cluster.bench.results import missing_suites, write_page
from cluster.errors import ParamError


def add_results_command(sub) -> None:
    r = sub.add_parser("results", help="render the JSON files `specserve bench` wrote as the Markdown results page")
    r.add_argument("--input", default="bench_out", help="folder of `specserve bench` output (default bench_out)")
    r.add_argument("--output", default="docs/results.md", help="Markdown file to write (default docs/results.md)")


def cmd_results(args) -> int:
    folder = Path(args.input)
    if not folder.is_dir():
        raise ParamError("input", "a folder of `specserve bench` output (specserve bench --out)", args.input)
    tables, skipped = write_page(folder, Path(args.output))
    missing = missing_suites(tables)
    print(f"wrote {args.output}: {len(tables)} table(s) from {folder}"
          + (f"; suites without output: {', '.join(missing)}" if missing else "")
          + (f"; skipped (not a suite's table): {', '.join(skipped)}" if skipped else ""))
    return 0
