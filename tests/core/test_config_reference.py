"""docs/configuration.md is the config model written out: a key added, removed or
changed in vllm_graft/core/config.py without regenerating the page fails here."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from vllm_graft.core.config_reference import markdown

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_committed_reference_is_the_config_model_written_out():
    assert PAGE.read_text() == markdown(), (
        "docs/configuration.md is stale: python -m vllm_graft.core.config_reference "
        "> docs/configuration.md")


def test_every_key_needs_a_meaning():
    class Section(BaseModel):
        """A section."""

        described: int = Field(1, description="has one")
        undescribed: int = 2

    with pytest.raises(ValueError, match="Section.undescribed has no description"):
        markdown(Section, "section")


def test_nested_sections_get_tables_of_their_own():
    page = markdown()
    for section in ("graft", "graft.guard", "graft.isolation", "graft.context",
                    "graft.successor_state"):
        assert f"## `{section}`" in page
    assert "| `budget` | `\"auto\"` |" in page
