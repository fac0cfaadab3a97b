"""The planes stay apart: a newcomer can change one without reading the others.

Rules (read from the source, every import including the lazy ones inside functions):

- ``onpolicy/`` (the pure core) imports no Ray, Redis, HTTP framework or other package of ours
  except ``protocol``-free helpers of its own.
- The data plane (``serve/`` except the ``up`` launcher, which composes everything) and the engine
  fleet (``fleet/``) and the engine (``engine/``) never import the control plane (``refit/``).
- ``fleet/health.py`` is a pure state machine: no Ray at all.
- No import cycle between our packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "rollout_service"


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def package_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "rollout_service" or len(parts) < 2:
        return None
    return parts[1]


def modules(package: str) -> list[Path]:
    return sorted((PKG / package).glob("*.py"))


def test_the_core_is_pure():
    for path in modules("onpolicy"):
        for name in imports_of(path):
            top = name.split(".")[0]
            assert top not in ("ray", "redis", "fastapi", "starlette", "httpx"), f"{path.name} imports {name}"
            assert package_of(name) in (None, "onpolicy"), f"{path.name} imports {name}"


def test_data_plane_fleet_and_engine_never_import_the_control_plane():
    checked = [p for pkg in ("serve", "fleet", "engine") for p in modules(pkg) if p.name != "launcher.py"]
    assert len(checked) > 8
    for path in checked:
        bad = [n for n in imports_of(path) if package_of(n) == "refit"]
        assert not bad, f"{path.relative_to(PKG)} imports the control plane: {bad}"


def test_fleet_health_is_a_pure_state_machine():
    names = imports_of(PKG / "fleet" / "health.py")
    assert not [n for n in names if n.split(".")[0] in ("ray", "vllm", "torch") or package_of(n)], names


def test_no_import_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG)
        if len(rel.parts) < 2 or (rel.parts[0] == "serve" and rel.name == "launcher.py"):
            continue  # top-level modules (cli, config) and the launcher compose the packages
        pkg = rel.parts[0]
        for name in imports_of(path):
            dep = package_of(name)
            if dep and dep != pkg and (PKG / dep).is_dir():
                graph.setdefault(pkg, set()).add(dep)

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == target or (nxt not in seen and reaches(nxt, target, seen | {nxt})):
                return True
        return False

    cycles = sorted(pkg for pkg in graph if reaches(pkg, pkg, {pkg}))
    assert not cycles, f"packages in an import cycle: {cycles}; graph: {graph}"
