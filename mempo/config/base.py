"""The base of every params section (kept apart so the section modules and the loader share it)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base for every section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def default_of(section: type[BaseModel], name: str) -> Any:
    """The default of field `name` of a params section: what a plain dataclass that mirrors
    the section (the verl workers' settings) takes as its own default, so there is one."""
    field = section.model_fields[name]
    return field.get_default(call_default_factory=True)
