"""The production RayService offers the node labels its config's placement asks for (docs/operator-guide.md,
"A Ray cluster of many nodes"): every role with ``labels`` fits a worker group whose Ray node labels include them."""
from __future__ import annotations

from pathlib import Path

import yaml

from cluster.config.schema import load_config

ROOT = Path(__file__).parents[2]


def _groups(manifest: str) -> dict[str, dict]:
    (svc,) = [d for d in yaml.safe_load_all((ROOT / manifest).read_text()) if d and d.get("kind") == "RayService"]
    return {g["groupName"]: g.get("labels", {}) for g in svc["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def test_every_labelled_role_has_a_worker_group():
    cl = load_config(ROOT / "configs" / "production-70b.yaml").cluster
    groups = _groups("k8s/rayservice-production-70b.yaml")
    placed = {role: getattr(cl, role).labels for role in ("target", "drafters", "coordinator")}
    assert all(placed.values()), placed                    # the production config states where each role runs
    for role, want in placed.items():
        hosts = [g for g, labels in groups.items() if want.items() <= labels.items()]
        assert hosts, f"cluster.{role}.labels {want}: no worker group offers them ({groups})"
    assert placed["target"] != placed["drafters"]          # target ranks and drafters on their own node pools
