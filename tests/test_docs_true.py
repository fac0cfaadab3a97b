"""The documentation states what the code does: checked against the code, so it cannot drift.

- docs/errors.md lists every HTTP status and error code the package can answer (each
  ``ServiceError(...)`` / ``bad_request(...)`` in ``rollout_service/``, and the ``code`` values
  computed next to them), and 507 ``store_full``.
- Every ``ROLLOUT_SERVICE_*`` environment variable the package reads is documented.
- The README's ``-k`` example selects a real test.
- The Redis Cluster URL the docs show is one ``parse_redis_url`` takes for a cluster, and no doc
  presents a plain ``redis://`` URL as a cluster's.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import rollout_service

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(rollout_service.__file__).parent
DOCS = ROOT / "docs"


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def answered_errors() -> tuple[set[int], set[str]]:
    """Statuses and codes of every ServiceError / bad_request the package builds. A code given as a
    name (``code=code``) is resolved to the string constants assigned to that name in the module."""
    statuses, codes = set(), set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        assigned: dict[str, set[str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        assigned.setdefault(target.id, set()).update(_strings(node.value))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name not in ("ServiceError", "bad_request") or (name == "ServiceError" and not node.args):
                continue
            if name == "ServiceError" and isinstance(node.args[0], ast.Constant):
                statuses.add(node.args[0].value)
            if name == "bad_request":
                statuses.add(400)
            code = {k.arg: k.value for k in node.keywords}.get("code")
            if code is None and name == "bad_request" and len(node.args) >= 3:
                code = node.args[2]
            if isinstance(code, ast.Constant) and code.value:
                codes.add(code.value)
            elif isinstance(code, ast.Name) and code.id in assigned:
                codes |= {c for c in assigned[code.id] if re.fullmatch(r"[a-z][a-z_]*", c)}  # codes are snake_case
    return statuses, codes


def test_every_answered_status_and_code_is_in_the_error_reference():
    text = (DOCS / "errors.md").read_text()
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in text.splitlines()
            if line.startswith("| ") and line[2:5].isdigit()]
    documented_statuses = {int(row[0]) for row in rows}
    documented_codes = {row[2].strip("`") for row in rows}
    statuses, codes = answered_errors()
    assert statuses and codes
    assert statuses <= documented_statuses, f"undocumented statuses: {statuses - documented_statuses}"
    assert codes <= documented_codes, f"undocumented codes: {codes - documented_codes}"
    assert ["507", "`server_error`", "`store_full`"] in [row[:3] for row in rows]


def test_every_environment_variable_the_package_reads_is_documented():
    used = set()
    for path in PACKAGE.rglob("*.py"):
        used |= set(re.findall(r"\bROLLOUT_SERVICE_[A-Z_]+\b", path.read_text()))
    docs = (ROOT / "README.md").read_text() + "".join(p.read_text() for p in DOCS.glob("*.md"))
    assert {"ROLLOUT_SERVICE_TINY_MODEL", "ROLLOUT_SERVICE_REDIS_URL"} <= used
    assert sorted(v for v in used if f"`{v}`" not in docs) == []


def test_the_readmes_test_selection_example_selects_a_test():
    (keyword,) = re.findall(r"e\.g\. -k (\w+)", (ROOT / "README.md").read_text())
    names = re.findall(r"def (test_\w+)", "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py")))
    assert any(keyword in name for name in names), keyword


def test_the_documented_redis_cluster_url_is_a_cluster_url():
    from rollout_service.store.urls import parse_redis_url

    docs = {p.name: p.read_text() for p in [ROOT / "README.md", *DOCS.glob("*.md")]}
    examples = {url for text in docs.values() for url in re.findall(r"redis\+cluster://[^\s`'\"),]+", text)}
    assert examples, "no Redis Cluster URL example in the docs"
    assert all(parse_redis_url(url)[1] for url in examples)
    for name, text in docs.items():
        for paragraph in re.split(r"\n\s*\n|\n- ", text):
            if "Cluster" in paragraph and "`redis://" in paragraph and "redis+cluster://" not in paragraph:
                raise AssertionError(f"{name}: a plain redis:// URL next to Redis Cluster: {paragraph[:300]}")
