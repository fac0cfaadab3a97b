"""Every field of RolloutServiceConfig is read by the package: none is set in a YAML and ignored.

The check walks the whole config model and looks, in the AST of every module of
``rollout_service``, for a read of each field on an expression known to hold that section: a
parameter annotated with the model, a name or ``self.<attr>`` assigned from one, a section
attribute of a typed config (``cfg.refit``), ``Model(...)`` / ``Model.model_validate(...)`` /
``model_copy()``, or a call of a function annotated to return one. Reads inside the config's own
validators do not count (checking a value is not honouring it); its other methods do
(``EngineConfig.resolved_model`` reads ``model``).

Allow-list: fields read by a name this check cannot follow. Each entry states how it is read, and
the test checks that claim, so an entry cannot outlive the code that justified it.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel

import rollout_service
from rollout_service.config import RolloutServiceConfig

PACKAGE = Path(rollout_service.__file__).parent
MODELS: dict[str, type[BaseModel]] = {RolloutServiceConfig.__name__: RolloutServiceConfig}
for _f in RolloutServiceConfig.model_fields.values():
    MODELS[_f.annotation.__name__] = _f.annotation
SECTIONS = {name: f.annotation.__name__ for name, f in RolloutServiceConfig.model_fields.items()}
CONSTRUCTORS = {"model_validate", "from_args", "from_yaml", "model_copy", "model_construct"}


def _copied_into_health_policy(field: str) -> bool:
    """fleet.health_policy builds HealthPolicy with getattr(fleet_config, k) for each of its fields
    (a name the AST check cannot follow); the fleet (its modules) and its health state machine read them
    as ``policy.<k>``."""
    import inspect

    from rollout_service.fleet.fleet import health_policy
    from rollout_service.fleet.health import HealthPolicy

    fleet_code = "".join(path.read_text() for path in sorted((PACKAGE / "fleet").glob("*.py")))
    return (field in HealthPolicy.__dataclass_fields__ and "getattr(fc, k)" in inspect.getsource(health_policy)
            and f"policy.{field}" in fleet_code)


ALLOWED = {
    # FleetConfig's probing and health thresholds reach the fleet as HealthPolicy's fields of the same names.
    **{f"fleet.{k}": _copied_into_health_policy for k in (
        "probe_interval_s", "probe_timeout_s", "dead_after_failures", "unresponsive_after_s", "start_timeout_s",
        "backoff_initial_s", "backoff_max_s", "max_replacements", "replacement_window_s")},
}


def _annotation_model(node: ast.AST | None) -> str | None:
    """The config model named by an annotation (``EngineConfig``, ``"EngineConfig | None"``, ...)."""
    if node is None:
        return None
    text = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ast.unparse(node)
    found = [m for m in MODELS if m in {t.strip() for t in text.replace("|", " ").replace("[", " ").replace("]", " ").split()}]
    return found[0] if len(found) == 1 else None


def _returns() -> dict[str, str]:
    """Functions and methods anywhere in the package annotated to return a config model, by name."""
    out: dict[str, str] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                model = _annotation_model(node.returns)
                if model:
                    out[node.name] = model
    return out


class _Reads(ast.NodeVisitor):
    """Collects ``(model, field)`` reads in one module, with a flow-insensitive type map per scope."""

    def __init__(self, returns: dict[str, str]):
        self.returns = returns
        self.reads: set[tuple[str, str]] = set()
        self.self_attrs: dict[str, str] = {}  # self.<attr> -> model, per class
        self.names: dict[str, str] = {}  # local / module names -> model
        self.class_model: str | None = None
        self.class_scope = False  # directly in a class body (not in one of its functions)

    def type_of(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            if node.id == "self" and self.class_model:
                return self.class_model
            return self.names.get(node.id)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in self.self_attrs:
                return self.self_attrs[node.attr]
            base = self.type_of(node.value)
            if base == RolloutServiceConfig.__name__ and node.attr in SECTIONS:
                return SECTIONS[node.attr]
            return None
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                return func.id if func.id in MODELS else self.returns.get(func.id)
            if isinstance(func, ast.Attribute):
                if func.attr in CONSTRUCTORS:
                    if isinstance(func.value, ast.Name) and func.value.id in MODELS:
                        return func.value.id
                    return self.type_of(func.value) if func.attr == "model_copy" else None
                return self.returns.get(func.attr)
        if isinstance(node, ast.IfExp):
            return self.type_of(node.body) or self.type_of(node.orelse)
        if isinstance(node, ast.BoolOp):
            types = {self.type_of(v) for v in node.values} - {None}
            return types.pop() if len(types) == 1 else None
        return None

    # -- scopes
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        outer = (self.self_attrs, self.class_model)
        self.self_attrs = {}
        self.class_model = node.name if node.name in MODELS else None
        # Two passes: attribute types first (assigned in __init__ or anywhere), then reads.
        for _ in range(2):
            self.class_scope = True
            self.generic_visit(node)
        self.self_attrs, self.class_model = outer
        self.class_scope = False

    def _function(self, node) -> None:
        if any("validator" in ast.unparse(d) for d in node.decorator_list):
            return  # a validator checks a value; it does not honour it
        outer, scope = dict(self.names), self.class_scope
        self.class_scope = False
        for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
            model = _annotation_model(arg.annotation)
            if model:
                self.names[arg.arg] = model
        for _ in range(2):  # names assigned later in the body are known on the second pass
            for stmt in node.body:
                self.visit(stmt)
        self.names, self.class_scope = outer, scope

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Assign(self, node: ast.Assign) -> None:
        model = self.type_of(node.value)
        if model:
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self.names[target.id] = model
                elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                    self.self_attrs[target.attr] = model
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        model = _annotation_model(node.annotation) or (self.type_of(node.value) if node.value else None)
        if model and isinstance(node.target, ast.Name):
            self.names[node.target.id] = model
            if self.class_scope:  # a class body's annotation types the instance attribute (a mixin's)
                self.self_attrs[node.target.id] = model
        if model and isinstance(node.target, ast.Attribute) and ast.unparse(node.target.value) == "self":
            self.self_attrs[node.target.attr] = model
        self.generic_visit(node)

    # -- reads
    def visit_Attribute(self, node: ast.Attribute) -> None:
        model = self.type_of(node.value)
        if model and isinstance(node.ctx, ast.Load):
            self.reads.add((model, node.attr))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2:
            model, name = self.type_of(node.args[0]), node.args[1]
            if model and isinstance(name, ast.Constant):
                self.reads.add((model, name.value))
        self.generic_visit(node)


@lru_cache(maxsize=1)
def package_reads() -> frozenset[tuple[str, str]]:
    returns = _returns()
    reads: set[tuple[str, str]] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        visitor = _Reads(returns)
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        reads |= visitor.reads
    return frozenset(reads)


def config_fields() -> list[tuple[str, str, str]]:
    """``(dotted name, model, field)`` for every leaf field of the config."""
    out = []
    for section, info in RolloutServiceConfig.model_fields.items():
        model = info.annotation
        out += [(f"{section}.{name}", model.__name__, name) for name in model.model_fields]
    return out


def test_every_config_field_is_read_by_the_package():
    reads = package_reads()
    unread = [dotted for dotted, model, field in config_fields() if (model, field) not in reads and dotted not in ALLOWED]
    assert unread == [], f"config fields nothing in rollout_service reads: {unread} (honour or remove them)"


def test_every_allow_listed_field_is_read_the_way_its_entry_says():
    fields = {dotted for dotted, _, _ in config_fields()}
    reads = package_reads()
    for dotted, claim in ALLOWED.items():
        assert dotted in fields, f"allow-list names a field that does not exist: {dotted}"
        assert claim(dotted.split(".", 1)[1]), f"{dotted}: the allow-list's reason no longer holds"
        model = SECTIONS[dotted.split(".")[0]]
        assert (model, dotted.split(".", 1)[1]) not in reads, f"{dotted} is read directly now: drop its entry"


def test_the_check_sees_a_field_nobody_reads():
    """The check itself: a module that reads a field makes it read; the bare field name elsewhere does not."""
    reads = package_reads()
    assert ("RefitConfig", "bucket_bytes") in reads  # TrainerClient._resolve, from the controller's config
    assert ("EngineConfig", "weight_transfer_backend") in reads  # EngineReplica.engine_args
    visitor = _Reads({})
    visitor.visit(ast.parse(
        "def f(bucket_bytes, cfg: RolloutServiceConfig, other):\n"
        "    x = other.bucket_bytes + bucket_bytes\n"          # not a config: not a read
        "    refit = cfg.refit\n"
        "    return refit.lease_s\n"))
    assert visitor.reads == {("RolloutServiceConfig", "refit"), ("RefitConfig", "lease_s")}
