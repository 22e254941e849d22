"""``specserve bench --suite gpu``: what a lent CUDA device should spend its minutes on, in one command.

1. **Exactness on the device.**  Every drafting strategy the config serves, greedy, on ``--prompts`` held-out
   prompts, one request at a time and all of them batched together: each output must equal autoregressive
   decoding's on the same device (token for token), with tok/s and the ratio to autoregressive beside it.
2. **Forward costs there.**  Each neural model's batched forward seconds by rows x new tokens, measured through
   the engine's own handles (:func:`cluster.bench.measure.forward_cost_grid`), and the drafter's cost over the
   target's one-token forward at the same batch, ``c``.
3. **Closed-loop load there** (:mod:`cluster.bench.load`, in-process, ``--concurrency``, default 1,4,16,32):
   autoregressive, fixed k and CS Drafting at each batch, on the device -- where a verification of k + 1 tokens
   costs little more than one token, which is where ``engine.plain_from_batch`` should stay unset or high.
4. **The production layout's shapes there** (CUDA only; :mod:`cluster.bench.gpu_shapes`): forward ms of a
   70B-class target's TP = 8 rank and a 1B-class drafter with random weights, and the closed-form projection
   (:mod:`cluster.bench.projection`) on those measured costs in place of its shipped ones.
5. **The served suite on the device** (``--runtime cluster``, with the in-process part by default): the unit's
   coordinator and draft actors ask Ray for a share of the GPU, which is what makes Ray show it to them.  It
   needs Ray and Serve where it runs; without them the command says so before measuring anything.

Without a CUDA device it stops (exit 2) and says so, unless ``--device cpu`` asks for the same procedure on the
CPU: what the tests run, so that the command works the day a device is lent.  Results: ``gpu_*.{csv,json}``.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import time
from pathlib import Path

import torch

from cluster.bench import SUITES, gpu_shapes, projection
from cluster.bench.load import collect
from cluster.bench.load_report import mismatches
from cluster.bench.measure import drafting_rows, forward_cost_grid
from cluster.bench.report import parse_runtimes, print_table, write_results
from cluster.core.sampling import SamplingParams
from cluster.engine.request import GenerationRequest
from cluster.errors import ParamError, check_int
from cluster.family.corpus import heldout_prompts
from cluster.local import build_engine

GREEDY = SamplingParams(0.0)
COST_ROWS, COST_TOKENS = (1, 4, 16, 32), (1, 5)
LOAD_LEVELS = "1,4,16,32"  # the load step's concurrencies unless --concurrency names others
GPU_SHARE = 0.25           # of one device, per actor that hosts a model: Ray shows a device to actors that ask


def on_device(cfg, device: str):
    """``cfg`` with every model on ``device`` and, for CUDA, every model-hosting actor asking for a GPU share."""
    models = {name: dataclasses.replace(spec, device=device) for name, spec in cfg.models.items()}
    cluster = cfg.cluster
    if device.startswith("cuda"):
        share = {f: dataclasses.replace(getattr(cluster, f), num_gpus=GPU_SHARE)
                 for f in ("target", "drafters", "coordinator")}
        cluster = dataclasses.replace(cluster, **share)
    return dataclasses.replace(cfg, models=models, cluster=cluster)


def choose_device(requested: str | None) -> str | None:
    """The device to measure on: ``requested`` (checked), else the first CUDA device, else None."""
    if requested is None:
        return "cuda" if torch.cuda.is_available() else None
    if requested != "cpu" and not requested.startswith("cuda"):
        raise ParamError("device", "cpu, cuda or cuda:N", requested)
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ParamError("device", "a CUDA device torch can see (torch.cuda.is_available() is False)", requested)
    return requested


def exactness(engine, cfg, prompts: list[str], max_new: int) -> list[dict]:
    """Greedy outputs of every strategy, alone and batched, against autoregressive's; tok/s of the lone runs."""
    def request(strategy, options, prompt):
        return GenerationRequest(prompt=prompt, max_new_tokens=max_new, sampling=GREEDY, seed=0,
                                 strategy=strategy, options=dict(options), ignore_eos=True)

    out, reference = [], None
    for name, strategy, options in drafting_rows(cfg, engine):
        engine.generate(request(strategy, options, prompts[0]))                   # warm-up (not timed)
        t0 = time.perf_counter()
        alone = [engine.generate(request(strategy, options, p)).token_ids for p in prompts]
        seconds = time.perf_counter() - t0
        together = [r.token_ids for r in engine.generate_many([request(strategy, options, p) for p in prompts])]
        reference = reference or alone
        tokens = sum(map(len, alone))
        out.append({"strategy": name, "prompts": len(prompts),
                    "equal_alone": sum(a == r for a, r in zip(alone, reference)),
                    "equal_batched": sum(b == r for b, r in zip(together, reference)),
                    "tokens": tokens, "tok_s": round(tokens / seconds, 1)})
    base = out[0]["tok_s"]
    for row in out:
        row["vs_autoregressive"] = round(row["tok_s"] / base, 3) if base else None
    return out


def forward_costs(engine, cfg) -> list[dict]:
    """Each neural model's batched forward ms by rows x new tokens, and c = its ms over the target's 1-token ms."""
    drafters = [n for n in cfg.drafters if n in engine.models and not engine.models[n].deterministic]
    costs = {}
    for name in [cfg.target, *drafters]:
        h, tokens = engine.models[name], COST_TOKENS if name == cfg.target else (1,)
        costs[name] = forward_cost_grid(h, rows=COST_ROWS, new_tokens=tokens, iters=3,
                                        context=max(1, min(64, h.max_length - max(tokens))))
    target = costs[cfg.target]
    return [{"model": name, "rows": r, "tokens": t, "ms": round(s * 1e3, 3),
             "c_vs_target": round(s / target[(r, 1)], 3)} for name, grid in costs.items() for (r, t), s in grid.items()]


def production_shapes(device: str, name: str, out: Path) -> None:
    """Step 3: the production shapes' forward costs, eager and replayed from a CUDA graph, and the projection
    on each (all printed and written)."""
    shapes = gpu_shapes.shape_costs(device, graphed=True)
    print_table(shapes, f"gpu: production shapes' forward ms on {device} ({name}), random bf16 weights, "
                        f"{gpu_shapes.CONTEXT} cached positions per row; eager and CUDA-graphed")
    columns = ["ms"] + (["graphed_ms"] if all(r.get("graphed_ms") for r in shapes) else [])
    inputs = [dict(costs=c, **gpu_shapes.projection_inputs(shapes, column=c)) for c in columns]
    print_table(inputs, f"gpu: projection inputs measured here (target + {gpu_shapes.ALLREDUCE_MS:.1f} ms of "
                        "cited all-reduces); cited ones: " + str({k: projection.INPUTS[k] for k in inputs[0]
                                                                  if k in projection.INPUTS}))
    projected = [dict(costs=i["costs"], **row) for i in inputs
                 for row in projection.project({k: v for k, v in i.items() if k != "costs"})]
    print_table(projected, "gpu: production-70b projection on the measured forward costs")
    write_results(shapes, out, "gpu_shapes")
    write_results(inputs, out, "gpu_projection_inputs")
    write_results(projected, out, "gpu_projection")


def run(args, cfg) -> int:
    device = choose_device(getattr(args, "device", None))
    if device is None:
        print("bench gpu: no CUDA device is visible (torch.cuda.is_available() is False); run it where one is, "
              "or pass --device cpu to run the same procedure on the CPU")
        return 2
    runtimes = parse_runtimes(getattr(args, "runtime", None) or "in-process,cluster")
    if "cluster" in runtimes and importlib.util.find_spec("ray") is None:
        print("bench gpu: the served half (--runtime cluster) needs Ray and Ray Serve, which this Python lacks: "
              "install ray[serve] (pyproject.toml pins it), or pass --runtime in-process to measure without it")
        return 2
    n = check_int("prompts", args.prompts, 1, 64)
    max_new = check_int("max_new_tokens", args.max_new_tokens, 1, cfg.engine.max_new_tokens_limit)
    cfg = on_device(cfg, device)
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    out = Path(args.out)
    rc = 0
    if "in-process" in runtimes:
        engine = build_engine(cfg)
        prompts = [p["prompt"] for p in heldout_prompts(engine.tokenizer, n, seed=7)]
        equal = exactness(engine, cfg, prompts, max_new)
        print_table(equal, f"gpu: greedy outputs on {device} ({name}) vs autoregressive's, alone and batched")
        costs = forward_costs(engine, cfg)
        print_table(costs, f"gpu: batched forward ms on {device} ({name}); c = ms over the target's 1-token ms")
        write_results(equal, out, "gpu_exactness")
        write_results(costs, out, "gpu_forward_costs")
        rc |= int(any(r["equal_alone"] != r["prompts"] or r["equal_batched"] != r["prompts"] for r in equal))
        del engine                         # the load step builds its own, on the same device
        levels = getattr(args, "concurrency", None) or LOAD_LEVELS
        measured = collect(argparse.Namespace(**{**vars(args), "runtime": "in-process", "concurrency": levels}),
                           cfg).levels
        rc |= int(mismatches(measured)[1] > 0)
        if device.startswith("cuda"):
            production_shapes(device, name, out)
    if "cluster" in runtimes:
        rc |= SUITES["served"](args, cfg)      # imports Ray and Serve only here: the in-process part needs neither
    return rc
