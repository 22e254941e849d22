"""A tensor-parallel target: ``tp_size`` rank actors in one Ray placement group, called in lockstep.

Each rank initialises ``torch.distributed`` (gloo on CPU, NCCL on GPU) and loads its shard of the
checkpoint through transformers' own tensor-parallel plan (:func:`cluster.models.build.build_handle` with
``tp_size``; Megatron-style column/row splits, one all-reduce per attention and MLP block, the
vocabulary logits gathered).  Every call goes to every rank in the same order (the collectives
inside the forward pass pair up), each rank keeps the same per-request state (token sequence and its
shard of the KV cache), and only rank 0 returns its result.  Sampling inside ``propose`` draws from
identical seeded generators over identical gathered logits, so the ranks stay in step.
"""
from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist

from actors.model_actor import ModelHost
from cluster.models.build import build_handle
from cluster.models.host import setup_process


class TPRank(ModelHost):
    def __init__(self, cfg, name: str, rank: int, world: int, threads: int = 1):   # loads in setup(), not here
        setup_process(threads)
        self.cfg, self.name, self.rank, self.world = cfg, name, rank, world
        self.worker = None

    def address(self) -> tuple[str, int]:
        """(ip, free port) on this rank's node: the rendezvous rank 0 offers."""
        import ray
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def setup(self, master: tuple[str, int], backend: str, device: str, collective_timeout_s: float = 600.0) -> dict:
        """Join the process group and load this rank's shard (all ranks call this together).  A collective
        that waits longer than ``collective_timeout_s`` for a peer (a dead rank) fails instead of hanging."""
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world), LOCAL_RANK="0",
                          MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        dist.init_process_group(backend, init_method=f"tcp://{master[0]}:{master[1]}",
                                rank=self.rank, world_size=self.world,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        self.worker = build_handle(self.cfg, self.name, tp_size=self.world)
        return self.info()

    def step(self, call):
        out, seconds = super().step(call)
        return (out if self.rank == 0 else None), seconds

    def health(self) -> dict:
        return dict(super().health(), rank=self.rank, world=self.world)


def start_tp_group(cfg, name: str, *, tp_size: int, num_cpus: float, num_gpus: float, threads: int = 1,
                   backend: str = "gloo", device: str = "cpu", timeout_s: float = 600.0,
                   collective_timeout_s: float = 600.0, strategy: str | None = None,
                   resources: dict | None = None, label_selector: dict | None = None):
    """Create the placement group (``strategy``; default STRICT_PACK with GPUs, else PACK; each bundle also
    asks for ``resources`` on nodes matching ``label_selector``) and the rank actors, initialise and load them;
    returns ``(actors ordered by rank, placement group, info of rank 0)``."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    extra = dict(resources or {})
    bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {}), **extra}
    pg = placement_group([bundle] * tp_size, strategy=strategy or ("STRICT_PACK" if num_gpus else "PACK"),
                         bundle_label_selector=[dict(label_selector)] * tp_size if label_selector else None)
    ray.get(pg.ready(), timeout=timeout_s)
    cls = ray.remote(TPRank)
    actors = [cls.options(num_cpus=num_cpus, num_gpus=num_gpus, resources=extra, max_concurrency=1,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              placement_group=pg, placement_group_bundle_index=r))
              .remote(cfg, name, r, tp_size, threads) for r in range(tp_size)]
    master = ray.get(actors[0].address.remote(), timeout=timeout_s)
    infos = ray.get([a.setup.remote(master, backend, device, collective_timeout_s) for a in actors],
                    timeout=timeout_s)
    return actors, pg, infos[0]
