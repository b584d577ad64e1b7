"""The base of every schema that crosses a boundary: immutable, and unknown fields refused (a typo in a plan.json
or a cluster profile is an error, not a silently ignored key)."""

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
