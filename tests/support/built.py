"""Test-side entry point: build what a config needs (as the CLI does), then the in-process engine."""
from __future__ import annotations

from cluster.config.schema import Config
from cluster.engine.engine import Engine
from cluster.family import ensure_built
from cluster.local import build_engine


def engine_for(cfg: Config) -> Engine:
    ensure_built(cfg, progress=False)
    return build_engine(cfg)


def tiny_with_mag_on_ray() -> Config:
    """configs/tiny.yaml with the Max-Gram drafter, built, and a local Ray up (the draft-group actor tests)."""
    import ray
    import yaml
    from cluster.config.schema import config_from_dict
    data = yaml.safe_load(open("configs/tiny.yaml"))
    data["mag"] = {}
    cfg = config_from_dict(data)
    ensure_built(cfg, progress=False)
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, namespace="specserve-test", log_to_driver=False)
    return cfg
