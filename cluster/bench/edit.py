"""Edit workload: predicted outputs (OpenAI's ``prediction``) on held-out source files with a small change asked for.

Each case is a snippet of a held-out standard-library file (never trained on; :func:`cluster.family.corpus.heldout_prompts`
cuts it at line boundaries) written out as the file before an edit, then the header of the file after a small change;
the model writes the file after it (:func:`edit_cases`).  Two predictions, as a client would send them:

* ``file``: the original snippet (OpenAI's predicted-outputs case: "regenerating a file with a small change").
  It helps only as far as the target's output follows the file;
* ``regenerate``: the target's own earlier answer to the same prompt with a small edit (two tokens replaced a third
  of the way in): the case where the output does follow the prediction except around a change, e.g. a client
  asking again for an answer it has, with one thing changed.

Rows: autoregressive, and each drafting strategy (speculative with the config's drafter, mag, cs_drafting) without
a prediction and with each; all greedy on the same cases, interleaved case by case in one process after a warm-up,
so the ratios are comparable on a noisy machine.  Columns: tok/s, its ratio to autoregressive and to the same
strategy without a prediction, target calls per token, the prediction's accepted / rejected draft tokens (OpenAI's
``accepted_prediction_tokens`` / ``rejected_prediction_tokens``) and how many outputs equal autoregressive
decoding's token for token (a prediction changes what is drafted, never what is emitted).
"""
from __future__ import annotations

import time
from pathlib import Path

from tqdm import tqdm

from cluster.bench.measure import drafting_rows
from cluster.bench.report import Row, print_table, write_results
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import check_int
from cluster.family.corpus import heldout_prompts
from cluster.local import build_engine

SNIPPET_TOKENS = 100      # the family is trained on 256-token windows: snippet + its edited copy fit in one
CHANGES = ("rename the first variable to value", "add a type hint to the first argument",
           "fix the spelling in the first comment", "make the first string a raw string")
GREEDY = SamplingParams(0.0)


def edit_cases(tokenizer, n: int, snippet_tokens: int = SNIPPET_TOKENS) -> list[dict]:
    """``n`` cases ``{"prompt", "prediction", "source", "change"}`` from the held-out files.

    The prompt ends with the header line of the edited file (``...after the edit (change):``) and the model
    writes the file from its first line break on; the prediction is that text as the original file has it (the
    line break and the snippet).  The prompt never ends with a line break itself: the family's byte-level BPE
    merges a line break with the next line's indentation (``"\n        "`` is one token), so a prompt cut
    after one ends in a token the model never saw before an indented line and it writes degenerate text
    (``\"\"\"`` then ``#`` lines, measured on every case of the previous workload, which ended each prompt
    with the snippet's first line and its line break)."""
    out = []
    for i, p in enumerate(heldout_prompts(tokenizer, n, prompt_tokens=snippet_tokens, continuation_tokens=8, seed=33)):
        change = CHANGES[i % len(CHANGES)]
        snippet = p["prompt"] if p["prompt"].endswith("\n") else p["prompt"] + "\n"
        prompt = f"# {p['source']}, before the edit:\n{snippet}# {p['source']}, after the edit ({change}):"
        out.append({"prompt": prompt, "prediction": "\n" + snippet, "source": p["source"], "change": change})
    return out


def regenerated(reference: list[int], tokenizer) -> list[int]:
    """The target's earlier answer with a small edit: two tokens a third of the way in replaced by `` value``."""
    m = len(reference) // 3
    return reference[:m] + tokenizer.encode(" value") + reference[m + 2:]


def run(args, cfg) -> int:
    engine = build_engine(cfg)
    n = check_int("prompts", args.prompts, 1, 64)
    cases = edit_cases(engine.tokenizer, n)
    runs = []                                  # (row name, strategy, options, prediction: None, file, regenerate)
    for name, strategy, options in drafting_rows(cfg, engine):
        runs.append((name, strategy, options, None))
        if strategy != "autoregressive":
            runs += [(f"{name} + prediction {kind}", strategy, options, kind) for kind in ("file", "regenerate")]

    def generate(case, strategy, options, prediction, max_new):
        return engine.generate(GenerationRequest(prompt=case["prompt"], max_new_tokens=max_new, sampling=GREEDY,
                                                 seed=0, strategy=strategy, options=options, ignore_eos=True,
                                                 prediction=prediction))

    for _, strategy, options, kind in runs:                 # warm-up (not timed)
        generate(cases[0], strategy, options, kind and cases[0]["prediction"], 8)
    rows = {name: Row(name) for name, *_ in runs}
    counts = {name: {"accepted": 0, "drafted": 0, "equal": 0} for name in rows}
    for case in tqdm(cases, desc="bench edit", unit="case"):
        max_new = len(engine.tokenizer.encode(case["prediction"])) + 8      # the edited snippet and a little more
        reference = None
        for name, strategy, options, kind in runs:
            prediction = None if kind is None else case["prediction"] if kind == "file" else \
                regenerated(reference, engine.tokenizer)
            t0 = time.perf_counter()
            res = generate(case, strategy, options, prediction, max_new)
            rows[name].record(res.stats, time.perf_counter() - t0)
            reference = res.token_ids if reference is None else reference   # the first run is autoregressive
            c = counts[name]
            c["accepted"] += res.stats.prediction_accepted
            c["drafted"] += res.stats.prediction_drafted
            c["equal"] += res.token_ids == reference
    base = rows["autoregressive"]
    table = []
    for name, *_ in runs:
        d = rows[name].as_dict(base)
        plain = rows.get(name.split(" + prediction")[0])
        d["vs_no_prediction"] = round(rows[name].tokens_per_s / plain.tokens_per_s, 3) \
            if " + prediction" in name and plain.tokens_per_s else None
        c = counts[name]
        d.update(accepted_prediction=c["accepted"], rejected_prediction=c["drafted"] - c["accepted"],
                 greedy_equal_ar=f"{c['equal']}/{len(cases)}")
        table.append(d)
    print_table(table, f"edit: {len(cases)} held-out snippets of ~{SNIPPET_TOKENS} tokens re-written with a small "
                       f"change, greedy; prediction file = the original snippet, regenerate = the target's own answer "
                       f"with two tokens changed; config {cfg.source}")
    write_results(table, Path(args.out), "bench_edit")
    print(f"results written to {Path(args.out) / 'bench_edit'}.{{csv,json}}")
    return 0 if all(c["equal"] == len(cases) for c in counts.values()) else 1
