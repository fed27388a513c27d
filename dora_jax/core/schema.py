"""A config field's one place: its type (the annotation), its default and its one-line description,
on the dataclass that holds it. `python -m dora_jax.runtime.run_config` lists every field."""

from __future__ import annotations

import dataclasses

REQUIRED = dataclasses.MISSING  # a field without a default: every config file sets it


def setting(help: str, default=REQUIRED):
    """A schema field: its default (REQUIRED: none) and its one-line description."""
    return dataclasses.field(default=default, metadata={"help": help})
