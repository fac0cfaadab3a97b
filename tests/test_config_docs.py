"""docs/configuration.md's field table is generated from RolloutServiceConfig and must stay so."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pydantic import BaseModel

from rollout_service.config import RolloutServiceConfig

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_configuration_reference_matches_the_model():
    gen = _generator()
    committed = gen.DOC.read_text()
    assert committed == gen.render(committed), "docs/configuration.md is stale: run python scripts/gen_config_docs.py"


def test_every_config_field_has_a_row():
    gen = _generator()
    text = gen.DOC.read_text()

    def leaves(model, prefix):
        for name, field in model.model_fields.items():
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                yield from leaves(sub, f"{prefix}{name}.")  # a nested section: a row per field of it
            else:
                yield f"{prefix}{name}"

    names = list(leaves(RolloutServiceConfig, ""))
    assert "engine.sim.decode_step_s" in names
    for name in names:
        assert f"| `{name}` |" in text


def test_check_mode_reports_a_stale_table(tmp_path, monkeypatch):
    gen = _generator()
    stale = tmp_path / "configuration.md"
    stale.write_text(gen.DOC.read_text().replace("| `engine.num_engines` |", "| `engine.num_engine` |"))
    monkeypatch.setattr(gen, "DOC", stale)
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0
    assert gen.main(["--check"]) == 0
