"""Which compile a plan.json comes from: train.py runs the plan.json beside it, which must be the one `zplan compile`
wrote with it (or that plan edited), and a plan made for another model says so.

train.py records what its plan was made for (the fingerprint: model file and its SHA-256, cluster, world size) and
the plan's digest (schemas.digest.plan_digest). Before check_plan, check_plan_origin refuses a plan.json of another
compile (another fingerprint: copied from another folder, or recompiled without this train.py) and a --model file that
is another model than the plan's (another name and other bytes: check_plan would call it an edit), and returns a note
when plan.json was edited since (the same fingerprint, another digest): the run goes on with the edited plan, which
check_plan checks, and says that train.py's review table shows the plan as compiled.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from zplan.errors import PlanMismatchError
from zplan.schemas.digest import plan_digest


def _made_for(fingerprint: dict) -> str:
    return (f"{fingerprint['model_ref']} (sha256 {fingerprint['model_sha256'][:12]}...) on "
            f"{fingerprint['world_size']} x {fingerprint['cluster']}")


def check_plan_origin(plan, compiled_for: dict, compiled_digest: str, model_path: str | Path | None) -> str | None:
    """PlanMismatchError when `plan` (read from plan.json) is not the plan the script was written with
    (`compiled_for`: its fingerprint as a dict, `compiled_digest`: its plan_digest) or `model_path` is another
    model than the plan's; a note (str) when the plan was edited since; None when it is the compiled plan."""
    found = plan.fingerprint.model_dump()
    if found != compiled_for:
        kind = "another model" if found["model_sha256"] != compiled_for["model_sha256"] else "another compile"
        raise PlanMismatchError(
            f"plan.json beside this train.py was made for {kind}: {_made_for(found)}, while this train.py was "
            f"written for {_made_for(compiled_for)}. Put back the plan.json `zplan compile` wrote with this "
            "train.py, or run the train.py written with that plan")
    if model_path is not None and Path(model_path).is_file() and plan.model.source != "family":
        digest = hashlib.sha256(Path(model_path).read_bytes()).hexdigest()
        if digest != found["model_sha256"] and Path(model_path).name != Path(found["model_ref"]).name:
            raise PlanMismatchError(
                f"{model_path} is another model than the plan's, which was made for {_made_for(found)}: compile "
                f"{model_path} (`zplan compile {model_path} --gpus N`) and run the train.py written for it")
    if plan_digest(plan) != compiled_digest:
        return ("plan.json was edited since zplan wrote this train.py: the run follows plan.json as it is now (checked "
                "below); the review table in train.py shows the plan as compiled")
    return None
