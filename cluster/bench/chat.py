"""Chat and agent workloads: what prefix caching buys when clients resend their history every turn.

Two workloads, each run with ``engine.prefix_caching`` on and off, side by side in one process (the two engines
interleaved turn by turn over the same models' checkpoints, so the ratios are comparable on a noisy machine):

* ``chat``: ``--conversations`` conversations that share one system prompt, ``--turns`` turns each; every turn
  resends the system prompt, the whole history (each earlier user message and the model's answer) and one new
  user message, and the conversations of a turn run together (one batch);
* ``agent``: the same tool schema (a long preamble) answered again and again with a short varying request, one
  request at a time (an agent loop);
* ``distinct c=1`` and ``distinct c=16``: prompts that share nothing (what caching costs where it cannot hit), one
  at a time and 16 together (at most ``engine.max_batch``), two interleaved rounds.

A third row, ``on+suffix``, runs the suffix drafter (past outputs as drafts, :mod:`cluster.core.suffix`) with
caching on, where the config serves it.

Per workload, caching and turn: time to first token p50 / p99, tok/s of the turn's batch, the prompt tokens and
the share of them the target's prefix cache held (``usage.prompt_tokens_details.cached_tokens``).  A one-line
prompt's TTFT, measured in the same run, is the yardstick the last turn is compared with, and every output with
caching must equal the output without it (greedy).  ``bench_chat.{csv,json}`` and ``bench_chat.png``.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cluster.bench.report import print_table, write_results
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import check_int
from cluster.local import build_engine

GREEDY = SamplingParams(0.0)
SYSTEM = ("You are a careful assistant for a team that writes Python services. Answer with code when code is "
          "asked for, keep explanations short, and follow the repository's style: type hints, docstrings, small "
          "functions, tests next to the code. ") * 3
TOOLS = ('{"tools": [{"name": "read_file", "parameters": {"path": "string"}}, {"name": "write_file", '
         '"parameters": {"path": "string", "content": "string"}}, {"name": "run_tests", "parameters": '
         '{"target": "string"}}, {"name": "search", "parameters": {"query": "string", "limit": "integer"}}]} ') * 3
ASKS = ["def parse(line):", "class Cache:", "def main():", "import os\n", "def load(path):", "for item in items:",
        "def retry(fn, n):", "with open(name) as f:"]


def _engines(cfg) -> dict[str, tuple]:
    """Row name -> (engine, strategy): plain decoding with prefix caching on and off, and with the suffix drafter
    (past outputs as drafts) on top of caching where the config serves it -- each over its own models."""
    def engine(mode):
        return build_engine(dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, prefix_caching=mode)))
    rows = {"on": (engine("on"), "autoregressive"), "off": (engine("off"), "autoregressive")}
    if cfg.suffix is not None:
        rows["on+suffix"] = (engine("on"), "suffix")
    return rows


def _turn(row: tuple, prompts: list[list[int]], max_new: int):
    engine, strategy = row
    t0 = time.perf_counter()
    res = engine.generate_many([GenerationRequest(prompt_ids=p, max_new_tokens=max_new, sampling=GREEDY, seed=0,
                                                  strategy=strategy, ignore_eos=True) for p in prompts])
    return res, time.perf_counter() - t0


def _row(workload, mode, turn, results, wall) -> dict:
    ttft = [r.stats.ttft_s * 1e3 for r in results]
    prompt = sum(r.stats.prompt_tokens for r in results)
    cached = sum(r.stats.cached_tokens for r in results)
    return {"workload": workload, "caching": mode, "turn": turn, "requests": len(results),
            "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 2), "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 2),
            "tok_s": round(sum(len(r.token_ids) for r in results) / wall, 1), "prompt_tokens": prompt,
            "hit_rate": round(cached / prompt, 3) if prompt else 0.0}


def run(args, cfg) -> int:
    convs = check_int("conversations", getattr(args, "conversations", None) or 8, 1, 64)
    turns = check_int("turns", getattr(args, "turns", None) or 4, 1, 16)
    max_new = check_int("max_new_tokens", getattr(args, "max_new_tokens", None) or 24, 1, 256)
    engines = _engines(cfg)
    tok = engines["on"][0].tokenizer
    system = tok.encode(SYSTEM)
    table, equal, total = [], 0, 0
    for mode, eng in engines.items():                           # warm-up and the one-line yardstick
        _turn(eng, [tok.encode("hi")], 4)
        res, wall = _turn(eng, [tok.encode(ASKS[0])], max_new)
        table.append(_row("one-line", mode, 0, res, wall))
    history = {mode: [list(system) for _ in range(convs)] for mode in engines}
    for turn in tqdm(range(1, turns + 1), desc="bench chat", unit="turn"):
        outs = {}
        for mode, eng in engines.items():
            prompts = [h + tok.encode(f"\nUser: {ASKS[(turn + i) % len(ASKS)]}\nAssistant:")
                       for i, h in enumerate(history[mode])]
            res, wall = _turn(eng, prompts, max_new)
            table.append(_row("chat", mode, turn, res, wall))
            history[mode] = [p + r.token_ids for p, r in zip(prompts, res)]
            outs[mode] = [r.token_ids for r in res]
        equal += sum(all(o[i] == outs["off"][i] for o in outs.values()) for i in range(convs))
        total += convs
    tools = tok.encode(TOOLS)
    for i in tqdm(range(turns * 2), desc="bench agent", unit="call"):
        outs = {}
        for mode, eng in engines.items():
            res, wall = _turn(eng, [tools + tok.encode(f"\nTask {i}: {ASKS[i % len(ASKS)]}")], max_new)
            table.append(_row("agent", mode, i + 1, res, wall))
            outs[mode] = res[0].token_ids
        equal += all(o == outs["off"] for o in outs.values())
        total += 1
    wide = min(16, cfg.engine.max_batch)
    for c, per in ((1, 8), (wide, wide)):                       # what caching costs where nothing is shared
        got = {mode: ([], 0.0) for mode in engines}
        for rep in range(2):                                    # interleaved rounds; unique prompts each
            for mode, eng in engines.items():
                prompts = [tok.encode(f"{1000 * c + 100 * rep + i} {ASKS[i % len(ASKS)]} # {SYSTEM[i:i + 120]}")
                           for i in range(per)]
                for batch in (prompts[k:k + c] for k in range(0, per, c)):
                    res, wall = _turn(eng, batch, max_new)
                    got[mode] = (got[mode][0] + res, got[mode][1] + wall)
        for mode, (res, wall) in got.items():
            table.append(_row(f"distinct c={c}", mode, 0, res, wall))
    _summarise(table)
    print_table(table, f"chat: {convs} conversations x {turns} turns sharing a system prompt ({len(system)} tokens), "
                       f"agent: one tool schema ({len(tools)} tokens) {turns * 2} times; prefix caching on / off "
                       f"(and on + the suffix drafter), greedy, {max_new} new tokens; outputs equal across rows: "
                       f"{equal}/{total}; "
                       f"config {cfg.source}")
    out = Path(args.out)
    write_results(table, out, "bench_chat")
    _plot(table, out / "bench_chat.png")
    print(f"results written to {out / 'bench_chat'}.{{csv,json,png}}")
    return 0 if equal == total else 1


def _summarise(table: list[dict]) -> None:
    """The goals' ratios on each row: TTFT over the one-line prompt's, tok/s over caching off's same turn."""
    line = {r["caching"]: r["ttft_p50_ms"] for r in table if r["workload"] == "one-line"}
    off = {(r["workload"], r["turn"]): r for r in table if r["caching"] == "off"}
    for r in table:
        r["ttft_vs_one_line"] = round(r["ttft_p50_ms"] / line[r["caching"]], 2) if line.get(r["caching"]) else None
        base = off.get((r["workload"], r["turn"]))
        r["tok_s_vs_off"] = round(r["tok_s"] / base["tok_s"], 2) if base and base["tok_s"] else None


def _plot(table: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:                                  # the bench extra is not installed: the table is all
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, workload in zip(axes, ("chat", "agent")):
        for mode, color in (("on", "tab:blue"), ("off", "tab:red"), ("on+suffix", "tab:green")):
            sel = [r for r in table if r["workload"] == workload and r["caching"] == mode]
            if not sel:
                continue
            ax.plot([r["turn"] for r in sel], [r["ttft_p50_ms"] for r in sel], marker="o", color=color,
                    label=f"prefix caching {mode}")
        line = [r["ttft_p50_ms"] for r in table if r["workload"] == "one-line" and r["caching"] == "on"]
        if line:
            ax.axhline(line[0], color="gray", ls="--", label="one-line prompt")
        ax.set_title(workload)
        ax.set_xlabel("turn" if workload == "chat" else "call")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
