"""Generate the field reference of docs/configuration.md from ``RolloutServiceConfig``.

The table sits between two marker lines in docs/configuration.md; everything outside them is
hand-written and left alone. tests/test_config_docs.py fails when the committed table differs
from what this script generates, so the reference cannot drift from the model.

    python scripts/gen_config_docs.py           # rewrite the table in place
    python scripts/gen_config_docs.py --check   # exit 1 if the committed table is stale
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from rollout_service.config import RolloutServiceConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
BEGIN = "<!-- BEGIN GENERATED: scripts/gen_config_docs.py -->"
END = "<!-- END GENERATED: scripts/gen_config_docs.py -->"


def type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " \\| ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in args)}]"
    if annotation is type(None):
        return "null"
    if annotation is typing.Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{json.dumps(value)}`"


def constraints(field: Any) -> str:
    symbols = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    found = [f"{symbols[k]} {getattr(m, k)}" for m in field.metadata for k in symbols if hasattr(m, k)]
    return ", ".join(found)


def rows(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str, str, str]]:
    out = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out += rows(annotation, f"{path}.")
            continue
        description = (field.description or "(no description in the model)").replace("|", "\\|").replace("\n", " ")
        out.append((f"`{path}`", type_name(annotation), default_text(field), constraints(field), description))
    return out


def table() -> str:
    lines = [
        BEGIN,
        "",
        "| Field | Type | Default | Range | Description |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {p} | {t} | {d} | {c} | {desc} |" for p, t, d, c, desc in rows(RolloutServiceConfig)]
    lines += ["", END]
    return "\n".join(lines)


def render(document: str) -> str:
    start, end = document.index(BEGIN), document.index(END) + len(END)
    return document[:start] + table() + document[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is stale")
    args = parser.parse_args(argv)
    current = DOC.read_text()
    wanted = render(current)
    if args.check:
        if current != wanted:
            print(f"{DOC} is stale: run python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
