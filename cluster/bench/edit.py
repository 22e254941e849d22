"""Edit workload: predicted outputs (OpenAI's ``prediction``) on held-out functions with a small change asked for.

Each case is a chat request as a client sends one (:func:`cluster.family.edits.heldout_edits`): a function of a
held-out standard-library file (never trained on) after a sentence asking for one small change (rename a
variable or the function, change a number, add a docstring or an argument), rendered with the family's chat
template; the model answers with the function changed.  Two predictions, as a client would send them:

* ``file``: the original function (OpenAI's predicted-outputs case: "regenerating a file with a small change").
  It helps as far as the target's answer copies the function it is shown;
* ``regenerate``: the target's own earlier answer to the same request with a small edit (two tokens replaced a
  third of the way in): the case where the output follows the prediction except around a change, e.g. a client
  asking again for an answer it has, with one thing changed.

Rows: autoregressive, and each drafting strategy (speculative with the config's drafter, mag, cs_drafting) without
a prediction and with each; all greedy on the same cases, interleaved case by case in one process after a warm-up,
so the ratios are comparable on a noisy machine.  Columns: tok/s, its ratio to autoregressive and to the same
strategy without a prediction, target calls per token, the prediction's accepted / rejected draft tokens (OpenAI's
``accepted_prediction_tokens`` / ``rejected_prediction_tokens``) and how many outputs equal autoregressive
decoding's token for token (a prediction changes what is drafted, never what is emitted); the title says how
many autoregressive answers are the requested change exactly.
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
from cluster.family.corpus import stdlib_files
from cluster.family.edits import heldout_edits
from cluster.family.instruct import chat_prompt
from cluster.local import build_engine

GREEDY = SamplingParams(0.0)
SPARE_TOKENS = 16          # generated beyond the changed function's length, if the model does not stop


def edit_cases(n: int) -> list[dict]:
    """``n`` cases ``{"prompt", "prediction", "answer", "source", "change"}``: the chat prompt (one user message,
    the assistant's turn opened), the original function (the prediction a client sends), the function with the
    change made (what a model that edits writes)."""
    return [{"prompt": chat_prompt(e.request), "prediction": e.original, "answer": e.answer, "source": e.source,
             "change": e.change} for e in heldout_edits(stdlib_files(), n)]


def regenerated(reference: list[int], tokenizer) -> list[int]:
    """The target's earlier answer with a small edit: two tokens a third of the way in replaced by `` value``."""
    m = len(reference) // 3
    return reference[:m] + tokenizer.encode(" value") + reference[m + 2:]


def run(args, cfg) -> int:
    engine = build_engine(cfg)
    n = check_int("prompts", args.prompts, 1, 64)
    cases = edit_cases(n)
    runs = []                                  # (row name, strategy, options, prediction: None, file, regenerate)
    for name, strategy, options in drafting_rows(cfg, engine):
        runs.append((name, strategy, options, None))
        if strategy != "autoregressive":
            runs += [(f"{name} + prediction {kind}", strategy, options, kind) for kind in ("file", "regenerate")]

    def generate(case, strategy, options, prediction, max_new):
        return engine.generate(GenerationRequest(prompt=case["prompt"], max_new_tokens=max_new, sampling=GREEDY,
                                                 seed=0, strategy=strategy, options=options, prediction=prediction))

    for _, strategy, options, kind in runs:                 # warm-up (not timed)
        generate(cases[0], strategy, options, kind and cases[0]["prediction"], 8)
    rows = {name: Row(name) for name, *_ in runs}
    counts = {name: {"accepted": 0, "drafted": 0, "equal": 0} for name in rows}
    edited = 0                                             # autoregressive answers that are the change exactly
    for case in tqdm(cases, desc="bench edit", unit="case"):
        max_new = len(engine.tokenizer.encode(case["answer"])) + SPARE_TOKENS
        reference = None
        for name, strategy, options, kind in runs:
            prediction = None if kind is None else case["prediction"] if kind == "file" else \
                regenerated(reference, engine.tokenizer)
            t0 = time.perf_counter()
            res = generate(case, strategy, options, prediction, max_new)
            rows[name].record(res.stats, time.perf_counter() - t0)
            if reference is None:                                           # the first run is autoregressive
                reference = res.token_ids
                edited += engine.tokenizer.decode(res.token_ids).strip() == case["answer"].strip()
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
    print_table(table, f"edit: {len(cases)} held-out functions with a small change asked for (chat), greedy; "
                       f"{edited}/{len(cases)} autoregressive answers are the change exactly; prediction file = the "
                       f"original function, regenerate = the target's own answer with two tokens changed; "
                       f"config {cfg.source}")
    write_results(table, Path(args.out), "bench_edit")
    print(f"results written to {Path(args.out) / 'bench_edit'}.{{csv,json}}")
    return 0 if all(c["equal"] == len(cases) for c in counts.values()) else 1
