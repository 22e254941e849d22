"""``specserve results`` (cluster/bench/results.py): the results page is the benchmark output files, rendered.

The files are written here the way the suites write them (:func:`cluster.bench.report.write_results`, rows with
the keys of ``served_report.make_table``, ``main.run`` and ``load_report.make_table``)."""
from __future__ import annotations

import json
from pathlib import Path

from cluster.bench.report import hop_columns, write_results
from cluster.bench.results import (MARKER, SECTIONS, markdown_table, missing_suites, read_results, render,
                                   served_headline, write_page)
from cluster.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def served_row(topology, mode, strategy, c, tok_s, ratio, mismatches=0, failures=0):
    """One row as served_report.make_table writes it (a separated unit's draft-call hop columns included)."""
    hops = hop_columns({"calls": 10, "hit_calls": 4, "wall_s": 0.03, "request_s": 0.005, "actor_s": 0.02,
                        "wait_s": 0.001, "compute_s": 0.018, "reply_s": 0.004, "hit_compute_s": 0.006,
                        "disordered": 0}) if topology == "separated" else {}
    return {"topology": topology, "mode": mode, "strategy": strategy, "concurrency": c, "requests": 8,
            "tokens": 512, "seconds": round(512 / tok_s, 3), "tok_s": tok_s, "vs_autoregressive": ratio,
            "chunks_per_request": 5.0 if mode == "streamed" else None,
            "streamed_vs_unary": 0.97 if mode == "streamed" else None,
            "ttft_p50": 27.1 if mode == "streamed" else None, "ttft_p99": 30.2 if mode == "streamed" else None,
            "tpot_p50": 5.2 if mode == "streamed" else None, "tpot_p99": 6.0 if mode == "streamed" else None,
            "in_process_tok_s": 230.0 if c == 1 else None, "cluster_vs_in_process": 0.95 if c == 1 else None,
            "mismatches": mismatches, "failures": failures,
            "failed_by_status": "UNAVAILABLE:1" if failures else None, **hops}


def served_rows():
    rows = []
    for topology, ar in (("colocated", 200.0), ("separated", 221.0)):
        for mode in ("unary", "streamed"):
            for c in (1, 4):
                bump = 0.0 if (mode, c) == ("unary", 1) else 0.5    # any other cell would show in the headline
                rows.append(served_row(topology, mode, "autoregressive", c, ar + 100 * bump, 1.0))
                rows.append(served_row(topology, mode, "default", c, 300.0, 1.69 + bump if topology == "colocated"
                                       else 1.48 + bump))
                if topology == "colocated":
                    rows.append(served_row(topology, mode, "mag", c, 310.0, 1.63 + bump, mismatches=int(c == 4)))
    return rows


def main_rows():
    """main.run's rows: Row.as_dict against the autoregressive row."""
    return [{"name": "autoregressive", "tokens": 512, "seconds": 2.87, "tokens_per_s": 178.4, "speedup": 1.0,
             "accepted_per_call": 0.0, "target_calls_per_token": 1.0, "draft_calls_per_token": 0.0},
            {"name": "speculative drafter-large k=4", "tokens": 512, "seconds": 1.95, "tokens_per_s": 262.9,
             "speedup": 1.474, "accepted_per_call": 2.62, "target_calls_per_token": 0.279,
             "draft_calls_per_token": 1.1}]


def load_rows():
    return [{"runtime": "in-process", "strategy": "autoregressive", "concurrency": 1, "requests": 2, "tokens": 128,
             "seconds": 1.07, "tok_s": 119.0, "vs_c1": 1.0, "ttft_p50": 9.1, "ttft_p99": 10.0, "tpot_p50": 8.0,
             "tpot_p99": 8.1, "mean_batch": 1.0, "vs_in_process": None, "join_share": 0.1, "drain_share": 0.0,
             "full_tok_per_ms": 0.12}]


def test_the_headline_is_the_unary_cells_at_one_client_per_strategy_and_topology():
    table = served_headline(served_rows())
    assert table == [{"strategy": "autoregressive", "colocated": "200 tok/s", "separated": "221 tok/s"},
                     {"strategy": "default", "colocated": "1.69x", "separated": "1.48x"},
                     {"strategy": "mag", "colocated": "1.63x", "separated": None}]
    md = markdown_table(table)
    assert md.splitlines()[0] == "| strategy | colocated | separated |"
    assert md.splitlines()[-1] == "| mag | 1.63x | - |"            # not measured there: a dash, never a number


def test_each_file_lands_in_its_suites_section_and_missing_suites_name_their_command(tmp_path):
    write_results(served_rows(), tmp_path, "bench_served")
    write_results(main_rows(), tmp_path, "bench_main_t0")
    write_results(load_rows(), tmp_path, "bench_load")
    write_results([{"x": 1, "never": None}], tmp_path, "bench_something_new")
    (tmp_path / "loadtest.json").write_text(json.dumps({"stages": []}))      # not a suite's table
    tables, skipped = read_results(tmp_path)
    assert set(tables) == {"bench_served", "bench_main_t0", "bench_load", "bench_something_new"}
    assert skipped == ["loadtest.json"]
    page = render(tables)
    assert page.startswith(MARKER + "\n")
    heads = [line for line in page.splitlines() if line.startswith("## ")]
    assert heads[0] == "## Headline: served, one client"
    assert heads[1:1 + len(SECTIONS)] == [f"## {s.title}" for s in SECTIONS] and heads[-1] == "## Other output files"
    assert page.index("### `bench_served`") < page.index("### `bench_main_t0`") < page.index("### `bench_load`")
    assert "| default | 1.69x | 1.48x |" in page
    # the served summary file was not written: the page says which command writes it, among the others
    assert "Not measured in this output: `specserve bench --suite verify` writes `bench_verify.json`, " \
           "`bench_verify_bonus.json`." in page
    assert missing_suites(tables) == [s.suite for s in SECTIONS if s.suite not in ("served", "main", "load")]
    # counted from the rows: 20 cells of 8 requests, none failed; mag at c = 4 mismatched once per mode
    assert "Over the whole run: 160 requests served, 2 greedy outputs different from autoregressive's, 0 failed." \
        in page
    assert "| speculative drafter-large k=4 | 512 | 1.950 | 262.9 | 1.474 | 2.620 | 0.279 | 1.100 |" in page
    new = page[page.index("### `bench_something_new`"):]
    assert "| x |" in new and "never" not in new                    # a column without a value is left out


def test_wide_tables_show_their_named_columns_only(tmp_path):
    write_results(served_rows(), tmp_path, "bench_served")
    write_results(load_rows(), tmp_path, "bench_load")
    page = render(read_results(tmp_path)[0])
    served = page[page.index("### `bench_served`"):page.index("## Strategies")]
    header = next(line for line in served.splitlines() if line.startswith("| topology"))
    assert "tok_s" in header and "request_hop_ms" not in header and "hit_share" not in header
    assert "cache_hit_share" not in header                          # named, but no row has it
    load = page[page.index("### `bench_load`"):]
    assert "join_share" not in load.splitlines()[4] and "vs_c1" in load.splitlines()[4]


def test_cells_keep_the_table_intact():
    md = markdown_table([{"a": "x|y", "b": 1234.5678, "c": 0.12345, "d": None}, {"d": "multi\nline"}])
    assert md.splitlines()[-2:] == ["| x\\|y | 1234.6 | 0.123 | - |", "| - | - | - | multi line |"]


def test_the_command_writes_the_rendered_page_and_refuses_a_missing_folder(tmp_path, capsys):
    write_results(main_rows(), tmp_path / "out", "bench_main_t1")
    page = tmp_path / "docs" / "results.md"
    assert main(["results", "--input", str(tmp_path / "out"), "--output", str(page)]) == 0
    assert page.read_text() == render(read_results(tmp_path / "out")[0])
    assert "### `bench_main_t1`" in page.read_text()
    assert "1 table(s)" in capsys.readouterr().out
    assert main(["results", "--input", str(tmp_path / "nowhere"), "--output", str(page)]) == 2
    assert "invalid input" in capsys.readouterr().err


def test_the_committed_results_page_is_generated():
    assert (ROOT / "docs" / "results.md").read_text().splitlines()[0] == MARKER


def test_a_suite_run_alone_refreshes_its_section_and_keeps_the_others(tmp_path):
    """Rendering over an existing page keeps the sections this output has no file for, marked as kept, and
    replaces the ones it has; a section never measured stays 'not measured'."""
    from cluster.bench.results import KEPT
    page = tmp_path / "results.md"
    write_results(main_rows(), tmp_path / "a", "bench_main_t1")
    write_results(served_rows(), tmp_path / "a", "bench_served")
    write_page(tmp_path / "a", page)
    first = page.read_text()
    assert "### `bench_main_t1`" in first
    headline = first[first.index("## Headline"):first.index("## Served")]
    assert "| strategy |" in headline
    write_results([{"V": 64, "rows": 1, "own_ms_after": 1.0}], tmp_path / "b", "bench_shapes")
    write_page(tmp_path / "b", page)
    second = page.read_text()
    assert "### `bench_main_t1`" in second and "### `bench_shapes`" in second and second.count(KEPT) == 3
    assert second[second.index("## Headline"):second.index("## Served")] == \
        headline.replace("## Headline: served, one client\n\n", f"## Headline: served, one client\n\n{KEPT}\n\n")
    assert "Not measured in this output: `specserve bench --suite load`" in second
    write_page(tmp_path / "b", page)                      # rendering again: the same page, one mark
    assert page.read_text() == second
