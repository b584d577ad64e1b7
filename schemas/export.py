"""Write the committed JSON Schemas: `python -m zplan.schemas.export` (a test fails when they are stale)."""

from __future__ import annotations

import json
from pathlib import Path

from zplan.schemas.alternatives import Alternatives, InferenceAlternatives
from zplan.schemas.cluster import ClusterSpec
from zplan.schemas.inference import InferencePlan
from zplan.schemas.plan import Plan

JSON_DIR = Path(__file__).resolve().parent / "json"
SCHEMAS = {"plan.schema.json": Plan, "cluster.schema.json": ClusterSpec,
           "inference_plan.schema.json": InferencePlan, "alternatives.schema.json": Alternatives,
           "inference_alternatives.schema.json": InferenceAlternatives}


def schema_text(model) -> str:
    return json.dumps(model.model_json_schema(), indent=2, sort_keys=True) + "\n"


def main() -> None:
    JSON_DIR.mkdir(exist_ok=True)
    for name, model in SCHEMAS.items():
        (JSON_DIR / name).write_text(schema_text(model))
        print(f"wrote {JSON_DIR / name}")


if __name__ == "__main__":
    main()
