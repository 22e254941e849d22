"""Chat and agent workloads: what prefix caching buys when clients resend their history every turn.

Two workloads, each run with ``engine.prefix_caching`` on and off, side by side in one run, interleaved turn by turn
over the same models' checkpoints so the ratios are comparable on a noisy machine; in-process (an engine per row)
and served (``--runtime``, default both: a Serve application per row, colocated, on one local Ray; a turn's
requests sent together as gRPC streams on 127.0.0.1, TTFT as the client sees it):

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
the share of them the target's prefix cache held (``usage.prompt_tokens_details.cached_tokens``).  The TTFT of
one-line prompts as many together as the row runs (``one-line c=N``, measured in the same run) is the yardstick
a turn is compared with: what the conversation's length adds, not what its batch does.  Every output with
caching must equal the output without it (greedy).  ``bench_chat.{csv,json}`` and ``bench_chat.png``.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from cluster.bench.report import RUNTIMES, local_ray, parse_runtimes, print_table, write_results
from cluster.bench.served import served_config, serving
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import check_int
from cluster.local import build_engine
from cluster.models.build import load_tokenizer

GREEDY = SamplingParams(0.0)
SYSTEM = ("You are a careful assistant for a team that writes Python services. Answer with code when code is "
          "asked for, keep explanations short, and follow the repository's style: type hints, docstrings, small "
          "functions, tests next to the code. ") * 3
TOOLS = ('{"tools": [{"name": "read_file", "parameters": {"path": "string"}}, {"name": "write_file", '
         '"parameters": {"path": "string", "content": "string"}}, {"name": "run_tests", "parameters": '
         '{"target": "string"}}, {"name": "search", "parameters": {"query": "string", "limit": "integer"}}]} ') * 3
ASKS = ["def parse(line):", "class Cache:", "def main():", "import os\n", "def load(path):", "for item in items:",
        "def retry(fn, n):", "with open(name) as f:"]


_LABEL = {"in-process": "in-process", "cluster": "served"}      # --runtime -> the rows' runtime column


class Answer(NamedTuple):
    """One request of a turn, as either runtime reports it."""

    token_ids: list[int]
    ttft_s: float                # submit to first token (served: as the client saw it, over gRPC)
    prompt_tokens: int
    cached_tokens: int


class InProcess:
    """A row on its own in-process engine: a turn's requests together through ``generate_many``."""

    def __init__(self, cfg, caching: str, strategy: str):
        self.engine, self.strategy = build_engine(_caching(cfg, caching)), strategy

    def turn(self, prompts: list[list[int]], max_new: int) -> tuple[list[Answer], float]:
        t0 = time.perf_counter()
        res = self.engine.generate_many([GenerationRequest(prompt_ids=p, max_new_tokens=max_new, sampling=GREEDY,
                                                           seed=0, strategy=self.strategy, ignore_eos=True)
                                         for p in prompts])
        return [Answer(list(r.token_ids), r.stats.ttft_s, r.stats.prompt_tokens, r.stats.cached_tokens)
                for r in res], time.perf_counter() - t0


class Served:
    """A row served: its own Serve application (colocated) on the suite's proxies, a turn's requests sent
    together as streams over gRPC on 127.0.0.1 (TTFT as the client sees it)."""

    def __init__(self, client, strategy: str):
        self.client, self.strategy = client, strategy

    def turn(self, prompts: list[list[int]], max_new: int) -> tuple[list[Answer], float]:
        out: list = [None] * len(prompts)

        def one(i: int) -> None:
            t0, first, result = time.perf_counter(), None, None
            for chunk in self.client.stream(prompt_ids=prompts[i], max_new_tokens=max_new, temperature=0.0,
                                            seed=0, strategy=self.strategy, ignore_eos=True):
                if chunk.token_ids and first is None:
                    first = time.perf_counter()
                if chunk.HasField("result"):
                    result = chunk.result
            st = result.stats
            out[i] = Answer(list(result.token_ids), first - t0, st.prompt_tokens, st.cached_tokens)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any(a is None for a in out):
            raise RuntimeError("bench chat: a served request failed (see the server's log)")
        return out, time.perf_counter() - t0


def _caching(cfg, mode: str):
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, prefix_caching=mode))


def _modes(cfg) -> dict[str, tuple[str, str]]:
    """Row name -> (prefix caching, strategy): plain decoding with caching on and off, and with the suffix
    drafter (past outputs as drafts) on top of caching where the config serves it."""
    modes = {"on": ("on", "autoregressive"), "off": ("off", "autoregressive")}
    if cfg.suffix is not None:
        modes["on+suffix"] = ("on", "suffix")
    return modes


@contextmanager
def _rows(cfg, runtimes: list[str]):
    """(runtime, row name) -> a runner with ``turn``; the served rows' applications run on one Serve (a local
    Ray, on free ports) until the block ends, each row on its own unit."""
    modes = _modes(cfg)
    rows = {(_LABEL["in-process"], m): InProcess(cfg, c, s) for m, (c, s) in modes.items()} if "in-process" in runtimes \
        else {}
    if "cluster" not in runtimes:
        yield rows
        return
    base = served_config(cfg, "colocated")
    with local_ray(), ExitStack() as stack:
        for i, (m, (caching, strategy)) in enumerate(modes.items()):
            scfg = _caching(dataclasses.replace(base, cluster=dataclasses.replace(
                base.cluster, app_name=f"chat-{m.replace('+', '-')}")), caching)
            # the first starts Serve (and shuts it down last); the others join it as applications of their own
            rows[(_LABEL["cluster"], m)] = Served(stack.enter_context(serving(scfg, join=i > 0)), strategy)
        yield rows


def _row(runtime, workload, mode, turn, answers: list[Answer], wall) -> dict:
    ttft = [a.ttft_s * 1e3 for a in answers]
    prompt = sum(a.prompt_tokens for a in answers)
    cached = sum(a.cached_tokens for a in answers)
    return {"runtime": runtime, "workload": workload, "caching": mode, "turn": turn, "requests": len(answers),
            "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 2), "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 2),
            "tok_s": round(sum(len(a.token_ids) for a in answers) / wall, 1), "prompt_tokens": prompt,
            "hit_rate": round(cached / prompt, 3) if prompt else 0.0}


def run(args, cfg) -> int:
    convs = check_int("conversations", getattr(args, "conversations", None) or 8, 1, 64)
    turns = check_int("turns", getattr(args, "turns", None) or 4, 1, 16)
    max_new = check_int("max_new_tokens", getattr(args, "max_new_tokens", None) or 24, 1, 256)
    runtimes = parse_runtimes(getattr(args, "runtime", None) or ",".join(RUNTIMES))
    tok = load_tokenizer(cfg)
    with _rows(cfg, runtimes) as rows:
        table, equal, total, system, tools = _workloads(rows, tok, cfg, convs, turns, max_new)
    _summarise(table)
    print_table(table, f"chat: {convs} conversations x {turns} turns sharing a system prompt ({len(system)} tokens), "
                       f"agent: one tool schema ({len(tools)} tokens) {turns * 2} times; prefix caching on / off "
                       f"(and on + the suffix drafter), {' and '.join(_LABEL[r] for r in runtimes)}, greedy, {max_new} new tokens; "
                       f"outputs equal across rows: {equal}/{total}; config {cfg.source}")
    out = Path(args.out)
    write_results(table, out, "bench_chat")
    _plot(table, out / "bench_chat.png")
    print(f"results written to {out / 'bench_chat'}.{{csv,json,png}}")
    return 0 if equal == total else 1


def _workloads(rows: dict, tok, cfg, convs: int, turns: int, max_new: int):
    """Every workload over every row, interleaved turn by turn -> (table, outputs equal, outputs, the system
    prompt's ids, the tool schema's ids)."""
    table, equal, total = [], 0, 0
    ref = next(key for key in rows if key[1] == "off")            # the row every output is compared with
    for key, row in rows.items():              # warm-up and the one-line yardsticks: alone, and as many together
        row.turn([tok.encode("hi")], 4)            # as a chat turn runs (what the turn's TTFT is compared with)
        for c in sorted({1, convs}):
            res, wall = row.turn([tok.encode(ASKS[i % len(ASKS)]) for i in range(c)], max_new)
            table.append(_row(key[0], f"one-line c={c}", key[1], 0, res, wall))
    system = tok.encode(SYSTEM)
    history = {key: [list(system) for _ in range(convs)] for key in rows}
    for turn in tqdm(range(1, turns + 1), desc="bench chat", unit="turn"):
        outs = {}
        for key, row in rows.items():
            prompts = [h + tok.encode(f"\nUser: {ASKS[(turn + i) % len(ASKS)]}\nAssistant:")
                       for i, h in enumerate(history[key])]
            res, wall = row.turn(prompts, max_new)
            table.append(_row(key[0], "chat", key[1], turn, res, wall))
            history[key] = [p + r.token_ids for p, r in zip(prompts, res)]
            outs[key] = [r.token_ids for r in res]
        equal += sum(all(o[i] == outs[ref][i] for o in outs.values()) for i in range(convs))
        total += convs
    tools = tok.encode(TOOLS)
    for i in tqdm(range(turns * 2), desc="bench agent", unit="call"):
        outs = {}
        for key, row in rows.items():
            res, wall = row.turn([tools + tok.encode(f"\nTask {i}: {ASKS[i % len(ASKS)]}")], max_new)
            table.append(_row(key[0], "agent", key[1], i + 1, res, wall))
            outs[key] = res[0].token_ids
        equal += all(o == outs[ref] for o in outs.values())
        total += 1
    wide = min(16, cfg.engine.max_batch)
    for c, per in ((1, 8), (wide, wide)):                       # what caching costs where nothing is shared
        got = {key: ([], 0.0) for key in rows}
        for rep in range(2):                                    # interleaved rounds; unique prompts each
            for key, row in rows.items():
                prompts = [tok.encode(f"{1000 * c + 100 * rep + i} {ASKS[i % len(ASKS)]} # {SYSTEM[i:i + 120]}")
                           for i in range(per)]
                for batch in (prompts[k:k + c] for k in range(0, per, c)):
                    res, wall = row.turn(batch, max_new)
                    got[key] = (got[key][0] + res, got[key][1] + wall)
        for key, (res, wall) in got.items():
            table.append(_row(key[0], f"distinct c={c}", key[1], 0, res, wall))
    return table, equal, total, system, tools


def _summarise(table: list[dict]) -> None:
    """The goals' ratios on each row: TTFT over that of one-line prompts as many together (a chat turn: its
    conversations; the agent and ``distinct c=1``: one), tok/s over caching off's same turn."""
    line = {(r["runtime"], r["caching"], r["requests"]): r["ttft_p50_ms"] for r in table
            if r["workload"].startswith("one-line")}
    off = {(r["runtime"], r["workload"], r["turn"]): r for r in table if r["caching"] == "off"}
    for r in table:
        base = line.get((r["runtime"], r["caching"], r["requests"]))
        r["ttft_vs_one_line"] = round(r["ttft_p50_ms"] / base, 2) if base else None
        base = off.get((r["runtime"], r["workload"], r["turn"]))
        r["tok_s_vs_off"] = round(r["tok_s"] / base["tok_s"], 2) if base and base["tok_s"] else None


def _plot(table: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:                                  # the bench extra is not installed: the table is all
        return
    runtimes = list(dict.fromkeys(r["runtime"] for r in table))
    fig, axes = plt.subplots(len(runtimes), 2, figsize=(10, 4 * len(runtimes)), squeeze=False)
    for axrow, runtime in zip(axes, runtimes):
        for ax, workload in zip(axrow, ("chat", "agent")):
            mine = [r for r in table if r["runtime"] == runtime]
            for mode, color in (("on", "tab:blue"), ("off", "tab:red"), ("on+suffix", "tab:green")):
                sel = [r for r in mine if r["workload"] == workload and r["caching"] == mode]
                if sel:
                    ax.plot([r["turn"] for r in sel], [r["ttft_p50_ms"] for r in sel], marker="o", color=color,
                            label=f"prefix caching {mode}")
            c = max(r["requests"] for r in mine if r["workload"] == workload)
            line = [r["ttft_p50_ms"] for r in mine if r["workload"] == f"one-line c={c}" and r["caching"] == "on"]
            if line:
                ax.axhline(line[0], color="gray", ls="--", label=f"one-line prompts, {c} together")
            ax.set_title(f"{workload}, {runtime}")
            ax.set_xlabel("turn" if workload == "chat" else "call")
            ax.set_ylabel("TTFT p50 (ms)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
