"""The family's generation checks, run by the build on held-out files: does the target answer a chat
request with code, and how far would each drafter carry greedy speculative decoding.

* **chat**: held-out requests (docstrings of held-out functions, :func:`cluster.family.instruct.heldout_pairs`)
  rendered as served chat prompts and answered greedily by the target until ``<|endoftext|>`` or a token cap;
  an answer *parses* when ``ast.parse`` accepts it.
* **edit**: held-out edit requests (a held-out function and a small change,
  :func:`cluster.family.edits.heldout_edits`) answered greedily: how many answers are the changed function
  exactly, and how much of it they hold (``difflib`` ratio of the token sequences, mean over requests): a
  predicted output of the original function is accepted about as far as the answer follows it.
* **speculative**: greedy speculative decoding with a fixed draft length ``k`` (Leviathan et al., *Fast
  Inference from Transformers via Speculative Decoding*, Algorithm 1 at temperature 0) accepts a drafter's
  token exactly when it equals the target's greedy token, and as long as drafts are accepted the drafter
  sees the target's own tokens.  So teacher-forcing the drafter on the target's greedy output gives the exact
  run of accepted drafts at every step without running the loop: each step (one target call) emits the
  accepted run (at most ``k``) plus the target's own next token.  Reported as target calls per emitted token
  and the share of drafted tokens accepted, on the chat answers and on held-out completions.
"""
from __future__ import annotations

import ast
import difflib

import torch

import cluster.family.corpus as corpus
from cluster.family.edits import heldout_edits
from cluster.family.instruct import chat_prompt, heldout_pairs

SPEC_K = 4
EXAMPLES = 4            # answers kept in the manifest


def parses(code: str) -> bool:
    """Whether ``code`` is Python that ``ast.parse`` accepts, with at least one statement."""
    try:
        return bool(ast.parse(code).body)
    except (SyntaxError, ValueError):
        return False


@torch.no_grad()
def greedy(model, prompt_ids: list[int], max_new: int, eot_id: int) -> list[int]:
    """The model's greedy continuation of ``prompt_ids`` (KV cache), without the final EOT if it stopped."""
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    ids = []
    for _ in range(max_new):
        nxt = int(out.logits[0, -1].argmax())
        if nxt == eot_id:
            break
        ids.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
    return ids


@torch.no_grad()
def speculative_run(drafter, prompt_ids: list[int], answer_ids: list[int], k: int = SPEC_K) -> tuple[int, int]:
    """(target calls, accepted drafts) of greedy speculative decoding with draft length ``k`` that emits the
    target's greedy ``answer_ids`` after ``prompt_ids`` (see the module docstring)."""
    if not answer_ids:
        return 0, 0
    seq = torch.tensor([prompt_ids + answer_ids])
    pred = drafter(input_ids=seq[:, :-1]).logits[0, len(prompt_ids) - 1:].argmax(-1)
    match = (pred == seq[0, len(prompt_ids):]).tolist()
    calls = accepted = pos = 0
    while pos < len(match):
        run = 0
        while run < k and pos + run < len(match) and match[pos + run]:
            run += 1
        calls += 1
        accepted += run
        pos += run + 1
    return calls, accepted


def _spec_table(drafters: dict, runs: list[tuple[list[int], list[int]]], k: int) -> dict:
    tokens = sum(len(a) for _, a in runs)
    out = {}
    for name, d in drafters.items():
        calls = accepted = 0
        for p, a in runs:
            c, acc = speculative_run(d, p, a, k)
            calls += c
            accepted += acc
        out[name] = {"target_calls_per_token": round(calls / max(1, tokens), 4),
                     "acceptance": round(accepted / max(1, k * calls), 4)}
    return out


def _edit_eval(target, tokenizer, files, cfg, eot_id: int, enc) -> dict:
    cases = heldout_edits(files, cfg.edit_eval_requests)
    exact, ratio, examples = 0, 0.0, []
    for e in cases:
        want = enc(e.answer)
        ids = greedy(target, enc(chat_prompt(e.request)), len(want) + 16, eot_id)
        exact += ids == want
        ratio += difflib.SequenceMatcher(None, ids, want, autojunk=False).ratio()
        if len(examples) < 2:
            examples.append({"request": e.request, "answer": tokenizer.decode(ids), "source": e.source})
    return {"requests": len(cases), "exact": exact, "token_ratio": round(ratio / max(1, len(cases)), 4),
            "definition": "held-out functions with a mechanical change asked for (cluster.family.edits), greedy "
                          "target answers: equal to the changed function, and difflib ratio of the token sequences",
            "examples": examples}


def evaluate_generation(models: dict, tokenizer, files, cfg, eot_id: int, seed: int = 0) -> dict:
    """The build's generation metrics (module docstring) for ``models`` (``target`` and drafters) on the
    held-out files among ``files``: ``{"chat": ..., "speculative": ...}``, ready for the manifest."""
    target = models["target"]
    drafters = {n: m for n, m in models.items() if n != "target"}
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]            # noqa: E731
    pairs = heldout_pairs(files, cfg.chat_eval_requests, seed)
    chat_runs, examples, n_parse, n_stop = [], [], 0, 0
    for p in pairs:
        prompt = enc(chat_prompt(p.request))
        ids = greedy(target, prompt, cfg.chat_eval_tokens, eot_id)
        answer = tokenizer.decode(ids)
        ok = parses(answer)
        n_parse += ok
        n_stop += len(ids) < cfg.chat_eval_tokens
        chat_runs.append((prompt, ids))
        if len(examples) < EXAMPLES:
            examples.append({"request": p.request, "answer": answer, "parses": ok, "source": p.source})
    completions = corpus.heldout_prompts(tokenizer, cfg.chat_eval_requests, prompt_tokens=64, continuation_tokens=64,
                                         seed=seed)
    comp_runs = [(c["prompt_ids"], greedy(target, c["prompt_ids"], 64, eot_id)) for c in completions]
    edit = _edit_eval(target, tokenizer, files, cfg, eot_id, enc) if cfg.edit_rows else None
    return {
        **({"edit": edit} if edit is not None else {}),
        "chat": {"requests": len(pairs), "parsed": n_parse, "parse_rate": round(n_parse / max(1, len(pairs)), 4),
                 "stopped": n_stop, "max_new_tokens": cfg.chat_eval_tokens,
                 "definition": "held-out functions' docstrings as one-user-message chat prompts, greedy target "
                               "answers (until <|endoftext|> or the cap) that ast.parse accepts",
                 "examples": examples},
        "speculative": {"k": SPEC_K, "chat": _spec_table(drafters, chat_runs, SPEC_K),
                        "completion": _spec_table(drafters, comp_runs, SPEC_K),
                        "definition": f"greedy speculative decoding, fixed k = {SPEC_K}, exact from teacher-forced "
                                      "drafters on the target's greedy output: chat answers above; 64-token greedy "
                                      "continuations of held-out completion prompts"},
    }
