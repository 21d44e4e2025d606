"""The configuration reference (``docs/configuration.md``), written from the config model
itself: one table per section (key, default, meaning), so the page cannot drift from the
code (a test compares the committed page with this output).

    python -m vllm_graft.core.config_reference > docs/configuration.md
"""

from __future__ import annotations

import json
import re
import sys
from enum import Enum
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from vllm_graft.core.config import GraftConfig

HEADER = """# Configuration reference

Every key of the `graft` section of the speculative config, with its default and what it
does; all are optional. Written by `python -m vllm_graft.core.config_reference` from
`vllm_graft/core/config.py` (a test fails when this page and the code disagree).
"""


def shown(value: Any) -> str:
    """A default as it is written in the JSON config."""
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, BaseModel):
        return "(section below)"
    if isinstance(value, tuple):
        value = [v.value if isinstance(v, Enum) else v for v in value]
    return f"`{json.dumps(value)}`"


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a key whose value is a section (``X`` or ``X | None``)."""
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def default_of(field) -> str:
    extra = field.json_schema_extra or {}
    if "shown_default" in extra:
        return f"`{extra['shown_default']}`"
    if field.default_factory is not None:
        return shown(field.default_factory())
    if field.default is PydanticUndefined:
        return "(required)"
    return shown(field.default)


def table(model: type[BaseModel], prefix: str) -> tuple[list[str], list[tuple[str, type]]]:
    """The rows of one section, and the sections nested in it."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    nested = []
    for name, field in model.model_fields.items():
        if not field.description:
            raise ValueError(f"{model.__name__}.{name} has no description: the reference "
                             f"needs one for every key")
        meaning = " ".join(field.description.split()).replace("|", "\\|")
        rows.append(f"| `{name}` | {default_of(field)} | {meaning} |")
        inner = section_model(field.annotation)
        if inner is not None:
            nested.append((f"{prefix}.{name}", inner))
    return rows, nested


def rst_to_markdown(text: str) -> str:
    """A docstring's inline markup as Markdown: ``x`` and :role:`x` become `x`."""
    return re.sub(r":\w+:`", "`", text.replace("``", "`"))


def markdown(model: type[BaseModel] = GraftConfig, name: str = "graft") -> str:
    lines = [HEADER]
    pending = [(name, model)]
    while pending:
        path, section = pending.pop(0)
        rows, nested = table(section, path)
        summary = rst_to_markdown(" ".join(
            (section.__doc__ or "").strip().split("\n\n")[0].split()))
        lines += [f"## `{path}`", "", summary, "", *rows, ""]
        pending += nested
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown())
