"""A transformers ``Cache`` whose rows are request *slots* of one batched KV buffer.

Per layer the keys and values live in ``[S, Hkv, C, D]`` buffers (S slots, Hkv key/value heads, capacity C
positions, head dim D), allocated on the first ``update`` from the shapes the attention layer hands over (so
tensor-parallel shards get their local head count) and grown on demand (slots doubling, capacity doubling,
rounded up to 64, never past ``max_len`` unless a row needs it).  Before each forward the caller states which
slot each batch row is and each row's write offset (its cached length) with :meth:`SlotCache.plan`; ``update``
then writes the new ``[B, Hkv, n, D]`` states at positions ``offset_b + j`` of slot ``slot_b`` and returns the
rows' ``[B, Hkv, T, D]`` states, T = max(offset_b + n).  Positions beyond a row's valid length (padding writes,
rolled-back tokens) are stale but harmless: the caller's mask hides them and later writes overwrite them, so
rollback is bookkeeping only.

Sliding-window layers (``is_sliding``) keep the full buffer like the others: the mask hides keys older than
the window (:mod:`cluster.models.support`), so rollback stays bookkeeping and every layer shares one plan;
the price is memory, up to (capacity - window) positions per sliding layer and slot that are never read.

The rows' view: when the rows are one slot range, attention gets ``keys[first:first+B, :, :T]`` as a strided view
of the buffer, with no copy (logits equal to the reference worker's, tests/models/test_batched.py).  A contiguous
copy below a size threshold was tried: timed on whole forwards of the embedded family's target, it tied the view
on short rows and lost to it on rows of a few hundred positions, where every decoding step copied each layer's
keys and values.  Rows that are not one slot range are gathered with ``index_select``.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

_ROUND = 64


def _round_up(n: int, m: int = _ROUND) -> int:
    return -(-n // m) * m


class _Plan:
    """The batch layout of the current forward, shared by all layers."""

    def __init__(self):
        self.slots = torch.zeros(0, dtype=torch.long)     # [B] slot of each batch row
        self.pos = torch.zeros(0, 0, dtype=torch.long)    # [B, n] write position of each new token
        self.first = 0                                    # slots[0] when the rows are a contiguous range
        self.contiguous = True
        self.offset = None                                # the rows' one offset when they share it, else None
        self.need_slots = 0                               # max(slot) + 1
        self.length = 0                                   # T = max(offset_b + n)


class SlotLayer(CacheLayerMixin):
    """One layer's ``[S, Hkv, C, D]`` key/value buffers, indexed by the shared :class:`_Plan`."""

    is_croppable = False

    def __init__(self, plan: _Plan, max_len: int, is_sliding: bool = False):
        super().__init__()
        self.plan, self.max_len, self.is_sliding = plan, max_len, is_sliding

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self.keys = torch.zeros(0, h, 0, d, dtype=self.dtype, device=self.device)
        self.values = torch.zeros(0, value_states.shape[1], 0, value_states.shape[-1], dtype=self.dtype,
                                  device=self.device)
        self.is_initialized = True

    def _grow(self, need_slots: int | None = None, length: int | None = None) -> None:
        s, _, c, _ = self.keys.shape
        p = self.plan
        need_slots = p.need_slots if need_slots is None else need_slots
        length = p.length if length is None else length
        if need_slots <= s and length <= c:
            return
        new_s = s if need_slots <= s else max(need_slots, 2 * s)
        new_c = c if length <= c else max(_round_up(length), min(_round_up(2 * c), _round_up(self.max_len)))
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(new_s, old.shape[1], new_c, old.shape[3])      # [S', Hkv, C', D]
            new[:s, :, :c] = old
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states ``[B, Hkv, n, D]`` -> the rows' full states ``[B, Hkv, T, D]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._grow()
        p = self.plan
        B = key_states.shape[0]
        if p.contiguous and p.offset is not None:   # one slot range at one offset (a decoding step): a slice
            sl, at = slice(p.first, p.first + B), slice(p.offset, p.offset + key_states.shape[2])
            self.keys[sl, :, at] = key_states.to(self.dtype)                    # a scatter costs several slices
            self.values[sl, :, at] = value_states.to(self.dtype)
        else:
            rows = p.slots.to(self.device)[:, None]                             # [B, 1]
            pos = p.pos.to(self.device)                                         # [B, n]
            self.keys[rows, :, pos] = key_states.transpose(1, 2).to(self.dtype)    # [B, n, Hkv, D]
            self.values[rows, :, pos] = value_states.transpose(1, 2).to(self.dtype)
        if p.contiguous:     # a strided view, no copy (module docstring, "The rows' view")
            sl = slice(p.first, p.first + B)
            return self.keys[sl, :, :p.length], self.values[sl, :, :p.length]
        idx = p.slots.to(self.device)
        return (self.keys[:, :, :p.length].index_select(0, idx),
                self.values[:, :, :p.length].index_select(0, idx))

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Slot ``dst``'s first ``n`` positions become slot ``src``'s (a prefix-cache hit on a running request)."""
        if not self.is_initialized:
            return
        self._grow(max(src, dst) + 1, n)
        self.keys[dst, :, :n] = self.keys[src, :, :n]
        self.values[dst, :, :n] = self.values[src, :, :n]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.plan.length, 0

    def get_seq_length(self) -> int:
        return self.plan.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False


class SlotCache(Cache):
    """One cache for all requests of a worker: batch row b of a forward reads/writes slot ``slots[b]``."""

    def __init__(self, layer_types: tuple[str, ...], max_len: int):
        """``layer_types [L]``: each decoder layer's attention kind (``sliding_attention`` marks it sliding)."""
        self._plan = _Plan()
        super().__init__(layers=[SlotLayer(self._plan, max_len, kind == "sliding_attention") for kind in layer_types])

    @torch.inference_mode()           # the buffers are inference tensors (written inside the forwards)
    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Every layer's slot ``dst`` takes slot ``src``'s first ``n`` positions (on the device)."""
        for layer in self.layers:
            layer.copy_prefix(src, dst, n)

    def plan(self, slots: list[int], offsets: list[int], n: int) -> None:
        """Rows ``slots [B]`` with ``offsets [B]`` cached positions each receive ``n`` new (padded) tokens."""
        p = self._plan
        p.slots = torch.tensor(slots, dtype=torch.long)
        p.pos = torch.tensor(offsets, dtype=torch.long)[:, None] + torch.arange(n)[None, :]    # [B, n]
        p.first = slots[0]
        p.contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
        p.offset = offsets[0] if len(set(offsets)) == 1 else None
        p.need_slots = max(slots) + 1
        p.length = max(offsets) + n
