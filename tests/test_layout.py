"""The house rules (docs/architecture.md): rooms import one way, no cycles, imports at the top.

Parses every project module's imports (function-level ones too) and holds the table of allowed
directions true; a module-level cycle between project modules fails, and so does a function-level
import of anything but a heavy optional dependency.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "actors", "protos")

# room -> rooms it may import (itself always allowed)
ALLOWED = {
    "errors": set(),
    "core": {"errors"},
    "strategies": {"core", "errors"},
    "engine": {"strategies", "core", "errors"},
    "config": {"strategies", "core", "errors"},
    "models": {"core", "errors", "config"},
    "local": {"engine", "models", "config", "core", "errors"},
    "actors": {"models", "config", "core", "errors"},
    # serving/ is four rooms by concern; fronts -> control -> ops, and the client stands alone (no Ray)
    "serving.ops": {"strategies", "config", "errors", "protos"},
    "serving.control": {"serving.ops", "actors", "engine", "strategies", "models", "config", "core", "errors"},
    "serving.fronts": {"serving.control", "serving.ops", "engine", "strategies", "models", "config", "core", "errors",
                       "protos"},
    "serving.client": {"errors", "protos"},
    "family": {"models", "core", "config", "errors"},
    "bench": {"local", "serving.fronts", "serving.control", "serving.ops", "serving.client", "engine", "strategies",
              "models", "family", "config", "core", "errors"},
    "loadtest": {"serving.client", "family", "models", "config", "errors"},   # locust in worker.py only
    "cli": {"bench", "loadtest", "local", "serving.fronts", "serving.control", "serving.ops", "serving.client",
            "engine", "strategies", "models", "family", "config", "core", "errors", "actors", "protos"},
    "face": {"engine", "config", "core", "errors", "serving.client"},          # cluster/__init__.py
    "protos": set(),
}
# Dependencies that may be imported inside functions, so modules that do not need them load without.
HEAVY = {"ray", "grpc", "grpc_health", "matplotlib", "transformers", "tokenizers", "safetensors", "sacrebleu",
         "starlette", "fastapi", "google", "locust", "jsonschema", "grpc_tools"}


# cluster/__init__ hands out the gRPC client on first use, so `import cluster` needs no grpc; the load suite takes
# the coordinator (and Ray with it) only for its cluster runtime, so the gpu suite runs its in-process half on a
# lent device that has no Ray.
LAZY_FACE = {("cluster", "cluster.serving.client.sdk"), ("cluster", "cluster.serving.client.sdk.SpecServeClient"),
             ("cluster.bench.load", "cluster.serving.control.coordinator"),
             ("cluster.bench.load", "cluster.serving.control.coordinator.Coordinator")}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(mod: str) -> str:
    parts = mod.split(".")
    if parts[0] in ("actors", "protos"):
        return parts[0]
    if len(parts) == 1:
        return "face"
    if parts[1] == "serving" and len(parts) > 2:           # serving/'s four rooms
        return f"serving.{parts[2]}"
    return {"local": "local", "errors": "errors"}.get(parts[1], parts[1])


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
            if "_pb2" not in p.name}


def imports(path: Path, mod: str):
    """(imported module, is_module_level, line) for every import in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, id(node) in top, node.lineno
        elif isinstance(node, ast.ImportFrom):
            name = node.module or ""
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            # "from pkg import submodule" imports the submodule
            for a in node.names:
                yield name, id(node) in top, node.lineno
                yield f"{name}.{a.name}", id(node) in top, node.lineno


def resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


@pytest.fixture(scope="module")
def graph():
    mods = project_modules()
    edges = {}
    for mod, path in mods.items():
        edges[mod] = [(target, top, line, raw) for raw, top, line in imports(path, mod)
                      if raw.split(".")[0] in PACKAGES and (target := resolve(raw, mods)) and target != mod]
    return mods, edges


def test_imports_follow_the_room_table(graph):
    mods, edges = graph
    bad = []
    for mod, targets in edges.items():
        src = room(mod)
        for target, _, line, _ in targets:
            dst = room(target)
            if dst != src and dst not in ALLOWED[src]:
                bad.append(f"{mods[mod].relative_to(ROOT)}:{line}: {src} -> {dst} ({target})")
    assert not bad, "imports against the room table:\n" + "\n".join(sorted(set(bad)))


def test_no_import_cycles(graph):
    mods, edges = graph
    # a package's __init__ importing its own submodules is not a cycle through the package
    adj = {m: sorted({t for t, top, _, raw in e if top and not t.startswith(m + ".")}) for m, e in edges.items()}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in adj.get(m, []):
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(adj):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_function_level_imports_only_for_heavy_dependencies(graph):
    mods, _ = graph
    bad = []
    for mod, path in mods.items():
        for raw, top, line in imports(path, mod):
            if not top and raw.split(".")[0] not in HEAVY and raw.split(".")[0] != "protos" \
                    and (mod, raw) not in LAZY_FACE:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {raw}")
    assert not bad, "imports inside functions (hoist them, or explain a heavy dependency):\n" + "\n".join(
        sorted(set(bad)))


def test_modules_stay_small():
    big = [f"{p.relative_to(ROOT)}: {n}" for p in project_modules().values()
           if (n := len(p.read_text().splitlines())) > 400]
    assert not big, big


def test_core_imports_no_ray_grpc_or_transformers():
    code = ("import sys, cluster.core, cluster.core.verifiers, cluster.core.cascade_targets, "
            "cluster.core.maxgram, cluster.core.cost_model, cluster.strategies, cluster.engine; "
            "print(sorted(m for m in ('ray', 'grpc', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# -- docs/architecture.md cannot drift ---------------------------------------------------------------------
ARCH = ROOT / "docs" / "architecture.md"
_PY = re.compile(r"(?<![\w/.])`?([A-Za-z_][\w]*\.py)\b")


def _section(title: str) -> str:
    text = ARCH.read_text()
    start = text.index(f"### {title}")
    end = text.find("\n### ", start + 1)
    return text[start:end if end > 0 else None]


def _documented_rooms() -> dict[str, set[str]]:
    """{room as the table writes it (``core/``, ``errors.py``): the module names its rows give}."""
    rooms, current = {}, None
    for line in _section("The rooms").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 3 or cells[0] == "room" or (cells[0] and set(cells[0]) <= set("-")):
            continue
        current = cells[0].strip("`") or current
        rooms.setdefault(current, set()).update(_PY.findall(cells[1] + " " + cells[2]))
    return rooms


def _documented_dirs() -> dict[str, str]:
    """{top-level directory: the text of its bullet} from "The other top-level directories"."""
    out, current = {}, None
    for line in _section("The rooms").split("The other top-level directories:")[1].splitlines():
        m = re.match(r"\* `([\w.-]+)/`", line)
        if m:
            current = m.group(1)
            out[current] = line
        elif current and line.startswith("  "):
            out[current] += "\n" + line
        elif line.strip():
            current = None
    return out


def _py_files(directory: Path) -> set[str]:
    return {p.name for p in directory.glob("*.py")} - {"__init__.py"}


def test_architecture_names_every_room_and_module_there_is():
    rooms = _documented_rooms()
    on_disk = {f"{p.relative_to(ROOT / 'cluster')}/" for p in (ROOT / "cluster").rglob("*")   # sub-rooms too
               if p.is_dir() and _py_files(p)}
    on_disk |= {p.name for p in (ROOT / "cluster").glob("*.py")} - {"__init__.py"}
    assert set(rooms) == on_disk, f"rooms the page lacks: {on_disk - set(rooms)}; " \
                                  f"rooms that do not exist: {set(rooms) - on_disk}"
    for room_name, named in rooms.items():
        if not room_name.endswith("/"):
            continue
        disk = _py_files(ROOT / "cluster" / room_name)
        assert disk <= named, f"cluster/{room_name}: modules docs/architecture.md does not name: {disk - named}"
        assert named - {"__init__.py"} <= disk, f"cluster/{room_name}: named but missing: {named - disk}"


def test_architecture_names_every_directory_config_manifest_and_test_room():
    dirs = _documented_dirs()
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    top = {f.split("/")[0] for f in tracked.stdout.splitlines() if "/" in f and not f.startswith(".")} \
        if tracked.returncode == 0 else {"actors", "protos", "configs", "k8s", "tests", "docs"}
    assert top - {"cluster"} <= set(dirs), f"top-level directories the page does not name: {top - set(dirs)}"
    for name in ("actors", "protos"):
        named = set(_PY.findall(dirs[name]))
        assert _py_files(ROOT / name) == named - {"__init__.py"}, (name, _py_files(ROOT / name) ^ named)
    for name, pattern in (("configs", "*.yaml"), ("k8s", "**/*.*"), ("docs", "*.md")):
        disk = {str(p.relative_to(ROOT / name)) for p in (ROOT / name).glob(pattern) if p.is_file()}
        named = set(re.findall(r"`([\w./-]+\.(?:yaml|json|md))`", dirs[name]))
        assert disk == named, f"{name}/: on disk, not named: {disk - named}; named, not on disk: {named - disk}"
    test_rooms = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"}
    named = set(re.findall(r"`(\w+)/", dirs["tests"].split("\n", 1)[1]))
    assert test_rooms == named, f"tests/: rooms not named: {test_rooms - named}; named, missing: {named - test_rooms}"
    for path in re.findall(r"`(support/\w+\.py)`", dirs["tests"]):
        assert (ROOT / "tests" / path).is_file(), path


# -- the prose claims are held to the code ------------------------------------------------------------------
_ROOM_CELL = {"local.py": "local", "cluster/__init__.py": "face"}


def _import_table(text: str, heading_line: str) -> dict[str, set[str]]:
    """{room: rooms it may import} from the markdown table that follows ``heading_line`` in ``text``."""
    lines = text[text.index(heading_line):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        allowed = re.sub(r"\([^)]*\)", "", cells[1])               # parenthesised remarks are prose
        if "nothing" in allowed:
            rooms = set()
        elif "every" in allowed:
            rooms = {"every"}
        else:
            rooms = {w.strip().strip("`") for w in allowed.split(",") if w.strip()}
        for name in re.findall(r"`([^`]+)`", cells[0]):
            table[_ROOM_CELL.get(name, name)] = rooms
    return table


def _expected(room_name: str, written: set[str]) -> set[str]:
    return set(ALLOWED) - {room_name, "face"} if written == {"every"} else written


def test_the_import_table_of_the_docs_is_the_rule_the_layout_test_enforces():
    """docs/architecture.md holds the one copy of the room table (README links to it)."""
    arch = _import_table(ARCH.read_text(), "### Which room may import which")
    assert set(arch) == set(ALLOWED), f"docs/architecture.md rows: {set(arch) ^ set(ALLOWED)}"
    bad = {r: sorted(_expected(r, arch[r]) ^ ALLOWED[r]) for r in arch if _expected(r, arch[r]) != ALLOWED[r]}
    assert not bad, f"docs/architecture.md's import table differs from tests/test_layout.py's ALLOWED: {bad}"


_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
_DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bthis stop\b|\ba stop (later|before)\b|\buntil [0-9a-f]{7}", re.I)


def test_docs_stay_pages_for_their_readers():
    """README is read to the end (at most 250 lines), a docs page is a page (at most 900); neither they nor the
    configs carry commit hashes, dates or run logs, and config comments carry no measured ratios (docs/results.md
    holds measured tables, rendered from the benchmarks' output by ``specserve results``)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages[0].read_text().splitlines()) <= 250, "README.md over 250 lines"
    long = {p.name: n for p in pages[1:] if (n := len(p.read_text().splitlines())) > 900}
    assert not long, f"docs pages over 900 lines: {long}"
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    bad = [f"{p.relative_to(ROOT)}:{i}: {m.group(0)!r}" for p in pages + configs
           for i, line in enumerate(p.read_text().splitlines(), 1) for rx in (_HASH, _DATED) for m in rx.finditer(line)]
    bad += [f"{p.relative_to(ROOT)}:{i}: {m.group(0)!r}" for p in configs
            for i, line in enumerate(p.read_text().splitlines(), 1) if "#" in line
            for m in re.finditer(r"\b\d+(?:\.\d+)?x\b", line.split("#", 1)[1])]
    assert not bad, bad


def test_the_face_row_names_what_cluster_exports():
    import cluster
    row = next(line for line in _section("Which room may import which").splitlines()
               if line.startswith("| `cluster/__init__.py`"))
    assert set(re.findall(r"`(\w+)`", row.split("|")[3])) == set(cluster.__all__), row


def test_the_composition_roots_are_the_modules_that_assemble_a_model_set():
    named = set(re.findall(r"^\* `cluster/([\w/]+\.py)`", _section("Two composition roots").split("\n\n", 2)[2],
                           flags=re.M))
    assembling = {str(p.relative_to(ROOT / "cluster")) for p in (ROOT / "cluster").rglob("*.py")
                  if re.search(r"\bModelSet(\.assemble)?\(", p.read_text()) and p.name != "model_set.py"}
    assert named == assembling == {"local.py", "serving/control/unit.py"}, (named, assembling)


def test_algorithm_docstrings_carry_no_run_numbers():
    """Measured ratios and timings go stale; they live in docs/ and the benchmarks' output."""
    ratio = re.compile(r"\b\d+(?:\.\d+)?x\b|measured[^.]*?\b\d+(?:\.\d+)? ?ms\b")
    bad = []
    for room_name in ("core", "strategies", "engine"):
        for p in sorted((ROOT / "cluster" / room_name).glob("*.py")):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node) or ""
                    bad += [f"{p.relative_to(ROOT)}: {m.group(0)!r}" for m in ratio.finditer(doc)]
    assert not bad, bad
