"""`zplan serve`'s refusals: what it cannot serve ends with exit status 2 and one message, before anything starts.
(It serving a Hugging Face folder end to end: tests/e2e/test_hf_serving.py.)"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from zplan.cli import app


def serve(*args: str):
    return CliRunner().invoke(app, ["serve", *args])


def test_a_model_that_does_not_exist_is_refused(tmp_path):
    result = serve(str(tmp_path / "missing"), "--plan", str(tmp_path / "plan"))
    assert result.exit_code == 2, result.output
    assert "error" in result.output and "missing" in result.output
    assert not (tmp_path / "plan" / "plan.json").exists()


def test_a_context_too_short_for_one_token_is_refused(tmp_path):
    result = serve("examples/tiny.py", "--max-seq-len", "1", "--plan", str(tmp_path / "plan"))
    assert result.exit_code == 2 and "--max-seq-len 1" in result.output


def test_a_plan_folder_without_its_launch_script_is_refused(tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps({"mode": "inference"}))
    result = serve(str(tmp_path))
    assert result.exit_code == 2 and "launch/serve.sh" in result.output
