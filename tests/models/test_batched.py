"""BatchedHFWorker against the single-request HFWorker: one slot cache, ragged rows, same logits and RNG streams."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cluster.core.sampling import SamplingParams, logits_to_probs
from cluster.core.verify_round import stack_rows
from cluster.models.batched import BatchedHFWorker
from cluster.models.head import AcceptanceHead
from cluster.models.tiny import tiny_llama, truncated
from tests.support.reference_worker import HFWorker

torch.set_num_threads(1)
TOL = 1e-4
SAMPLED, GREEDY = SamplingParams(1.0), SamplingParams(0.0)


def kv_tokens(bw) -> int:
    """Tokens the worker's KV cache holds over all its requests (what rollback and release must free)."""
    return sum(r.cached for r in bw._requests.values())


def gqa_llama(seed: int = 0) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.2, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def make(kind: str):
    model = gqa_llama() if kind == "gqa" else tiny_llama(hidden=64, layers=4, heads=4, seed=0, max_position=1024)
    if kind == "eager":
        model.set_attn_implementation("eager")
    return BatchedHFWorker(model, "m"), HFWorker(model, "m")


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 257, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert a.numel() == 0 or (a - b).abs().max().item() < TOL


@pytest.mark.parametrize("kind", ["mha", "gqa", "eager"])
def test_ragged_score_matches_single_requests(kind):
    bw, hw = make(kind)
    lens = {"a": 3, "b": 17, "c": 40}
    bw.prefill_batch([(rid, prompt(n, i), SAMPLED, i) for i, (rid, n) in enumerate(lens.items())])
    for i, (rid, n) in enumerate(lens.items()):
        hw.prefill(rid, prompt(n, i), SAMPLED, i)
    assert kv_tokens(bw) == sum(n - 1 for n in lens.values())

    def check(items):
        got = bw.score_batch(items)
        for (rid, draft), lg in zip(items, got):
            assert lg.shape == (len(draft) + 1, 257)
            close(lg, hw.score(rid, draft))
            assert bw.length(rid) == hw.length(rid)

    check([("a", [5, 6]), ("b", []), ("c", [7, 8, 9, 10, 11])])
    for w in (bw, hw):
        w.rollback("b", 9)
        w.extend("c", [12, 13])                          # several pending tokens in the next forward
    check([("a", [1]), ("b", [2, 3, 4]), ("c", [])])
    for w in (bw, hw):                                  # slot reuse: a new request takes a's slot
        w.release("a")
        w.prefill("d", prompt(25, 9), SAMPLED, 9)
    assert sorted(bw.active_requests()) == ["b", "c", "d"]
    check([("c", [3, 3]), ("d", [4]), ("b", [])])       # rows not in slot order
    check([("d", [1, 2, 3])])                            # a single slot
    check([("c", [5]), ("d", [])])                       # slots 2 and 0: not one contiguous range
    for w in (bw, hw):
        w.extend("b", prompt(90, 4))                     # grows the capacity past 64 (copying the cache)
    check([("b", [6, 7]), ("c", [8])])


@pytest.mark.parametrize("params", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
def test_propose_batch_matches_single_requests(params):
    bw, hw = make("mha")
    ks = {"a": 0, "b": 2, "c": 5}
    for w in (bw, hw):
        for i, rid in enumerate(ks):
            w.prefill(rid, prompt(4 + 7 * i, i), params, 100 + i)
        w.extend("c", [1, 2, 3])                         # ragged first forward
    got = bw.propose_batch(list(ks.items()))
    for (rid, k), (toks, lg) in zip(ks.items(), got):
        ref_toks, ref_lg = hw.propose(rid, k)
        assert toks == ref_toks and len(toks) == k
        assert lg.shape == (k, 257)
        close(lg, ref_lg)
    assert bw.propose_batch([]) == []


def test_propose_batch_rows_only_where_asked():
    """``rows`` False: the same tokens, no logits; the rows a mixed batch keeps are the ones a batch of kept rows
    returns (each row gathered from its own steps, not its neighbour's)."""
    outs = []
    for keep in ((True, True, True), (False, True, False)):
        bw, _ = make("mha")
        for i, rid in enumerate("abc"):
            bw.prefill(rid, prompt(4 + 7 * i, i), SAMPLED, 100 + i)
        outs.append(bw.propose_batch([(rid, k, kp) for rid, k, kp in zip("abc", (3, 5, 2), keep)]))
    (full, part) = outs
    assert [t for t, _ in full] == [t for t, _ in part]
    assert part[0][1] is None and part[2][1] is None
    assert torch.equal(part[1][1], full[1][1]) and part[1][1].shape == (5, 257)


def test_propose_batch_hands_on_the_laws_it_drew_from():
    """``law`` rows are the probabilities each token was drawn from (the row's logits under its sampling), with
    the same tokens; where every row ran every step they are rows of one batch, which the verifier's stack takes
    as it is (no copy)."""
    outs = []
    for law in (False, True):
        bw, _ = make("mha")
        for i, rid in enumerate("abc"):
            bw.prefill(rid, prompt(4 + 7 * i, i), SAMPLED, 100 + i)
        outs.append(bw.propose_batch([(rid, 3, True, law) for rid in "abc"]))
    (logits, laws) = outs
    assert [t for t, _ in logits] == [t for t, _ in laws]
    for (_, lg), (toks, q) in zip(logits, laws):
        close(q, logits_to_probs(lg, SAMPLED).float())
        assert bool((q.gather(1, torch.tensor(toks)[:, None]) > 0).all())
    stacked = stack_rows([q for _, q in laws])
    assert stacked.data_ptr() == laws[0][1].data_ptr() and stacked.shape == (3, 3, 257)


def test_propose_adaptive_batch_matches_single_requests():
    bw, hw = make("mha")
    torch.manual_seed(3)
    head = AcceptanceHead(64)
    items = [("a", 1, head, 0.5), ("b", 8, head, 0.3), ("c", 8, head, 0.9), ("d", 6, head, 0.99), ("e", 0, head, .5)]
    for w in (bw, hw):
        for i, (rid, *_) in enumerate(items):
            w.prefill(rid, prompt(5 + 3 * i, i), SAMPLED, 7 + i)
    got = bw.propose_adaptive_batch(items)
    for (rid, k, _, thr), (toks, lg) in zip(items, got):
        ref_toks, ref_lg = hw.propose_adaptive(rid, k, head, thr)
        assert toks == ref_toks and len(toks) <= k
        close(lg, ref_lg)
    assert len({len(t) for t, _ in got}) > 1             # rows stopped at different steps


def test_interleaved_speculative_rounds_match_running_alone():
    target = tiny_llama(seed=0)
    drafter = truncated(target, 3)
    prompts = {"a": prompt(6, 1), "b": prompt(19, 2), "c": prompt(33, 3)}
    ks = {"a": 2, "b": 3, "c": 4}

    def accept(rid, draft, lg, dw, tw):                  # greedy verification: longest argmax prefix + bonus
        best = lg.argmax(-1).tolist()
        n = 0
        while n < len(draft) and draft[n] == best[n]:
            n += 1
        keep = tw.length(rid) - len(draft) + n
        for w in (dw, tw):
            w.rollback(rid, keep)
            w.extend(rid, [best[n]])

    bd, bt = BatchedHFWorker(drafter, "d"), BatchedHFWorker(target, "t")
    modes = {"a": GREEDY, "b": SAMPLED, "c": GREEDY}     # greedy drafting gets some drafts accepted
    bd.prefill_batch([(rid, p, modes[rid], i) for i, (rid, p) in enumerate(prompts.items())])
    bt.prefill_batch([(rid, p, GREEDY, i) for i, (rid, p) in enumerate(prompts.items())])
    for _ in range(6):
        drafts = bd.propose_batch(list(ks.items()))
        scores = bt.score_batch([(rid, t) for rid, (t, _) in zip(ks, drafts)])
        for rid, (toks, _), lg in zip(ks, drafts, scores):
            accept(rid, toks, lg, bd, bt)
    grown = 0
    for i, (rid, p) in enumerate(prompts.items()):
        hd, ht = HFWorker(drafter, "d"), HFWorker(target, "t")
        hd.prefill(rid, p, modes[rid], i)
        ht.prefill(rid, p, GREEDY, i)
        for _ in range(6):
            toks, _ = hd.propose(rid, ks[rid])
            accept(rid, toks, ht.score(rid, toks), hd, ht)
        assert bt._get(rid).tokens == ht._get(rid).tokens
        assert bd._get(rid).tokens == hd._get(rid).tokens
        grown += len(ht._get(rid).tokens) - len(p) - 6
    assert grown > 0                                     # some drafts were accepted
