"""Two local tensor-parallel ranks (torch.multiprocessing, gloo) that run the same in-process engine in
lockstep over a target loaded with transformers' TP plan (:func:`cluster.models.build.build_handle` with
``tp_size=2``, the path :mod:`actors.tp` takes) and a same-architecture drafter on each rank alone.

Every rank makes the same calls in the same order (greedy, seeded), so the collectives inside the target's
forward pair up, exactly as :class:`actors.tp.TPRank` actors are driven; rank 0 reports its tokens.
"""
from __future__ import annotations

import datetime
import os
import socket
import traceback

import torch
import torch.distributed as dist

from cluster.config.schema import config_from_dict
from cluster.core.model_set import ModelSet
from cluster.core.sampling import SamplingParams
from cluster.engine.engine import Engine
from cluster.engine.request import GenerationRequest
from cluster.models.build import build_handle, load_tokenizer

WORLD = 2


def _rank(rank: int, port: int, jobs: list[tuple[str, dict, list[list[int]], int, list]], queue) -> None:
    """jobs: (architecture, models section, prompts, new tokens, [(strategy, options)]); rank 0 puts
    {architecture: {"tokens": [token ids per (prompt, variant)], "sharded": how many of the target's
    parameters this rank holds a shard of} or the error text} on ``queue``."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    out = {}
    for arch, models, prompts, new, variants in jobs:
        try:
            cfg = config_from_dict({"target": "target", "models": models})
            handles = {"target": build_handle(cfg, "target", tp_size=WORLD), "self": build_handle(cfg, "self")}
            engine = Engine.configured(ModelSet.assemble(handles), load_tokenizer(cfg), cfg.engine)
            seqs = [engine.add(GenerationRequest(prompt_ids=p, max_new_tokens=new, sampling=SamplingParams(0.0),
                                                 seed=0, strategy=s, options=o, ignore_eos=True))
                    for p in prompts for s, o in variants]
            while any(s.status != "finished" for s in seqs):
                engine.step()
            tokens = [s.chunks[-1].result.token_ids if s.error is None else repr(s.error) for s in seqs]
            params = list(handles["target"].model.parameters())
            sharded = sum(p.to_local().numel() != p.numel() for p in params if hasattr(p, "to_local"))
            out[arch] = {"tokens": tokens, "sharded": sharded}
        except Exception:                       # noqa: BLE001 - reported to the test, which fails on it
            out[arch] = traceback.format_exc()
        dist.barrier()
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_tp(jobs: list, port: int, timeout_s: float = 300.0) -> dict:
    """Run ``jobs`` on two spawned ranks; rank 0's results by architecture."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, jobs, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        return queue.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
