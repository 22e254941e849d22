"""Adoption basics: the license a legal team reads (LICENSE, pyproject's SPDX field) and ``specserve --version``."""
from __future__ import annotations

import hashlib
import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_license_is_apache_2_full_text_and_declared():
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text and "END OF TERMS AND CONDITIONS" in text
    # the text of https://www.apache.org/licenses/LICENSE-2.0.txt, whitespace aside
    assert hashlib.sha256(" ".join(text.split()).encode()).hexdigest() == \
        "0ffddef9e48f8a09aed5caf2d44f7ba1c1be2d9b8e0a6f693b1635b2d5566645"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]


def test_version_flag_prints_the_distributions_version():
    out = subprocess.run([sys.executable, "-m", "cluster.cli.main", "--version"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    want = importlib.metadata.version("specserve")
    assert out.stdout.strip() == f"specserve {want}"
    assert want == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
