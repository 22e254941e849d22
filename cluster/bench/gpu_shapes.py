"""Forward costs of the production layout's shapes on a lent device, measured, for the projection's inputs.

No 70B or 1B weights can be fetched here, but a forward's cost does not depend on the weights' values: a
``LlamaForCausalLM`` with the right shapes and random bf16 weights costs what the real one does, as transformers
computes it (eager, the way the engine runs it).  Two shapes, from ``configs/production-70b.yaml``'s layout:

* ``target-tp8-rank``: one tensor-parallel rank of a Llama-3.1-70B-class target at TP = 8 (hidden 8192, 80
  layers, intermediate 28672 / 8, 64 / 8 query heads and 8 / 8 KV heads of 128, vocabulary 128256 / 8), as
  transformers' Llama TP plan shards it (column-wise q/k/v/gate/up, row-wise o/down).  The two all-reduces a
  layer needs over NVLink cannot be measured on one device; :data:`ALLREDUCE_MS` adds them, cited;
* ``drafter-1b``: a Llama-3.2-1B-class drafter on a device of its own (hidden 2048, 16 layers, 32 heads, 8 KV
  heads of 64, intermediate 8192, vocabulary 128256, tied embeddings).

Each cell is the median of :data:`ITERS` forwards of ``tokens`` new tokens per row over a KV cache of
``context`` positions per row, cropped back after each (``DynamicCache.crop(-tokens)``), timed with the device
synchronised.  :func:`projection_inputs` turns them into :data:`cluster.bench.projection.INPUTS`' keys.
"""
from __future__ import annotations

import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

SHAPES = {
    "target-tp8-rank": dict(hidden_size=8192, intermediate_size=28672 // 8, num_hidden_layers=80,
                            num_attention_heads=64 // 8, num_key_value_heads=8 // 8, head_dim=128,
                            vocab_size=128256 // 8, tie_word_embeddings=False),
    "drafter-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
}
ROWS, TOKENS, CONTEXT, ITERS, WARMUP = (1, 4, 16, 32), (1, 5), 512, 10, 3
# Two ring all-reduces per layer of rows x tokens x 8192 bf16 over NVLink at TP = 8: latency-bound at these
# sizes, ~15 us each (NCCL's small-message latency on one NVLink node; NVIDIA's nccl-tests all_reduce_perf
# reports 10-20 us at <= 256 KiB on H100 HGX), so 2 x 80 x 15 us.  Cited, not measured: one device here.
ALLREDUCE_MS = 2 * 80 * 0.015


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _model(shape: dict, device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)                 # made in ``dtype`` on the device: no float32 copy first
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=8192))
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def _median_seconds(step, device: str, iters: int, warmup: int, after=lambda: None) -> float:
    """Median wall seconds of ``step()`` over ``iters`` calls after ``warmup`` untimed ones, the device
    synchronised around each; ``after()`` runs after every call, untimed."""
    times = []
    for i in range(warmup + iters):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        after()
    return statistics.median(times)


@torch.inference_mode()
def time_forward(model, device: str, rows: int, tokens: int, context: int, iters: int, warmup: int) -> float:
    """Median seconds of one forward of ``tokens`` new tokens per row after ``context`` cached positions."""
    vocab = model.config.vocab_size
    cache = DynamicCache()
    model(torch.randint(vocab, (rows, context), device=device), past_key_values=cache, use_cache=True)
    new = torch.randint(vocab, (rows, tokens), device=device)
    return _median_seconds(lambda: model(new, past_key_values=cache, use_cache=True), device, iters, warmup,
                           after=lambda: cache.crop(-tokens))   # transformers 5: a negative count removes that many


@torch.inference_mode()
def time_graphed(model, device: str, rows: int, tokens: int, context: int, iters: int, warmup: int) -> float:
    """As :func:`time_forward`, but the forward replayed from a CUDA graph over a ``StaticCache`` (what a
    compiled engine pays: the same kernels without Python's launch overhead; on the CPU the same static-cache
    forward, not captured).  The new tokens overwrite the same cache slots each time."""
    vocab = model.config.vocab_size
    cache = StaticCache(config=model.config, max_cache_len=context + tokens)
    model(torch.randint(vocab, (rows, context), device=device), past_key_values=cache, use_cache=True,
          position_ids=torch.arange(context, device=device)[None])
    new = torch.randint(vocab, (rows, tokens), device=device)
    position = torch.arange(context, context + tokens, device=device)[None]

    def step():                                        # the same slots every time: rewind the layers' counters
        for layer in cache.layers:
            layer.cumulative_length.fill_(context)
        return model(new, past_key_values=cache, use_cache=True, position_ids=position)
    if device.startswith("cuda"):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):                  # warm-up off the capture stream, as torch.cuda.graph asks
            for _ in range(warmup):
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        step = graph.replay
    return _median_seconds(step, device, iters, warmup)


def shape_costs(device: str, shapes: dict = SHAPES, rows=ROWS, tokens=TOKENS, context: int = CONTEXT,
                iters: int = ITERS, warmup: int = WARMUP, dtype: torch.dtype = torch.bfloat16,
                graphed: bool = False) -> list[dict]:
    """One row per (shape, rows, tokens): the median forward ms and its ratio to the shape's (1 row, 1 token);
    ``graphed``: also the same forward replayed from a CUDA graph (:func:`time_graphed`)."""
    out = []
    for name, shape in shapes.items():
        torch.manual_seed(0)
        model = _model(shape, device, dtype)
        params = sum(p.numel() for p in model.parameters())
        base = None
        for r in rows:
            for t in tokens:
                ms = time_forward(model, device, r, t, context, iters, warmup) * 1e3
                base = base or ms
                row = {"shape": name, "params_m": round(params / 1e6), "rows": r, "tokens": t,
                       "context": context, "ms": round(ms, 3), "vs_1x1": round(ms / base, 3)}
                if graphed:
                    try:
                        row["graphed_ms"] = round(time_graphed(model, device, r, t, context, iters, warmup) * 1e3, 3)
                    except RuntimeError as e:          # a capture transformers' code refuses: say so, keep eager
                        row["graphed_ms"] = None
                        row["graph_error"] = str(e).splitlines()[0][:120]
                out.append(row)
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


def projection_inputs(rows: list[dict], k: int = 4, column: str = "ms") -> dict:
    """The projection's cost inputs (:data:`cluster.bench.projection.INPUTS` keys) from :func:`shape_costs`'
    rows: the target's one-token ms plus the cited all-reduces, its k + 1-token and 32-row factors, the
    drafter's one-token ms and 32-row factor; ``column``: ``ms`` (eager) or ``graphed_ms``."""
    ms = {(r["shape"], r["rows"], r["tokens"]): r[column] for r in rows}
    t1 = ms[("target-tp8-rank", 1, 1)] + ALLREDUCE_MS
    big = max(r["rows"] for r in rows)
    d1 = ms[("drafter-1b", 1, 1)]
    return dict(target_ms=round(t1, 3),
                verify_factor=round((ms[("target-tp8-rank", 1, k + 1)] + ALLREDUCE_MS) / t1, 3),
                batch32_factor=round((ms[("target-tp8-rank", big, 1)] + ALLREDUCE_MS) / t1, 3),
                draft_ms=round(d1, 3), draft_batch32_factor=round(ms[("drafter-1b", big, 1)] / d1, 3))
