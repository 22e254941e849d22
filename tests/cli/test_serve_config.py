"""``specserve serve-config``: the manifests in k8s/ are what it writes, and it writes only serveConfigV2."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from cluster.cli.main import main
from cluster.cli.serve_config import write_rayservice
from cluster.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PAIRS = [("k8s/rayservice-cpu.yaml", "configs/k8s-cpu.yaml"),
         ("k8s/rayservice-production-70b.yaml", "configs/production-70b.yaml")]


def _outside(text: str) -> list[str]:
    """The lines at indent < 4: everything but the body of serveConfigV2 (and other nested fields)."""
    return [ln for ln in text.splitlines() if not ln.startswith("    ")]


@pytest.mark.parametrize("manifest,config", PAIRS)
def test_rewriting_a_manifest_from_its_config_changes_nothing(tmp_path, manifest, config, monkeypatch):
    monkeypatch.chdir(ROOT)
    copy = tmp_path / "m.yaml"
    shutil.copy(ROOT / manifest, copy)
    assert main(["serve-config", "--config", config, "--rayservice", str(copy)]) == 0
    assert copy.read_text() == (ROOT / manifest).read_text()


def test_an_edited_config_lands_in_serve_config_v2_and_nothing_else_moves(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    manifest, config = tmp_path / "m.yaml", tmp_path / "configs" / "k8s-cpu.yaml"
    config.parent.mkdir()
    shutil.copy(ROOT / PAIRS[0][0], manifest)
    data = yaml.safe_load((ROOT / PAIRS[0][1]).read_text())
    data["engine"]["max_batch"] = 5
    config.write_text(yaml.safe_dump(data))
    assert main(["serve-config", "--config", str(config), "--path", "configs/k8s-cpu.yaml",
                 "--rayservice", str(manifest)]) == 0
    before, after = (ROOT / PAIRS[0][0]).read_text(), manifest.read_text()
    doc = yaml.safe_load(after)
    app = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]
    assert app["args"] == {"source": "configs/k8s-cpu.yaml", "config": data}
    assert _outside(after) == _outside(before)            # comments and every other field as they were
    assert doc["spec"]["rayClusterConfig"] == yaml.safe_load(before)["spec"]["rayClusterConfig"]


def test_a_bad_config_is_refused_before_the_manifest_is_touched(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    manifest, config = tmp_path / "m.yaml", tmp_path / "bad.yaml"
    shutil.copy(ROOT / PAIRS[0][0], manifest)
    config.write_text("models: {target: {zoo: target}}\nengine: {max_batch: 0}\n")
    assert main(["serve-config", "--config", str(config), "--rayservice", str(manifest)]) != 0
    assert "engine.max_batch" in capsys.readouterr().err
    assert manifest.read_text() == (ROOT / PAIRS[0][0]).read_text()
    with pytest.raises(ConfigError, match=re.escape("expected one `serveConfigV2: |` block, found 0")):
        write_rayservice(str(config), "x: 1\n")
