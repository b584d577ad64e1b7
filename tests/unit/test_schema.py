"""The committed JSON Schemas are current, and a compiled plan.json validates against them."""

import json
from pathlib import Path

import jsonschema

from zplan.api import compile_with_alternatives, prepare
from zplan.planner.clusters import BUILTIN_CLUSTERS
from zplan.schemas.alternatives import Alternatives
from zplan.schemas.export import JSON_DIR, SCHEMAS, schema_text
from zplan.schemas.plan import Plan
from zplan.schemas.spec import Pins


def test_committed_schemas_are_current():
    for name, model in SCHEMAS.items():
        committed = (JSON_DIR / name).read_text()
        assert committed == schema_text(model), f"{name} is stale: run `python -m zplan.schemas.export`"


def test_compiled_plan_validates_against_the_committed_schema():
    plan, search = compile_with_alternatives(prepare("gpt:layers=4,hidden=256,heads=8,seq=128,vocab=1000", 8,
                                                     "dgx-a100-80g", 16, None, "bf16", Pins()))
    schema = json.loads((JSON_DIR / "plan.schema.json").read_text())
    jsonschema.validate(json.loads(plan.model_dump_json()), schema)
    assert Plan.model_validate_json(plan.model_dump_json()) == plan
    # its search, alternatives.json, against its own schema, naming the plan it goes with
    schema = json.loads((JSON_DIR / "alternatives.schema.json").read_text())
    jsonschema.validate(json.loads(search.model_dump_json()), schema)
    assert Alternatives.model_validate_json(search.model_dump_json()) == search
    assert search.fingerprint == plan.fingerprint and search.alternatives and search.candidates_evaluated > 0
    assert "alternatives" not in json.loads(plan.model_dump_json())


def test_builtin_clusters_validate_and_round_trip():
    schema = json.loads((JSON_DIR / "cluster.schema.json").read_text())
    for spec in BUILTIN_CLUSTERS.values():
        jsonschema.validate(json.loads(spec.model_dump_json()), schema)
        assert type(spec).model_validate_json(spec.model_dump_json()) == spec


def test_schema_dir_is_inside_the_package():
    assert (Path(JSON_DIR).parent / "__init__.py").exists()
