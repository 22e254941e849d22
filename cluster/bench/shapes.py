"""Production shapes: what the engine adds per step as the vocabulary and the batch grow, before and after.

Random-weight Llama checkpoints built from a transformers config (hidden 64, 2 layers; nothing downloaded) at each
vocabulary of ``--vocabs`` (default 4,096, 32,000 and Llama 3's 128,256); the drafter is a copy of the target, so
acceptance does not move with V.  For each vocabulary, ``--rows`` requests together (default 1, 8, 32), greedy and
T = 1, autoregressive, speculative k = 4 and CS Drafting (the drafter reviewing the suffix drafter's proposals, the
default K-matrix), each under both samplers of the engine (``engine.sampler``):
``reference`` (row by row on the host in float64, the test oracle: the engine as it was) and ``batched`` (the
whole round in one call on the model's device, :mod:`cluster.core.rejection`), interleaved in one run; then,
unless ``--runtime in-process``, the autoregressive and speculative cells of the largest row count served
(:func:`served_cells`: Ray Serve, colocated, gRPC on 127.0.0.1) under each sampler, the share of their outputs
equal to the in-process ones reported (``served_equal``: 1 greedy; at T = 1 a float32 rounding of the batch can flip a draw).

Per step: wall time, the models' forward time (hooks around the HF modules) and the rest, the engine's own work.
The floor the own work is measured against: one argmax and one softmax over the step's logits block (rows x 9 x
V float32: the target's 5 rows and the drafter's 4 of a k = 4 step), timed in the same run.  Output: a table,
``bench_shapes.{csv,json}`` and ``bench_shapes.png``.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from cluster.bench.report import RUNTIMES, local_ray, parse_ints, parse_runtimes, print_table, write_results
from cluster.bench.served import WARMUP_TOKENS, served_config, serving
from cluster.bench.served_cells import served_cell
from cluster.config.paths import default_cache_dir
from cluster.config.schema import load_config
from cluster.core.sampling import SamplingParams
from cluster.engine.engine import Engine
from cluster.engine.request import GenerationRequest
from cluster.local import build_engine

VOCABS = (4096, 32000, 128256)
ROWS = (1, 8, 32)
NEW_TOKENS = 32            # generated per request
PROMPT = 8                 # prompt tokens per request
K = 4
SAMPLERS = ("reference", "batched")
OPTIONS = {"drafter": "drafter", "k": K}
STRATEGIES = {"autoregressive": {}, "speculative": OPTIONS,       # the cells' strategies and their options;
              "cs_drafting": {"drafters": "drafter,suffix"}}        # CS Drafting in-process only
SEED = 100


class _ForwardClock:
    """Seconds spent inside the forward of the given modules (pre- and post-forward hooks)."""

    def __init__(self, modules):
        self.seconds, self._t0 = 0.0, None
        self._hooks = [h for m in modules for h in (m.register_forward_pre_hook(self._pre),
                                                    m.register_forward_hook(self._post))]

    def _pre(self, *_):
        self._t0 = time.perf_counter()

    def _post(self, *_):
        self.seconds += time.perf_counter() - self._t0


def write_checkpoint(root: Path, vocab: int, seed: int = 0) -> Path:
    """A random-weight Llama checkpoint at ``vocab`` (hidden 64, 2 layers, 4 heads, float32) with a word-level
    tokenizer of ``vocab`` entries (token i is ``w<i>``), written once under ``root`` -> its directory."""
    path = root / f"llama-v{vocab}-s{seed}"
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return path


def config_for(path: Path, sampler: str, rows: int, root: Path, cascade: bool = False):
    """The config of target = drafter = ``path``, colocated, written as a user writes one (``engine.sampler``
    chosen) and loaded; ``cascade``: with the suffix drafter, for CS Drafting's cells (it indexes every
    request's output, work the other cells' engine does not do)."""
    doc = {"target": "target",
           "models": {"target": {"path": str(path)}, "drafter": {"path": str(path)}},
           "engine": {"strategy": "speculative", "max_batch": rows, "max_queue": rows, "sampler": sampler,
                      "max_new_tokens_limit": NEW_TOKENS, "kv_budget_tokens": 1 << 20,
                      "options": dict(OPTIONS)},
           "cluster": {"topology": "colocated"}}
    if cascade:
        doc["suffix"] = {}
    cfg_path = root / f"{path.name}-{sampler}{'-cs' if cascade else ''}.yaml"
    cfg_path.write_text(yaml.safe_dump(doc))
    return load_config(cfg_path)


def engine_for(path: Path, sampler: str, rows: int, root: Path, cascade: bool = False) -> Engine:
    """The in-process engine (:func:`cluster.local.build_engine`) of :func:`config_for`."""
    return build_engine(config_for(path, sampler, rows, root, cascade))


def floor_passes(rows: int, vocab: int, repeat: int = 3) -> dict:
    """Milliseconds of one argmax and one softmax over a rows x 9 x V float32 block (best of ``repeat``)."""
    x = torch.randn(rows, 2 * K + 1, vocab)
    best = {}
    for name, fn in (("argmax", lambda: x.argmax(-1)), ("softmax", lambda: torch.softmax(x, -1))):
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        best[name] = 1e3 * min(times)
    return best


def prompts(rows: int, vocab: int) -> list[list[int]]:
    """The cells' prompts: request i's PROMPT tokens."""
    return [[(7 * i + j) % vocab + 1 for j in range(PROMPT)] for i in range(rows)]


def measure(engine: Engine, clock: _ForwardClock, rows: int, strategy: str, temperature: float, seed: int) -> dict:
    """One cell: ``rows`` requests of NEW_TOKENS tokens together -> per-step wall, model and own ms."""
    options = STRATEGIES[strategy]
    reqs = [GenerationRequest(prompt_ids=p, max_new_tokens=NEW_TOKENS, sampling=SamplingParams(temperature),
                              seed=seed + i, strategy=strategy, options=options, ignore_eos=True)
            for i, p in enumerate(prompts(rows, engine.vocab_size))]
    steps0, model0 = engine.steps, clock.seconds
    t0 = time.perf_counter()
    results = engine.generate_many(reqs)
    wall = time.perf_counter() - t0
    steps = engine.steps - steps0
    model = clock.seconds - model0
    return {"steps": steps, "step_ms": 1e3 * wall / steps, "model_ms": 1e3 * model / steps,
            "own_ms": 1e3 * (wall - model) / steps, "tokens": [r.token_ids for r in results]}


def run(args, cfg) -> int:
    vocabs = parse_ints("vocabs", getattr(args, "vocabs", None) or ",".join(map(str, VOCABS)), 16, 262144)
    row_counts = parse_ints("rows", getattr(args, "rows", None) or ",".join(map(str, ROWS)), 1, 256)
    served = "cluster" in parse_runtimes(getattr(args, "runtime", None) or ",".join(RUNTIMES))
    torch.set_num_threads(1)
    table = []
    kinds = [(t, s) for t in (0.0, 1.0) for s in ("autoregressive", "speculative")]          # served too
    cells = [(r, t, s) for r in row_counts for t in (0.0, 1.0) for s in STRATEGIES]
    bar = tqdm(total=len(vocabs) * (len(cells) + served * len(kinds)) * len(SAMPLERS), desc="bench shapes",
               unit="cell")
    root = Path(getattr(args, "cache_dir", None) or default_cache_dir()) / "shapes"
    root.mkdir(parents=True, exist_ok=True)
    for V in vocabs:
        path = write_checkpoint(root, V)
        engines = {(s, c): engine_for(path, s, max(row_counts), root, c) for s in SAMPLERS for c in (False, True)}
        clock = _ForwardClock([e.models[n].model for e in engines.values() for n in ("target", "drafter")])
        for (_, c), e in engines.items():                                 # warm-up (not timed)
            measure(e, clock, 1, "cs_drafting" if c else "speculative", 1.0, 0)
        tokens = {}
        for rows, temperature, strategy in cells:
            floor = floor_passes(rows, V)
            got = {}
            for s in SAMPLERS:                                            # side by side, same cell
                got[s] = measure(engines[(s, strategy == "cs_drafting")], clock, rows, strategy, temperature, SEED)
                tokens[(s, temperature, strategy, rows)] = got[s]["tokens"]
                bar.update()
            before, after = got["reference"], got["batched"]
            equal = before["tokens"] == after["tokens"] if temperature == 0 else None
            table.append({"V": V, "rows": rows, "T": temperature, "strategy": strategy,
                          "model_ms": after["model_ms"],
                          "own_ms_before": before["own_ms"], "own_ms_after": after["own_ms"],
                          "own_after/before": after["own_ms"] / before["own_ms"],
                          "step_ms_before": before["step_ms"], "step_ms_after": after["step_ms"],
                          "own/model_after": after["own_ms"] / after["model_ms"],
                          "argmax_ms": floor["argmax"], "softmax_ms": floor["softmax"],
                          "greedy_equal": equal})
        del engines, clock
        if served:
            _served_columns(table, path, root, V, max(row_counts), kinds, tokens, bar)
    bar.close()
    _vocab_added(table)
    print_table(table, f"shapes: random-weight Llama (hidden 64, 2 layers), drafter = target copy, k = {K}, "
                       f"{NEW_TOKENS} tokens a request; own = step wall - the models' forward time")
    out = Path(args.out)
    write_results(table, out, "bench_shapes")
    _plot(table, out / "bench_shapes.png")
    print(f"results written to {out / 'bench_shapes'}.{{csv,json,png}}")
    return 0


def _served_columns(table, path, root, V, rows, kinds, tokens, bar) -> None:
    """The served column (:func:`served_cells`) of the cells at ``rows``: served tokens/s before
    and after, and whether every served output equals the in-process one of its sampler."""
    got = served_cells(path, root, rows, kinds, SAMPLERS, prompts(rows, V), NEW_TOKENS, OPTIONS, SEED)
    bar.update(len(kinds) * len(SAMPLERS))
    for r in table:
        if r["V"] != V or r["rows"] != rows or (r["T"], r["strategy"]) not in kinds:
            continue
        before, after = (got[(s, r["T"], r["strategy"])] for s in SAMPLERS)
        r["served_tok_s_before"], r["served_tok_s_after"] = before["tok_s"], after["tok_s"]
        r["served_after/before"] = after["tok_s"] / before["tok_s"] if before["tok_s"] else None
        key = (r["T"], r["strategy"])
        same = [a == b for s in SAMPLERS for a, b in zip(got[(s, *key)]["tokens"], tokens[(s, *key, rows)])]
        r["served_equal"] = sum(same) / len(same)        # of the rows, both samplers (see served_cells)
        r["served_failed"] = sum(got[(s, *key)]["failures"] for s in SAMPLERS)


def _vocab_added(table: list[dict]) -> None:
    """Adds, to each row at the largest vocabulary, what the vocabulary adds to the own work (own at V minus own
    at the smallest V, same rows, T and strategy) in passes of the floor (argmax greedy, softmax at T = 1)."""
    vs = sorted({r["V"] for r in table})
    if len(vs) < 2:
        return
    small = {(r["rows"], r["T"], r["strategy"]): r for r in table if r["V"] == vs[0]}
    for r in table:
        base = small.get((r["rows"], r["T"], r["strategy"]))
        if r["V"] == vs[0] or base is None:
            continue
        floor = r["argmax_ms"] if r["T"] == 0 else r["softmax_ms"]
        r["vocab_passes_before"] = (r["own_ms_before"] - base["own_ms_before"]) / floor
        r["vocab_passes_after"] = (r["own_ms_after"] - base["own_ms_after"]) / floor


def _plot(table: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:                                  # the bench extra is not installed: the table is all
        return
    rows = max(r["rows"] for r in table)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), sharey=True)
    for ax, strategy in zip(axes, ("autoregressive", "speculative", "cs_drafting")):
        for T, style in ((0.0, "-"), (1.0, "--")):
            sel = sorted((r for r in table if r["rows"] == rows and r["T"] == T and r["strategy"] == strategy),
                         key=lambda r: r["V"])
            vs = [r["V"] for r in sel]
            ax.plot(vs, [r["own_ms_before"] for r in sel], style, marker="o", color="tab:red", label=f"before T={T:g}")
            ax.plot(vs, [r["own_ms_after"] for r in sel], style, marker="o", color="tab:blue", label=f"after T={T:g}")
            ax.plot(vs, [r["model_ms"] for r in sel], style, marker=".", color="gray", label=f"model T={T:g}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{strategy}, {rows} rows")
        ax.set_xlabel("vocabulary")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("ms per step")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def served_cells(path: Path, root: Path, rows: int, cells: list[tuple[float, str]], samplers, prompts,
                 new_tokens: int, options: dict, first_seed: int) -> dict:
    """The served column: per sampler the Serve application of :func:`config_for` on free 127.0.0.1 ports (a
    local Ray unless the caller started one; Serve shut down after each, on errors too), every cell of
    ``rows`` sent as that many concurrent unary requests with the in-process cell's prompts and seeds (one
    untimed request first); ``cells``: (temperature, strategy) -> {(sampler, T, strategy): {"tok_s", "tokens",
    "failures"}}.  Every draw is a function of the request's seed and position, not of its batch; the logits are
    not, to the last float32 bit: requests arriving apart decode beside rows of other lengths, whose padded keys
    move the attention's rounding (no kernel here is batch-invariant).  Greedy outputs are equal all the same; a
    sampled row's draw flips where its uniform falls within that rounding of a boundary of the inverse CDF, which
    grows with V on these near-flat random-weight laws (the ``served_equal`` column: the share of rows equal)."""
    out: dict = {}
    with local_ray():
        for sampler in samplers:
            with serving(served_config(config_for(path, sampler, rows, root), "colocated")) as client:
                served_cell(client, prompts, 1, 1, WARMUP_TOKENS, "speculative", options, stream=False,
                            temperature=1.0)
                for T, strategy in cells:
                    recs, secs = served_cell(client, prompts[:rows], rows, rows, new_tokens, strategy,
                                             STRATEGIES[strategy], first_seed=first_seed,
                                             stream=False, temperature=T)
                    ok = [r for r in recs if r.error is None]
                    out[(sampler, T, strategy)] = {
                        "tok_s": sum(len(r.token_ids) for r in ok) / secs if secs else 0.0,
                        "tokens": [r.token_ids if r.error is None else None for r in recs],
                        "failures": len(recs) - len(ok)}
    return out
