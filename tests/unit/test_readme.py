"""The README stays true: its config table matches the code, and it starts with the two commands."""

from __future__ import annotations

from pathlib import Path

from grpo_fleet.config import config_reference_markdown
from grpo_fleet.metrics import actor_metrics, learner_metrics

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_config_table_is_the_generated_reference():
    assert config_reference_markdown() in README.read_text()


def test_readme_starts_with_demo_and_test_commands():
    text = README.read_text()
    first_block = text.split("```bash", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in first_block.strip().splitlines()] == ["make demo", "make test"]


def test_readme_names_every_exported_metric():
    text = README.read_text()
    for registry in (learner_metrics().registry, actor_metrics().registry):
        for family in registry.collect():
            # The table abbreviates siblings of one row as `_suffix`.
            suffix = "_" + family.name.split("_learner_")[-1].split("_actor_")[-1]
            assert f"`{family.name}" in text or f"`{suffix}" in text, f"README does not mention {family.name}"
