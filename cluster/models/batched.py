"""Batched in-process model worker: a Hugging Face causal LM whose requests share one slot KV cache.

A drop-in replacement for the single-request reference worker (``tests/support/reference_worker.py``) (same per-request semantics, same RNG streams)
whose ``*_batch`` methods advance many requests in one forward pass.  Every request owns a slot of one
:class:`cluster.models.slot_cache.SlotCache` and keeps ``tokens`` and ``cached`` (how many of them the slot
holds); a forward feeds each row's ``tokens[cached:]``, right-padded to the longest row:

  input_ids     [B, n]        pending tokens, padding id 0 after a row's own ``n_b``
  position_ids  [B, n]        cached_b + j
  attention     [B, 1, n, T]  key t visible to query j of row b iff t <= cached_b + j (T = max cached_b + n),
                              and on sliding-window layers also t > cached_b + j - W: one additive mask per
                              layer type (:mod:`cluster.models.support`), which masking_utils returns as-is;
                              the slot cache writes row b's new keys at cached_b + j, so padding only writes
                              beyond the row's length.
  logits        [B, n, V]     only each row's first ``n_b`` rows are kept; hidden states [B, n, H] likewise.

Rollback, extend and release are bookkeeping only (stale cache positions are masked and later overwritten).
Chosen over transformers' paged continuous-batching cache because that one is driven by its own scheduler and
generation loop; a slot cache keeps HFWorker's per-call contract (score/propose/rollback per request id).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from cluster.core.constraint import mask_logits
from cluster.core.draft.stop import DraftStop
from cluster.core.interfaces import BatchedHandle, UnknownRequestError
from cluster.core.draws import DRAFT, CounterDraws
from cluster.core.rejection import RowSampling, pick_rows, sample_batch
from cluster.core.sampling import Rng, SamplingParams, derive_seed
from cluster.core.verify_round import review_round, verify_round
from cluster.models.head import resolve_head
from cluster.models.memory import memory_report
from cluster.models.prefix_cache import PrefixIndex, shared_in_batch
from cluster.models.slot_cache import SlotCache
from cluster.models.support import attention_layout, build_masks, check_tensor_parallel, position_limit, read_config


@dataclass
class _Request:
    tokens: list[int]
    slot: int
    cached: int
    sampling: SamplingParams
    rng: Rng
    salt: str | None = None      # the request's cache_salt (its prefix-cache blocks are keyed by it)
    shared: int = 0              # tokens of its prompt the prefix cache finds in its slot


class BatchedHFWorker(BatchedHandle):
    """Hosts one causal LM for many requests; see :class:`cluster.core.interfaces.BatchedHandle`."""

    proposes = adaptive = True          # a neural drafter: samples its proposals (``deterministic`` stays False)
    laws = True                         # and hands on the laws it drew them from (cluster.core.calls.ProposeItem)

    def __init__(self, model: torch.nn.Module, name: str, *, max_length: int | None = None):
        self.model = model.eval()
        self.name = name
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.layout = attention_layout(cfg, type(model))     # ConfigError for what cannot be served exactly
        self.max_length = int(max_length or position_limit(cfg))
        self.num_params = sum(p.numel() for p in model.parameters())
        self.memory = memory_report(model)            # for the engine's default KV budget
        self.device = next(model.parameters()).device
        self._cache = SlotCache(self.layout.layer_types, self.max_length)
        self._requests: dict[str, _Request] = {}
        self._next_slot = 0
        self.prefix_caching = True                    # engine.prefix_caching (cluster/models/prefix_cache.py)
        self.prefix = PrefixIndex()
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, path: str | Path, name: str, *, dtype: str = "float32",
                        device: str = "cpu", **kwargs) -> "BatchedHFWorker":
        """Load a local HF checkpoint directory (safetensors + config); never reaches a hub.  Refused with a
        :class:`ConfigError` before any weight is read when the worker cannot serve it exactly."""
        config = read_config(path)
        attention_layout(config)
        if kwargs.get("distributed_config") is not None:
            check_tensor_parallel(config, kwargs["distributed_config"].tp_size)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype),
                                                     local_files_only=True, **kwargs)
        if "tp_plan" not in kwargs:
            model = model.to(device)
        return cls(model, name)

    # -- request lifecycle -------------------------------------------------------------------
    def prefill(self, rid: str, ids: list[int], sampling: SamplingParams, seed: int) -> None:
        self.prefill_batch([(rid, ids, sampling, seed)])

    def prefill_batch(self, items: list[tuple]) -> list[int]:
        """Start each request (rid, ids, sampling, seed[, cache salt]); one forward over all prompts but their
        last token (which stays pending), from where each prompt's cached prefix ends -> the cached tokens of
        each (:mod:`cluster.models.prefix_cache`)."""
        if any(not it[1] for it in items):
            raise ValueError("prefill needs at least one token")
        reqs, copies, hits = [], [], []
        with self._lock:
            for rid, ids, sampling, seed, *salt in items:
                self._drop(rid)
                salt = salt[0] if salt else None
                donor, hit = self.prefix.lookup(ids, salt, len(ids) - 1) if self.prefix_caching else (None, 0)
                slot = self._slot(donor)
                if hit and slot != donor:                       # a running request's prompt blocks: copy them
                    copies.append((donor, slot, hit))
                req = _Request(list(ids), slot, hit, sampling, Rng(derive_seed(seed, self.name)), salt)
                self._requests[rid] = req
                reqs.append(req)
                hits.append(hit)
            after = shared_in_batch([(r.tokens, r.salt, r.cached) for r in reqs]) if self.prefix_caching else {}
            followers = {reqs[j].slot for j in after}             # copied from their batch's leaders below
            for donor, slot, hit in copies:
                if slot not in followers:
                    self._cache.copy_prefix(donor, slot, hit)
        todo = [r for j, r in enumerate(reqs) if j not in after]
        self._prefill_forward(todo)
        if after:                # the rest of the batch, from the prompt blocks its leaders have just computed
            for j, (i, n) in after.items():
                self._cache.copy_prefix(reqs[i].slot, reqs[j].slot, n)
                self.prefix.hits += n - hits[j]
                reqs[j].cached = hits[j] = n            # reused, not computed: cached tokens as a client counts them
            self._prefill_forward([reqs[j] for j in after])
        if self.prefix_caching:
            for r in reqs:
                r.shared = len(r.tokens) - 1
                self.prefix.register(r.slot, r.tokens, r.salt, r.shared)
        return hits

    def _prefill_forward(self, reqs: list[_Request]) -> None:
        """KV for every prompt token but the last of ``reqs`` from where each is cached, in one forward (the LM
        head at one position only: ``[B, P, V]`` logits at 128k are GBs)."""
        todo = [r for r in reqs if r.cached < len(r.tokens) - 1]
        if todo:
            self._forward(todo, ends=[len(r.tokens) - 1 for r in todo], raw=True, last=True)

    def release(self, rid: str) -> None:
        with self._lock:
            self._drop(rid)

    def active_requests(self) -> list[str]:
        with self._lock:
            return list(self._requests)

    def cache_info(self) -> dict:
        with self._lock:
            return self.prefix.size() if self.prefix_caching else {}

    def length(self, rid: str) -> int:
        return len(self._get(rid).tokens)

    # -- the operations speculative decoding needs -----------------------------------------------
    def propose(self, rid: str, k: int) -> tuple[list[int], torch.Tensor]:
        return self.propose_batch([(rid, k)])[0]

    def propose_adaptive(self, rid: str, k_max: int, head, threshold: float, eos: int | None = None
                         ) -> tuple[list[int], torch.Tensor]:
        return self.propose_adaptive_batch([(rid, k_max, head, threshold, eos)])[0]

    def score(self, rid: str, draft: list[int]) -> torch.Tensor:
        return self.score_batch([(rid, draft)])[0]

    def propose_batch(self, items: list[tuple]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Sample k_i tokens per row ``(rid, k_i[, rows[, law]])`` (max k_i forwards; rows drop out when done):
        tokens [k_i], logits [k_i, V] (None where ``rows`` is False; with ``law``, the probabilities sampled)."""
        return self._draft([(rid, k, None, None, *keep) for rid, k, *keep in items])

    def propose_adaptive_batch(self, items: list[tuple]) -> list[tuple[list[int], torch.Tensor]]:
        """SpecDec++ drafting (Huang et al. 2024, Algorithm 1) per row (rid, k_max, head, threshold[, eos]): the
        forward yielding q_i also yields the final hidden state e_{i-1} of candidate i-1, whose predicted
        acceptance sigmoid(head(e_{i-1})) feeds the row's :class:`cluster.core.draft.stop.DraftStop`
        (threshold, k_max, and a stop right after an EOS candidate)."""
        return self._draft([(rid, k, resolve_head(head), DraftStop(thr, k, eos[0] if eos else None))
                            for rid, k, head, thr, *eos in items])

    def score_batch(self, items: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Append each draft and run one forward; row i gets logits [L_i+1, V] (last context token re-fed)."""
        reqs = [self._get(rid) for rid, _ in items]
        for req, (_, draft) in zip(reqs, items):
            req.cached = min(req.cached, len(req.tokens) - 1)
            req.tokens.extend(draft)
        res = self._forward(reqs)
        return [lg[-(len(draft) + 1):] for (lg, _), (_, draft) in zip(res, items)]

    def rollback(self, rid: str, length: int) -> None:
        req = self._get(rid)
        del req.tokens[length:]
        req.cached = min(req.cached, length)
        if length < req.shared:                  # below its registered prompt blocks: they are written again
            self.prefix.forget(req.slot)
            req.shared = 0

    def extend(self, rid: str, ids: list[int]) -> None:
        self._get(rid).tokens.extend(ids)

    # -- internals ---------------------------------------------------------------------------
    def _get(self, rid: str) -> _Request:
        try:
            return self._requests[rid]
        except KeyError:
            raise UnknownRequestError(self.name, rid) from None

    def _slot(self, donor: int | None) -> int:        # caller holds the lock
        """A slot for a new request: ``donor`` itself when it is a released slot holding the prompt's prefix;
        else the released slot the prefix cache would evict first (least recently released), or the lowest free
        one without caching; else a new one."""
        if self.prefix_caching:
            slot = self.prefix.take(donor)
            if slot is not None:
                self.prefix.forget(slot)            # written again from the hit on: re-registered after prefill
                return slot
        elif self.prefix.free:                      # the released slots, as the index orders them
            slot = min(self.prefix.free)
            del self.prefix.free[slot]
            return slot
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        return slot

    def _drop(self, rid: str) -> None:               # caller holds the lock
        req = self._requests.pop(rid, None)
        if req is not None:
            if self.prefix_caching:                # what it computed stays findable until the slot is reused
                self.prefix.register(req.slot, req.tokens, req.salt, req.cached)
            self.prefix.release(req.slot)

    def _draft(self, items) -> list[tuple[list[int], torch.Tensor | None]]:
        """Rows (rid, k, head or None, DraftStop or None[, rows[, law]]): one forward per step over the rows still
        drafting, every row's token drawn in one batched call on the device (:func:`cluster.core.rejection.sample_batch`,
        counter-based draws keyed by the row's start and step); a row with a head stops by its rule, one without
        after k tokens.  A row's logits ``[L, V]`` (with ``law``: the probabilities its tokens were drawn from)
        are gathered from the steps' outputs at the end, only for the rows whose caller reads them (``rows``
        False: None, no copy of V-wide rows); where every row ran every step, as views of one ``[B, L, V]``."""
        reqs = [self._get(rid) for rid, *_ in items]
        keep = [it[4] if len(it) > 4 else True for it in items]
        law = [1 if len(it) > 5 and it[5] else 0 for it in items]       # which of a step's outputs row i reads
        out = [[] for _ in items]
        starts = [len(r.tokens) for r in reqs]
        steps: list[tuple] = []          # per step: (row -> its line, (logits [B_s, V], probabilities or None))
        live = [i for i, (_, k, *_) in enumerate(items) if k > 0]
        ks = {it[1] for it in items}
        laws = None             # every row k steps (no stopping rule): the laws drawn straight into [B, k, V]
        if any(law) and len(ks) == 1 and min(ks) > 0 and all(it[3] is None for it in items):
            # [k, B, V]: each step's softmax writes one contiguous [B, V] (into a strided slice it computes
            # aside and copies); handed on as the [B, k, V] view
            laws = torch.empty(min(ks), len(items), self.vocab_size, device=self.device)
        step = 0
        while live:
            step += 1
            rows = [reqs[i] for i in live]
            head = any(items[i][2] is not None for i in live)
            logits, hid, at = self._forward(rows, hidden=head, raw=True, last=not head)
            last = _last_rows(logits, at).float()                                           # [B, V]
            cons = [j for j, r in enumerate(rows) if r.sampling.constraint is not None]
            if cons:                                      # grammars' laws (core/constraint.py): one batched mask
                allowed = torch.stack([rows[j].sampling.constraint.allowed(rows[j].tokens) for j in cons])
                last = last.index_put((torch.tensor(cons, device=last.device),),      # a copy: the model's
                                      mask_logits(last[cons], allowed.to(last.device)))  # rows stay as they are
            rs = RowSampling.of([r.sampling for r in rows], self.vocab_size, last.device)
            draws = CounterDraws.of([r.rng.seed for r in rows], [starts[i] for i in live], last.device)
            toks, probs = sample_batch(last, rs, draws, offset=step - 1, purpose=DRAFT,
                                       out=None if laws is None else laws[step - 1])
            toks = toks.tolist()
            if any(keep[i] for i in live):
                steps.append(({i: j for j, i in enumerate(live)}, (last, probs)))
            accept = self._accept_probs(items, live, hid, at) if step >= 2 and hid is not None else {}
            done = set()
            for j, (i, tok) in enumerate(zip(live, toks)):
                req, (_, k, head, rule, *_) = reqs[i], items[i]
                req.tokens.append(tok)
                out[i].append(tok)
                stop = step >= k if rule is None else rule.after(tok, accept.get(j))
                if stop:
                    done.add(i)
            live = [i for i in live if i not in done]
        empty = torch.empty(0, self.vocab_size, device=self.device)
        if steps and all(len(at) == len(items) for at, _ in steps):    # every row in every step (row i: line i)
            whole = {w: laws.transpose(0, 1) if w and laws is not None else
                     torch.stack([rows[w] for _, rows in steps], 1)
                     for w in {law[i] for i in range(len(items)) if keep[i]}}      # [B, k, V]: row i a view
            return [(toks, whole[law[i]][i] if keep[i] else None) for i, toks in enumerate(out)]
        return [(toks, (torch.stack([rows[law[i]][at[i]] for at, rows in steps[:len(toks)]]) if toks else empty)
                 if keep[i] else None) for i, toks in enumerate(out)]

    @staticmethod
    @torch.inference_mode()
    def _accept_probs(items, live, hid, at) -> dict[int, float]:
        """SpecDec++'s a_{i-1} = sigmoid(head(e_{i-1})) for every live row with a head (row j -> probability),
        one head call per distinct head over the rows' hidden states ``[R, H]`` on the device, one read back."""
        by_head: dict[int, list[int]] = {}
        for j, i in enumerate(live):
            if items[i][2] is not None:
                by_head.setdefault(id(items[i][2]), []).append(j)
        out: dict[int, float] = {}
        for js in by_head.values():
            head = items[live[js[0]]][2]
            e = hid[[at[j][0] for j in js], [at[j][1] - 1 for j in js]].float()        # [R, H]
            out.update(zip(js, torch.sigmoid(head(e)).tolist()))
        return out

    @torch.inference_mode()
    def verify_batch(self, items: list) -> list:
        """Append each draft, run one forward and verify every row on this worker's device
        (:func:`cluster.core.verify_round.verify_round`): the logits never leave it, token ids come back."""
        return verify_round(self._scored_rows(items), items)

    @torch.inference_mode()
    def review_batch(self, items: list) -> list:
        """CS Drafting's reviews by this drafter, as :meth:`verify_batch` verifies
        (:func:`cluster.core.verify_round.review_round`): one forward, one batched call on its device."""
        return review_round(self._scored_rows(items), items)

    def _scored_rows(self, items: list) -> torch.Tensor:
        """Append each item's ``draft`` and run one forward -> float32 logits ``[B, K+1, V]`` on the device, row b
        at item b's last ``len(draft) + 1`` positions (a view where the rows are aligned, as they usually are)."""
        reqs = [self._get(it.rid) for it in items]
        for req, it in zip(reqs, items):
            req.cached = min(req.cached, len(req.tokens) - 1)
            req.tokens.extend(it.draft)
        logits, _, at = self._forward(reqs, raw=True)                               # [B, n, V]; (row, fed)
        K = max(len(it.draft) for it in items)
        firsts = [n - len(it.draft) - 1 for (_, n), it in zip(at, items)]
        if all(b == i for i, (b, _) in enumerate(at)) and not any(firsts):     # rows aligned: a view, no copy
            return logits[:, :K + 1].float()
        B, n, V = logits.shape                  # whole rows by index_select (advanced indexing walks elements)
        flat = [b * n + min(f + j, m - 1) for f, (b, m) in zip(firsts, at) for j in range(K + 1)]
        return logits.reshape(B * n, V).index_select(0, torch.tensor(flat, device=logits.device)) \
            .view(len(items), K + 1, V).float()

    @torch.inference_mode()
    def _forward(self, reqs: list[_Request], hidden: bool = False, ends: list[int] | None = None, raw: bool = False,
                 last: bool = False):
        """Feed each row's ``tokens[cached:end]`` in one forward; per row (logits ``[n_b, V]``, final hidden
        states ``[n_b, H]`` with ``hidden``, else None), float32 on the CPU.  ``raw``: (the padded logits
        ``[B, n, V]`` as the model returned them, on its device; hidden states ``[B, n, H]`` or None; per request
        (its row there, n_b)).  ``last`` (with ``raw``): the LM head runs only at the rows' last fed positions
        (transformers' ``logits_to_keep``): logits ``[B, m, V]`` over the m distinct ones, and n_b counts the
        kept positions up to row b's last (so its last is at n_b - 1 either way)."""
        if len({r.slot for r in reqs}) != len(reqs):
            raise ValueError("a request may appear only once per batch")
        ends = ends or [len(r.tokens) for r in reqs]
        for r, e in zip(reqs, ends):
            if r.cached >= e:                            # everything cached: recompute the last position
                r.cached = e - 1
        order = sorted(range(len(reqs)), key=lambda i: reqs[i].slot)   # ascending slots: often one slice
        rows = [reqs[i] for i in order]
        feeds = [r.tokens[r.cached:ends[i]] for i, r in zip(order, rows)]
        offsets = [r.cached for r in rows]
        n = max(len(f) for f in feeds)
        ids = torch.tensor([f + [0] * (n - len(f)) for f in feeds], dtype=torch.long, device=self.device)
        pos = torch.tensor(offsets, device=self.device)[:, None] + torch.arange(n, device=self.device)
        self._cache.plan([r.slot for r in rows], offsets, n)
        mask = build_masks(self.layout, offsets, n, max(offsets) + n, self.model.dtype, self.device)
        kept = sorted({len(f) for f in feeds}) if last else None        # the last positions, + 1
        extra = {"output_hidden_states": True} if hidden else {}
        if kept is not None:
            extra["logits_to_keep"] = 1 if kept == [n] else torch.tensor(kept, device=self.device) - 1
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask,
                         past_key_values=self._cache, use_cache=True, **extra)
        if raw:
            at = [None] * len(reqs)
            for b, (i, r, f) in enumerate(zip(order, rows, feeds)):
                r.cached += len(f)
                at[i] = (b, len(f) if kept is None else kept.index(len(f)) + 1)
            return out.logits, out.hidden_states[-1] if hidden else None, at
        logits = out.logits.float().cpu()                                           # [B, n, V]
        hid = out.hidden_states[-1].float().cpu() if hidden else None               # [B, n, H]
        res = [None] * len(reqs)
        for b, (i, r, f) in enumerate(zip(order, rows, feeds)):
            r.cached += len(f)
            lg = logits[b, :len(f)]
            res[i] = (lg, hid[b, :len(f)] if hidden else None)
        return res


def _last_rows(logits: torch.Tensor, at: list[tuple[int, int]]) -> torch.Tensor:
    """Each request's last fed position of the padded ``logits [B, n, V]`` (``at``: per request (its row there,
    n_b)) -> ``[B, V]``: a view where the requests are the rows in order and fed alike (a drafting step), else
    whole rows picked (:func:`cluster.core.rejection.pick_rows`)."""
    rows, last = [b for b, _ in at], [n - 1 for _, n in at]
    if rows == list(range(logits.shape[0])) and len(set(last)) == 1:
        return logits[:, last[0]]
    return pick_rows(logits, torch.tensor(last, device=logits.device), torch.tensor(rows, device=logits.device))
