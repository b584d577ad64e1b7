"""The digest of a plan: what train.py records of the plan.json it was written with (codegen) and checks against
the plan.json it finds (runtime.plan.origin)."""

from __future__ import annotations

import hashlib

from pydantic import BaseModel


def plan_digest(plan: BaseModel) -> str:
    """SHA-256 of the plan's canonical JSON (independent of the file's layout), 64 hex digits."""
    return hashlib.sha256(plan.model_dump_json().encode()).hexdigest()
