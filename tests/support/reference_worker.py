"""The single-request reference worker the batched worker is tested against (tests only).

A Hugging Face causal LM with one ``DynamicCache`` per request and one forward per request: an independent
implementation of :class:`cluster.core.interfaces.BatchedHandle` over transformers' own cache, so the slot
cache of :class:`cluster.models.batched.BatchedHFWorker` can be held to its logits (1e-4) and RNG streams.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from cluster.core.draws import DRAFT, CounterDraws
from cluster.core.rejection import RowSampling, sample_batch
from cluster.core.sampling import Rng, SamplingParams, derive_seed
from cluster.models.head import resolve_head


@dataclass
class _Request:
    tokens: list[int]
    cache: DynamicCache
    cached: int
    sampling: SamplingParams
    rng: Rng


class HFWorker:
    """Hosts one causal LM; all calls are per request id (see :class:`cluster.core.interfaces.BatchedHandle`)."""

    def __init__(self, model: torch.nn.Module, name: str, *, max_length: int | None = None):
        self.model = model.eval()
        self.name = name
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_length = int(max_length or getattr(cfg, "max_position_embeddings", 2048))
        self.num_params = sum(p.numel() for p in model.parameters())
        self.deterministic = False
        self.device = next(model.parameters()).device
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, path: str | Path, name: str, *, dtype: str = "float32",
                        device: str = "cpu", **kwargs) -> "HFWorker":
        """Load a local HF checkpoint directory (safetensors + config); never reaches a hub."""
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype),
                                                     local_files_only=True, **kwargs)
        if "tp_plan" not in kwargs:
            model = model.to(device)
        return cls(model, name)

    # -- request lifecycle -------------------------------------------------------------------
    def prefill(self, rid: str, ids: list[int], sampling: SamplingParams, seed: int) -> None:
        if not ids:
            raise ValueError("prefill needs at least one token")
        req = _Request(list(ids), DynamicCache(config=self.model.config), 0, sampling,
                       Rng(derive_seed(seed, self.name)))
        with self._lock:
            self._requests[rid] = req
        if len(ids) > 1:                      # pay for the prompt now; the last token stays pending
            req.tokens, last = req.tokens[:-1], req.tokens[-1]
            self._forward(req)
            req.tokens.append(last)

    def release(self, rid: str) -> None:
        with self._lock:
            self._requests.pop(rid, None)

    def active_requests(self) -> list[str]:
        with self._lock:
            return list(self._requests)

    def length(self, rid: str) -> int:
        return len(self._get(rid).tokens)

    # -- the three operations speculative decoding needs ----------------------------------------
    def propose(self, rid: str, k: int) -> tuple[list[int], torch.Tensor]:
        req = self._get(rid)
        out, logits = [], []
        start = len(req.tokens)
        for i in range(k):
            last = self._forward(req)[-1]                               # [V]
            tok = _draw(last, req, start, i)
            req.tokens.append(tok)
            out.append(tok)
            logits.append(last)
        if not logits:
            return [], torch.empty(0, self.vocab_size)
        return out, torch.stack(logits)                                 # [k], [k, V]

    def propose_adaptive(self, rid: str, k_max: int, head, threshold: float) -> tuple[list[int], torch.Tensor]:
        """SpecDec++ drafting (Huang et al., *SpecDec++: Boosting Speculative Decoding via Adaptive
        Candidate Lengths*, Algorithm 1): like :meth:`propose`, but the forward pass that yields q_i also
        yields the final hidden state e_{i-1} of candidate i-1, and drafting stops once
        1 - prod sigmoid(head(e)) > ``threshold`` (:func:`cluster.core.draft.stop.stop_after`), at most
        ``k_max`` tokens.  ``head``: an AcceptanceHead or its directory (picklable for remote handles)."""
        head = resolve_head(head)
        req = self._get(rid)
        out, logits, keep = [], [], 1.0
        start = len(req.tokens)
        for i in range(1, k_max + 1):
            lg, hid = self._forward(req, hidden=True)                   # [n, V], [n, H]
            tok = _draw(lg[-1], req, start, i - 1)
            req.tokens.append(tok)
            out.append(tok)
            logits.append(lg[-1])
            if i >= 2:
                keep *= head.accept_prob(hid[-1])                       # e_{i-1}: candidate i-1
                if 1.0 - keep > threshold:
                    break
        if not logits:
            return [], torch.empty(0, self.vocab_size)
        return out, torch.stack(logits)                                 # [K], [K, V]

    def score(self, rid: str, draft: list[int]) -> torch.Tensor:
        req = self._get(rid)
        self._crop(req, len(req.tokens) - 1)     # the last context token is fed again: L+1 rows out
        req.tokens.extend(draft)
        return self._forward(req)[-(len(draft) + 1):]                   # [L+1, V]

    def rollback(self, rid: str, length: int) -> None:
        req = self._get(rid)
        del req.tokens[length:]
        self._crop(req, length)

    def extend(self, rid: str, ids: list[int]) -> None:
        self._get(rid).tokens.extend(ids)

    # -- internals ---------------------------------------------------------------------------
    def _get(self, rid: str) -> _Request:
        try:
            return self._requests[rid]
        except KeyError:
            raise KeyError(f"{self.name}: unknown request {rid!r}") from None

    @torch.inference_mode()
    def _forward(self, req: _Request, hidden: bool = False):
        """Feed the uncached tokens; return their logits ``[n, V]`` (float32), and with ``hidden`` also
        their final hidden states ``[n, H]``."""
        if req.cached >= len(req.tokens):   # everything cached: recompute the last position
            self._crop(req, len(req.tokens) - 1)
        ids = torch.tensor([req.tokens[req.cached:]], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, past_key_values=req.cache, use_cache=True,
                         **({"output_hidden_states": True} if hidden else {}))
        req.cached = len(req.tokens)
        if hidden:
            return out.logits[0].float().cpu(), out.hidden_states[-1][0].float().cpu()
        return out.logits[0].float().cpu()

    @staticmethod
    def _crop(req: _Request, n: int) -> None:
        if req.cached > n:
            req.cache.crop(n - req.cached)                              # negative: tokens to drop
            req.cached = n


def _draw(last: torch.Tensor, req, start: int, offset: int) -> int:
    """The drafter's draw as every worker makes it: the counter-based draw of (seed, step start, offset), one row
    of :func:`cluster.core.rejection.sample_batch` (what the batched worker runs for many rows at once)."""
    rs = RowSampling.of([req.sampling], last.shape[-1], last.device)
    draws = CounterDraws.of([req.rng.seed], [start], last.device)
    return int(sample_batch(last.float()[None], rs, draws, offset=offset, purpose=DRAFT)[0][0])
