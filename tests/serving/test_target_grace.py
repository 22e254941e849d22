"""Serve's replica health check while the target restarts (Coordinator.health): a target the watchdog marked down
passes as ``restarting`` for ``cluster.target_restart_grace_s``, so Serve leaves the unit (and the requests waiting
to resume on it) alone; past the grace the check fails and Serve replaces the unit; a target that answers is
pinged.  The rule is run on stand-ins for the unit's entries (the Ray path: tests/serving/test_faults.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from cluster.config.schema import load_config
from cluster.engine.health import ModelHealth
from cluster.errors import ConfigError, ModelUnavailableError
from cluster.serving.control.coordinator import Coordinator


class _Channel:
    def __init__(self):
        self.pings = 0

    def health(self):
        self.pings += 1
        return [{"ok": True}]


def _unit(grace: float):
    health, channel = ModelHealth({}), _Channel()
    cfg = SimpleNamespace(target="target", cluster=SimpleNamespace(target_restart_grace_s=grace))
    entries = {"target": SimpleNamespace(name="target", placement="actor", handle=SimpleNamespace(channel=channel)),
               "drafter": SimpleNamespace(name="drafter", placement="actor", handle=None)}
    return SimpleNamespace(cfg=cfg, entries=entries, engine=SimpleNamespace(health=health)), health, channel


def test_a_restarting_target_passes_within_the_grace_and_fails_past_it():
    unit, health, channel = _unit(grace=60.0)
    assert Coordinator.health(unit) == {"target": [{"ok": True}], "drafter": "ok"} and channel.pings == 1
    health.mark_down("target", RuntimeError("killed"))
    assert 0 <= health.down_for("target") < 60 and health.down_for("drafter") is None
    assert Coordinator.health(unit)["target"] == "restarting" and channel.pings == 1     # not pinged
    unit.cfg.cluster.target_restart_grace_s = 0.0
    with pytest.raises(ModelUnavailableError, match="target_restart_grace_s"):
        Coordinator.health(unit)
    health.models = {"target": SimpleNamespace(probe=lambda: True)}
    assert health.refresh() == {"target"} and health.down_for("target") is None
    assert Coordinator.health(unit)["target"] == [{"ok": True}] and channel.pings == 2


def test_a_drafter_down_fails_no_check():
    unit, health, _ = _unit(grace=0.0)
    health.mark_down("drafter", RuntimeError("killed"))
    assert Coordinator.health(unit)["drafter"] == "down"


def test_the_grace_is_validated_with_its_name(tmp_path):
    path = tmp_path / "c.yaml"
    with open("configs/tiny.yaml") as f:
        doc = yaml.safe_load(f)
    doc.setdefault("cluster", {})["target_restart_grace_s"] = -1
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError, match=r"cluster.target_restart_grace_s.*\[0, 86400\].*-1"):
        load_config(path)
