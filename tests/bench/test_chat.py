"""`bench --suite chat` on the tiny models: later turns find their history in the prefix cache, caching off finds
nothing, outputs are equal with and without it, and the table, files and plot are written."""
import dataclasses
import json
from types import SimpleNamespace

import pytest

from cluster.bench.chat import run
from cluster.config.schema import SuffixSpec, load_config
from cluster.errors import ParamError


def test_chat_suite_compares_caching_on_and_off(tmp_path, capsys):
    args = SimpleNamespace(conversations=2, turns=2, max_new_tokens=6, out=str(tmp_path), runtime="in-process")
    assert run(args, load_config("configs/tiny.yaml")) == 0
    rows = json.loads((tmp_path / "bench_chat.json").read_text())
    by = {(r["workload"], r["caching"], r["turn"]): r for r in rows}
    assert len(rows) == 2 * (2 + 2 + 4 + 2)
    assert {r["runtime"] for r in rows} == {"in-process"}
    line = {r["requests"]: r["ttft_p50_ms"] for r in rows if r["workload"].startswith("one-line") and r["caching"] == "on"}
    assert by[("chat", "on", 2)]["ttft_vs_one_line"] == round(by[("chat", "on", 2)]["ttft_p50_ms"] / line[2], 2)
    assert by[("agent", "on", 2)]["ttft_vs_one_line"] == round(by[("agent", "on", 2)]["ttft_p50_ms"] / line[1], 2)
    assert by[("chat", "on", 2)]["hit_rate"] > 0.5 and by[("agent", "on", 2)]["hit_rate"] > 0.5
    assert all(r["hit_rate"] == 0 for r in rows if r["caching"] == "off")
    assert by[("chat", "on", 1)]["hit_rate"] > 0.3                   # the system prompt shared within the first batch
    assert all(r["hit_rate"] == 0 for r in rows if r["workload"].startswith("distinct"))
    assert by[("chat", "on", 2)]["tok_s_vs_off"] is not None and by[("chat", "on", 2)]["ttft_vs_one_line"] > 0
    assert (tmp_path / "bench_chat.png").stat().st_size > 0
    assert "outputs equal across rows: 8/8" in capsys.readouterr().out


def test_the_suffix_row_drafts_from_earlier_turns(tmp_path, capsys):
    cfg = dataclasses.replace(load_config("configs/tiny.yaml"), suffix=SuffixSpec())
    assert run(SimpleNamespace(conversations=2, turns=2, max_new_tokens=6, out=str(tmp_path), runtime="in-process"),
               cfg) == 0
    rows = json.loads((tmp_path / "bench_chat.json").read_text())
    suffix = [r for r in rows if r["caching"] == "on+suffix"]
    assert len(suffix) == 2 + 2 + 4 + 2 and suffix[-3]["hit_rate"] > 0.5
    assert "outputs equal across rows: 8/8" in capsys.readouterr().out


@pytest.mark.slow      # ~60 s: Ray, Serve and two applications
def test_chat_suite_served_beside_in_process(tmp_path, capsys):
    """Served rows (a Serve application per caching mode, streams over gRPC) hit the cache as the in-process ones
    do, report the client's TTFT, and answer what in-process answers."""
    args = SimpleNamespace(conversations=2, turns=2, max_new_tokens=6, out=str(tmp_path), runtime="in-process,cluster")
    assert run(args, load_config("configs/tiny.yaml")) == 0
    rows = json.loads((tmp_path / "bench_chat.json").read_text())
    by = {(r["runtime"], r["workload"], r["caching"], r["turn"]): r for r in rows}
    assert len(rows) == 2 * 2 * (2 + 2 + 4 + 2)
    assert by[("served", "chat", "on", 2)]["hit_rate"] > 0.5 and by[("served", "chat", "off", 2)]["hit_rate"] == 0
    assert by[("served", "chat", "on", 2)]["ttft_p50_ms"] > 0
    assert by[("served", "chat", "on", 2)]["tok_s_vs_off"] is not None
    assert "outputs equal across rows: 8/8" in capsys.readouterr().out


def test_chat_suite_refuses_bad_sizes(tmp_path):
    with pytest.raises(ParamError, match="runtime"):
        run(SimpleNamespace(runtime="gpu", out=str(tmp_path)), load_config("configs/tiny.yaml"))
    with pytest.raises(ParamError, match="turns"):
        run(SimpleNamespace(conversations=2, turns=99, out=str(tmp_path)), load_config("configs/tiny.yaml"))
