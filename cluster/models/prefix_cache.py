"""Automatic prefix caching for one worker's slot cache: which slot already holds a prompt's leading KV.

A worker keeps every request's keys and values in a slot of its :class:`cluster.models.slot_cache.SlotCache`, and a
released slot's states stay valid until the slot is written again.  This index remembers, for token blocks of
``BLOCK`` tokens, which slot holds them, keyed by chained hashes (block i's key covers blocks 0..i and the request's
``cache_salt``, as vLLM's automatic prefix caching keys its blocks), so a new request whose prompt starts with a
known chain is prefilled from there on, and further: the chain finds a slot, and the slot's own token ids take the
match on token by token (a slot holds a request's states at every position it fed, not only whole blocks):

* from a **released** slot the request takes the slot itself (no copy);
* from a **running** request's slot (its prompt blocks) the prefix is copied into the new slot on the device.

Eviction is least-recently-released: a worker reuses the free slot released longest ago, and its blocks leave
the index then.  Released slots are part of the cache's buffer already, so the cache never takes KV memory beyond
the running requests' own (the engine's KV budget counts those).  A chain is a pure function of the token ids and
the salt (no process-seeded hash), so every tensor-parallel rank, given the same calls, decides the same.

A hit changes no logits' law: the cached keys and values are the states of the same tokens at the same positions
(Hugging Face causal attention makes a position's states a function of the tokens up to it).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

BLOCK = 16          # tokens per cached block (vLLM's default block size)


def _salt_key(salt: str | None) -> int:
    if not salt:
        return 0
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")


def chain(ids: list[int], salt: str | None = None, n: int | None = None) -> list[int]:
    """The chained keys of the full blocks among ``ids[:n]``: key i covers blocks 0..i and the salt."""
    n = len(ids) if n is None else min(n, len(ids))
    key, out = _salt_key(salt), []
    for i in range(n // BLOCK):
        key = hash((key, tuple(ids[i * BLOCK:(i + 1) * BLOCK])))      # int tuples: the same in every process
        out.append(key)
    return out


MIN_SHARED = 64     # prompt tokens a batch must save before :func:`shared_in_batch` spends a second forward on it


def shared_in_batch(prompts: list[tuple[list[int], str | None, int]]) -> dict[int, tuple[int, int]]:
    """Prompts of one prefill batch that share leading blocks with an earlier one of the batch: (ids, salt,
    tokens already cached) each -> {j: (i, n)}: prompt j takes its first n tokens from prompt i once i is
    prefilled (a second forward for the followers), where that beats what j found cached.  The index cannot find
    them (nothing of the batch is computed yet), so without this every conversation of a batch that opens with one
    system prompt computes it.  Only prompts that take none are leaders; nothing is shared below
    :data:`MIN_SHARED` tokens saved in all (a forward's fixed cost).  Pure: every rank decides the same."""
    chains = [chain(ids, salt, len(ids) - 1) for ids, salt, _ in prompts]
    out: dict[int, tuple[int, int]] = {}
    for j, (ids, salt, cached) in enumerate(prompts):
        best, at = cached, None
        for i in range(j):
            if i in out or prompts[i][1] != salt:
                continue
            m = 0
            for a, b in zip(chains[i], chains[j]):
                if a != b:
                    break
                m += 1
            if m * BLOCK > best:
                best, at = m * BLOCK, i
        if at is not None:
            out[j] = (at, best)
    saved = sum(n - prompts[j][2] for j, (_, n) in out.items())
    return out if saved >= MIN_SHARED else {}


class PrefixIndex:
    """Block key -> the slots holding that block (and every block before it), plus the free slots' LRU order.
    A block many prompts share (a system prompt) is held by many slots; reusing one of them leaves the others."""

    def __init__(self):
        self._slot_of: dict[int, dict[int, None]] = {}  # block key -> the slots holding it, latest last
        self._keys_of: dict[int, list[int]] = {}       # slot -> the keys it registered
        self._ids_of: dict[int, list[int]] = {}        # slot -> the token ids it registered (its valid states)
        self.free: OrderedDict[int, None] = OrderedDict()   # released slots, the longest released first
        self.queries = self.hits = 0                   # prompt tokens looked up / found (vLLM's metric names)

    def size(self) -> dict:
        """Prompt tokens findable now (distinct blocks held, x BLOCK: what a lookup finds before it continues
        token by token) and the released slots kept."""
        return {"tokens": BLOCK * len(self._slot_of), "slots": len(self.free)}

    def lookup(self, ids: list[int], salt: str | None, limit: int) -> tuple[int | None, int]:
        """(slot, tokens) of the longest cached chain among ``ids[:limit]`` (None, 0 without one), continued token
        by token as far as the slot holds the same ids: a slot is one request's states at every position it
        fed, so past its last shared block it still holds the tokens the two have in common (a conversation's
        next turn resends the last answer, which ends anywhere in a block)."""
        slot, found = None, 0
        for i, key in enumerate(chain(ids, salt, limit)):
            holders = self._slot_of.get(key)
            if not holders:
                break
            slot, found = next(reversed(holders)), (i + 1) * BLOCK
        if slot is not None:
            held, end = self._ids_of[slot], min(limit, len(self._ids_of[slot]))
            while found < end and held[found] == ids[found]:
                found += 1
        self.queries += max(limit, 0)
        self.hits += found
        return slot, found

    def register(self, slot: int, ids: list[int], salt: str | None, n: int) -> None:
        """``slot`` holds valid states for ``ids[:n]``: its full blocks become findable there."""
        self.forget(slot)
        keys = chain(ids, salt, n)
        self._keys_of[slot], self._ids_of[slot] = keys, list(ids[:n])
        for key in keys:
            self._slot_of.setdefault(key, {})[slot] = None

    def forget(self, slot: int) -> None:
        """``slot`` is about to be written from position 0 again (or below what it registered)."""
        self._ids_of.pop(slot, None)
        for key in self._keys_of.pop(slot, ()):
            holders = self._slot_of.get(key)
            if holders is not None:
                holders.pop(slot, None)
                if not holders:
                    del self._slot_of[key]

    def release(self, slot: int) -> None:
        self.free[slot] = None
        self.free.move_to_end(slot)

    def take(self, slot: int | None = None) -> int | None:
        """A free slot for a new request: ``slot`` itself when free (a hit on a released slot), else the one
        released longest ago, its blocks forgotten; None when no slot is free."""
        if slot is not None and slot in self.free:
            del self.free[slot]
            return slot
        if not self.free:
            return None
        old, _ = self.free.popitem(last=False)
        self.forget(old)
        return old
