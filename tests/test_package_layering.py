"""The planes stay apart: a newcomer can change one without reading the others.

Rules, read from the source (every import, including the lazy ones inside functions):

- ``onpolicy/`` (the pure core) imports no Ray, Redis, HTTP framework or other package of ours.
- ``weights/`` (the wire protocol shared by the engine worker and the trainer) imports no other
  package of ours, and what the trainer imports of it (``collective``, ``staging``) no Ray.
- ``engine/`` imports none of the fleet, the data plane, the control plane, the store or operations.
- ``fleet/`` imports none of the data plane, the control plane, the store or operations;
  ``fleet/health.py`` is a pure state machine (no Ray, nothing of ours).
- The data plane (``serve/``) and the store never import the control plane (``refit/``) or operations.
- The control plane reads the fleet through its types and the fleet actor, never through the data
  plane's client (``fleet/client.py``), and never imports the data plane.
- ``training/`` (what a trainer imports) imports no other plane, no Ray, vLLM or Redis.
- ``canary/`` (the parity canary, run by the data plane) imports none of the data plane, the control
  plane, the store or operations; its recompute and figures (``recompute.py``, ``stats.py``) no Ray
  or vLLM. The engine and the fleet never import it.
- ``models/`` (the default model, the tiny one, built on first use) imports nothing else of ours:
  ``config`` resolves its default model there.
- No plane imports operations (``ops/``: the launcher, runtime, CLI, demo), nor does ``config`` or
  ``metrics``.
- Floors (the README's Layout names them, a line each; read from there): a module imports only
  modules of its own floor or a lower one. Every plane and top-level module is on one floor.
- No import cycle, between packages or between modules.
- No module imports another module's ``_private`` name, or reads one off a module of ours it
  imported (package, tests and scripts alike); ``__dunder__`` names are not private.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "rollout_service"
PLANES = ("onpolicy", "weights", "engine", "fleet", "serve", "store", "refit", "ops", "training", "canary", "models")
TOP_MODULES = ("config", "metrics")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every module a file imports: ``from a.b import c`` counts as ``a.b.c`` when that is a module of
    ours (``from rollout_service.serve import app``), else as ``a.b``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            for a in node.names:
                if is_module(f"{node.module}.{a.name}"):
                    names.add(f"{node.module}.{a.name}")
    return names


def is_module(name: str) -> bool:
    if not name.startswith("rollout_service"):
        return False
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def plane_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "rollout_service" or len(parts) < 2:
        return None
    return parts[1]


def package_files() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def files_of(plane: str) -> list[Path]:
    return sorted((PKG / plane).rglob("*.py"))


def test_every_plane_is_a_folder():
    assert [p for p in PLANES if not (PKG / p / "__init__.py").is_file()] == []
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert top == ["__init__.py", "config.py", "metrics.py"], f"modules outside a plane: {top}"


def forbidden(plane: str, banned_planes: set[str], banned_tops: set[str] = frozenset()) -> list[str]:
    found = []
    for path in files_of(plane):
        for name in imports_of(path):
            if plane_of(name) in banned_planes or name.split(".")[0] in banned_tops:
                found.append(f"{path.relative_to(PKG)} imports {name}")
    return found


def test_the_core_is_pure():
    others = set(PLANES) - {"onpolicy"} | {"config", "metrics"}
    assert forbidden("onpolicy", others, {"ray", "redis", "fastapi", "starlette", "httpx"}) == []


def test_the_weights_wire_protocol_stands_alone():
    assert len(files_of("weights")) >= 3
    others = set(PLANES) - {"weights"} | {"config", "metrics"}
    assert forbidden("weights", others, {"redis", "fastapi"}) == []
    # What a trainer imports needs no Ray (the worker extension runs inside vLLM's worker).
    for name in ("collective.py", "staging.py"):
        assert not [n for n in imports_of(PKG / "weights" / name) if n.split(".")[0] == "ray"], name


def test_the_engine_knows_nothing_above_it():
    assert forbidden("engine", {"fleet", "serve", "refit", "store", "ops", "onpolicy", "canary"}) == []


def test_the_fleet_knows_nothing_above_it():
    assert forbidden("fleet", {"serve", "refit", "store", "ops", "onpolicy", "canary"}) == []
    names = imports_of(PKG / "fleet" / "health.py")
    assert not [n for n in names if n.split(".")[0] in ("ray", "vllm", "torch") or plane_of(n)], names


def test_data_plane_and_store_never_import_the_control_plane_or_operations():
    assert forbidden("serve", {"refit", "ops"}) == []
    assert forbidden("store", {"refit", "ops", "serve", "fleet", "engine"}) == []


def test_the_control_plane_reads_the_fleet_through_its_types():
    bad = [f"{p.relative_to(PKG)} imports {n}" for p in files_of("refit") for n in imports_of(p)
           if n in ("rollout_service.fleet.client",) or plane_of(n) in ("serve", "ops")]
    assert bad == []


def test_the_training_helpers_stand_alone():
    others = set(PLANES) - {"training"} | {"config", "metrics"}
    assert forbidden("training", others, {"ray", "vllm", "redis", "fastapi", "httpx"}) == []


def test_the_canary_sits_beside_the_data_plane():
    assert forbidden("canary", {"serve", "refit", "store", "ops", "onpolicy"}) == []
    for name in ("recompute.py", "stats.py"):
        assert not [n for n in imports_of(PKG / "canary" / name) if n.split(".")[0] in ("ray", "vllm", "torch")], name


def test_the_default_model_stands_alone():
    assert forbidden("models", set(PLANES) - {"models"} | set(TOP_MODULES)) == []


def test_no_plane_imports_operations():
    tops = [PKG / f"{name}.py" for name in TOP_MODULES]
    bad = [f"{p.relative_to(PKG)} imports {n}" for p in [*tops, *(f for plane in PLANES if plane != "ops"
                                                                  for f in files_of(plane))]
           for n in imports_of(p) if plane_of(n) == "ops"]
    assert bad == []


def readme_floors(text: str) -> dict[str, int]:
    """``{plane or top-level module: floor}`` from the ``- floor N: a, b`` lines of the README's Layout."""
    layout = text.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    return {name.strip().strip("`"): int(n) for n, names in re.findall(r"^- floor (\d+): (.+)$", layout, re.M)
            for name in names.split(",")}


FLOORS = readme_floors((ROOT / "README.md").read_text())


def module_graph() -> dict[str, set[str]]:
    """Every module of the package and the modules of ours it imports (lazy imports included)."""
    return {module_name(path): {n for n in imports_of(path) if is_module(n)} for path in package_files()}


def upward_imports(graph: dict[str, set[str]], floors: dict[str, int]) -> list[str]:
    """The imports from a module to a module of a higher floor (by the module's plane or top-level name)."""
    return [f"{mod} imports {dep} (floor {floors[plane_of(mod)]} -> {floors[plane_of(dep)]})"
            for mod, deps in sorted(graph.items()) for dep in sorted(deps)
            if plane_of(mod) in floors and plane_of(dep) in floors and floors[plane_of(dep)] > floors[plane_of(mod)]]


def test_every_plane_and_top_level_module_is_on_one_floor():
    text = (ROOT / "README.md").read_text()
    lines = re.findall(r"^- floor (\d+): (.+)$", text.split("\n## Layout", 1)[1].split("\n## ", 1)[0], re.M)
    named = [name.strip() for _, names in lines for name in names.split(",")]
    assert sorted(named) == sorted(set(named)), "a name on two floors"
    assert set(FLOORS) == set(PLANES) | set(TOP_MODULES)
    assert [int(n) for n, _ in lines] == list(range(len(lines))), "floors are numbered 0, 1, ... lowest first"


def test_no_module_imports_a_module_of_a_higher_floor():
    graph = module_graph()
    assert len(graph) > 100 and all(plane_of(m) in FLOORS for m in graph if m != "rollout_service")
    assert upward_imports(graph, FLOORS) == []


def test_upward_imports_are_found():
    floors = {"low": 0, "mid": 1, "high": 2}
    graph = {"rollout_service.low.a": {"rollout_service.high.b"}, "rollout_service.mid.c": {"rollout_service.low.a",
             "rollout_service.mid.d"}, "rollout_service.high.b": {"rollout_service.mid.c"}}
    assert upward_imports(graph, floors) == ["rollout_service.low.a imports rollout_service.high.b (floor 0 -> 2)"]
    assert readme_floors("# x\n## Layout\n\n- floor 0: low, `mid`\n- floor 1: high\n\n## Next\n- floor 2: no\n") == \
        {"low": 0, "mid": 0, "high": 1}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycles_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_between_modules():
    # A package's __init__ re-exporting its modules is not a dependency of those modules on it.
    graph: dict[str, set[str]] = {}
    for path in package_files():
        mod = module_name(path)
        graph[mod] = {n for n in imports_of(path) if is_module(n) and n != mod
                      and not mod.startswith(n + ".") and not (path.name == "__init__.py" and n.startswith(mod + "."))}
    assert cycles(graph) == []


def test_no_import_cycle_between_planes():
    graph: dict[str, set[str]] = {}
    for path in package_files():
        plane = plane_of(module_name(path))
        if plane not in PLANES:
            continue
        for name in imports_of(path):
            dep = plane_of(name)
            if dep in PLANES and dep != plane:
                graph.setdefault(plane, set()).add(dep)
    assert cycles(graph) == [], graph


def private_reaches(path: Path) -> list[str]:
    """``from rollout_service.x import _name`` and ``alias._name`` where ``alias`` is a module of ours."""
    here = module_name(path) if path.is_relative_to(PKG) else None
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    tree = ast.parse(path.read_text())
    aliases: set[str] = set()
    found = []

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rollout_service"):
            for a in node.names:
                if is_module(f"{node.module}.{a.name}"):
                    aliases.add(a.asname or a.name)
                elif private(a.name) and node.module != here:
                    found.append(f"{where}:{node.lineno} imports {node.module}.{a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("rollout_service"):
                    aliases.add(a.asname or a.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                found.append(f"{where}:{node.lineno} reads {ast.unparse(node)}")
    return found


def test_no_module_reaches_into_another_modules_private_names():
    files = package_files() + sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))
    assert len(files) > 100
    assert [f for path in files for f in private_reaches(path)] == []


def test_private_reaches_are_found(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from rollout_service.onpolicy.echo import _x\nfrom rollout_service.serve import app\napp._Guard\n")
    assert private_reaches(probe) == [f"{probe}:1 imports rollout_service.onpolicy.echo._x", f"{probe}:3 reads app._Guard"]
