"""Automatic prefix caching (cluster/models/prefix_cache.py): the index's keys, salts and eviction order, and a
worker that reuses a released or a running request's blocks computing the same logits as one that does not."""
from __future__ import annotations

import pytest
import torch

from cluster.core.sampling import SamplingParams
from cluster.models.batched import BatchedHFWorker
from cluster.models.prefix_cache import BLOCK, PrefixIndex, chain
from cluster.models.tiny import tiny_llama

torch.set_num_threads(1)
GREEDY = SamplingParams(0.0)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def pair() -> tuple[BatchedHFWorker, BatchedHFWorker]:
    model = tiny_llama(hidden=64, layers=3, heads=4, seed=0, max_position=1024)
    cached, plain = BatchedHFWorker(model, "m"), BatchedHFWorker(model, "m")
    plain.prefix_caching = False
    return cached, plain


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and (a - b).abs().max().item() < 1e-4


# -- the index ---------------------------------------------------------------------------------------

def test_keys_chain_blocks_and_salts():
    a, b = ids(3 * BLOCK + 5, 0), ids(3 * BLOCK + 5, 1)
    assert len(chain(a)) == 3 and chain(a, n=2 * BLOCK + 3) == chain(a)[:2]
    assert chain(a)[0] != chain(b)[0]
    c = a[:BLOCK] + b[BLOCK:]                              # same first block: same first key, then apart
    assert chain(c)[0] == chain(a)[0] and chain(c)[1] != chain(a)[1]
    assert chain(a, "tenant-1") != chain(a) and chain(a, "tenant-1") == chain(a, "tenant-1")


def test_lookup_stops_at_the_first_missing_block_and_salts_isolate():
    index, a = PrefixIndex(), ids(4 * BLOCK, 2)
    index.register(7, a, None, 3 * BLOCK + 2)              # three full blocks and two tokens held by slot 7
    assert index.lookup(a, None, len(a)) == (7, 3 * BLOCK + 2)        # found by blocks, continued by tokens
    assert index.lookup(a, None, 2 * BLOCK + 1) == (7, 2 * BLOCK + 1)     # never past the limit
    assert index.lookup(a, "other", len(a)) == (None, 0)
    other = a[:BLOCK] + ids(3 * BLOCK, 3)
    assert other[BLOCK] != a[BLOCK] and index.lookup(other, None, len(other)) == (7, BLOCK)
    partial = a[:BLOCK + 5] + [a[BLOCK + 5] + 1] + a[BLOCK + 6:]       # the same up to 5 tokens into block 2
    assert index.lookup(partial, None, len(partial)) == (7, BLOCK + 5)
    index.forget(7)
    assert index.lookup(a, None, len(a)) == (None, 0)
    assert index.queries == len(a) + 2 * BLOCK + 1 + len(a) + len(other) + len(partial) + len(a)
    assert index.hits == 3 * BLOCK + 2 + 2 * BLOCK + 1 + BLOCK + BLOCK + 5


def test_reusing_one_holder_of_a_shared_prefix_leaves_the_others():
    """Two conversations share a system prompt: taking one's slot keeps the other's whole history findable."""
    index, system = PrefixIndex(), ids(2 * BLOCK, 20)
    a, b = system + ids(BLOCK, 21), system + ids(BLOCK, 22)
    index.register(1, a, None, len(a))
    index.register(2, b, None, len(b))
    index.forget(2)                                          # b's slot is reused
    assert index.lookup(a, None, len(a)) == (1, 3 * BLOCK)
    assert index.lookup(b, None, len(b)) == (1, 2 * BLOCK)  # the shared blocks, from a's slot
    index.register(2, b, None, len(b))
    index.forget(1)
    assert index.lookup(b, None, len(b)) == (2, 3 * BLOCK)


def test_free_slots_are_evicted_least_recently_released_first():
    index = PrefixIndex()
    for slot in (3, 1, 2):
        index.register(slot, ids(BLOCK, slot), None, BLOCK)
        index.release(slot)
    assert index.take(2) == 2                                # a hit takes its own slot
    assert index.take() == 3                                 # else the one released longest ago ...
    assert index.lookup(ids(BLOCK, 3), None, BLOCK) == (None, 0)   # ... whose blocks are forgotten
    assert index.lookup(ids(BLOCK, 1), None, BLOCK) == (1, BLOCK)
    assert index.take() == 1 and index.take() is None


# -- the worker ------------------------------------------------------------------------------------

def test_a_later_turn_reuses_the_released_slot_and_computes_the_same_logits():
    cached, plain = pair()
    system, turn = ids(2 * BLOCK + 3, 4), ids(BLOCK, 5)
    for w in (cached, plain):
        assert w.prefill_batch([("t1", system + turn, GREEDY, 0)]) == [0]       # an empty cache: no hit
    out1 = [cached.score("t1", ids(BLOCK, 6)), plain.score("t1", ids(BLOCK, 6))]
    same(*out1)
    history = cached._get("t1").tokens
    slot = cached._get("t1").slot
    for w in (cached, plain):
        w.release("t1")
    nxt = history + ids(9, 7)
    hits = cached.prefill_batch([("t2", nxt, GREEDY, 0)])
    assert len(history) % BLOCK and hits == [len(history)]    # every token it fed, not only its full blocks
    assert cached._get("t2").slot == slot                   # the released slot itself: no copy
    plain.prefill_batch([("t2", nxt, GREEDY, 0)])
    draft = ids(4, 8)
    same(cached.score("t2", draft), plain.score("t2", draft))


def test_a_running_requests_prompt_is_copied_and_salts_keep_tenants_apart():
    cached, plain = pair()
    system = ids(3 * BLOCK, 9)
    for w in (cached, plain):           # a released slot of other tokens: b reuses it, no buffer grows
        w.prefill_batch([("a", system + ids(5, 10), GREEDY, 0), ("pad", ids(5, 16), GREEDY, 0)])
        w.release("pad")
    b = system + ids(7, 11)
    assert cached.prefill_batch([("b", b, GREEDY, 0), ("c", b, GREEDY, 0, "tenant")]) == [3 * BLOCK, 0]
    assert cached._get("b").slot != cached._get("a").slot
    plain.prefill_batch([("b", b, GREEDY, 0), ("c", b, GREEDY, 0, "tenant")])
    for rid in ("a", "b", "c"):
        same(cached.score(rid, [1, 2]), plain.score(rid, [1, 2]))


def test_a_rollback_below_the_shared_prompt_forgets_its_blocks():
    cached, _ = pair()
    a = ids(2 * BLOCK + 1, 12)
    cached.prefill_batch([("a", a, GREEDY, 0)])
    cached.rollback("a", BLOCK)                             # its second block will be written again
    cached.extend("a", ids(BLOCK + 1, 13))
    assert cached.prefill_batch([("b", a, GREEDY, 0)]) == [0]


@pytest.mark.parametrize("caching", [True, False])
def test_caching_off_finds_nothing_and_reuses_the_lowest_slot(caching):
    cached, _ = pair()
    cached.prefix_caching = caching
    a = ids(2 * BLOCK + 1, 14)
    cached.prefill_batch([("x", ids(3, 15), GREEDY, 0), ("a", a, GREEDY, 0)])
    cached.release("a")
    cached.release("x")
    assert cached.prefill_batch([("b", a, GREEDY, 0)]) == ([2 * BLOCK] if caching else [0])
    assert cached._get("b").slot == (1 if caching else 0)
