"""render_outputs: the files, their determinism, plan.json round trip, report.html as Chromium draws it."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.plan_samples import sample_alternatives, sample_plan
from zplan.codegen import render
from zplan.schemas.alternatives import Alternatives
from zplan.schemas.plan import Plan

CHROMIUM = Path("/usr/bin/chromium")
REPORT_FILES = {"plan.json", "alternatives.json", "report.md", "report.html", "ds_config.json"}
CHART_IDS = ("chart-memory", "chart-time", "chart-pipeline", "chart-pareto")


def _tree(root: Path) -> dict[str, bytes]:
    files = sorted(path for path in root.rglob("*") if path.is_file())
    return {str(path.relative_to(root)): path.read_bytes() for path in files}


@pytest.mark.parametrize("name", ["gpt3-175b", "tiny-dp"])
def test_same_plan_renders_byte_identical_files(name, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    written = render.render_outputs(sample_plan(name), first, "model.py", sample_alternatives(name))
    render.render_outputs(sample_plan(name), second, "model.py", sample_alternatives(name))

    assert REPORT_FILES <= {path.name for path in written}
    assert all(path.is_file() and path.parent.is_relative_to(first) for path in written)
    assert _tree(first) == _tree(second)


def test_output_does_not_depend_on_the_hash_seed(tmp_path):
    """Set or dict iteration that leaked into a file would differ between interpreters."""
    render.render_outputs(sample_plan("gpt3-175b"), tmp_path, "model.py", sample_alternatives("gpt3-175b"))
    other = tmp_path / "other"
    other.mkdir()
    program = ("import sys; from pathlib import Path; from tests.plan_samples import sample_alternatives, sample_plan; "
               "from zplan.codegen.render import render_outputs; "
               "render_outputs(sample_plan('gpt3-175b'), Path(sys.argv[1]), 'model.py', "
               "sample_alternatives('gpt3-175b'))")
    subprocess.run([sys.executable, "-c", program, str(other)], check=True, timeout=60,
                   cwd=Path(__file__).resolve().parents[2], env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert _tree(other) == {name: data for name, data in _tree(tmp_path).items() if not name.startswith("other")}


def test_plan_json_round_trips(tmp_path):
    plan, search = sample_plan("gpt3-175b"), sample_alternatives("gpt3-175b")
    render.render_outputs(plan, tmp_path, None, search)
    text = (tmp_path / "plan.json").read_text()
    assert text.endswith("}\n")
    assert Plan.model_validate_json(text) == plan
    assert Alternatives.model_validate_json((tmp_path / "alternatives.json").read_text()) == search


def test_missing_script_module_is_skipped_but_its_errors_are_not(tmp_path, monkeypatch):
    def missing(name):
        raise ModuleNotFoundError(f"No module named '{name}'", name=name)

    monkeypatch.setattr(render.importlib, "import_module", missing)
    written = render.render_outputs(sample_plan("tiny-dp"), tmp_path, None, sample_alternatives("tiny-dp"))
    assert {path.name for path in written} == REPORT_FILES

    def broken(name):
        raise ModuleNotFoundError("No module named 'not_installed'", name="not_installed")

    monkeypatch.setattr(render.importlib, "import_module", broken)
    with pytest.raises(ModuleNotFoundError, match="not_installed"):
        render.render_outputs(sample_plan("tiny-dp"), tmp_path, None)


def test_html_is_self_contained():
    html = render.render_reports(sample_plan("gpt3-175b"))["report.html"]
    assert not re.search(r"""(src|href)\s*=|@import|url\(|<link|<script""", html, re.IGNORECASE)
    assert set(re.findall(r"https?://[^\s\"'<>]+", html)) == {"http://www.w3.org/2000/svg"}
    for chart_id in CHART_IDS:
        assert html.count(f'id="{chart_id}"') == 1


def test_plan_text_is_escaped_in_html():
    search = sample_alternatives("tiny-dp", assumptions=[{"name": "<b>bold</b>", "value": "a & b", "source": "s"}])
    html = render.render_reports(sample_plan("tiny-dp"), search)["report.html"]
    assert "&lt;b&gt;bold&lt;/b&gt;" in html and "a &amp; b" in html
    assert "<b>bold</b>" not in html


class _MarksPerChart(HTMLParser):
    """Counts the drawn elements inside each <svg id=...> of a DOM dump."""

    def __init__(self):
        super().__init__()
        self.current: str | None = None
        self.marks: dict[str, Counter] = {}
        self.titles: Counter = Counter()

    def handle_starttag(self, tag, attrs):
        if tag == "svg":
            self.current = dict(attrs).get("id")
            self.marks[self.current] = Counter()
        elif self.current is not None:
            self.marks[self.current][tag] += 1

    def handle_endtag(self, tag):
        if tag == "svg":
            self.current = None


def _chromium(*args: str, user_data_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={user_data_dir}", *args],
        capture_output=True, text=True, timeout=60, check=True,
    )


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed")
def test_charts_are_drawn_in_headless_chromium(tmp_path):
    plan, search = sample_plan("gpt3-175b"), sample_alternatives("gpt3-175b")
    out = tmp_path / "out"
    out.mkdir()
    render.render_outputs(plan, out, None, search)
    dom = _chromium("--dump-dom", (out / "report.html").as_uri(), user_data_dir=tmp_path / "profile").stdout

    parser = _MarksPerChart()
    parser.feed(dom)
    marks = parser.marks
    assert set(CHART_IDS) <= set(marks)
    assert marks["chart-memory"]["rect"] >= 1 + 6  # free-memory track + one segment per part
    assert marks["chart-time"]["rect"] >= 7 + 2 * 7  # stacked bar + track and bar per part
    parallel = plan.parallel
    drawn_slots = 2 * parallel.pp * parallel.interleave * 16  # forward + backward, capped at 16 micro-batches
    assert marks["chart-pipeline"]["rect"] >= parallel.pp + drawn_slots
    assert marks["chart-pareto"]["circle"] >= 1 + len(search.alternatives)
    assert marks["chart-pareto"]["path"] == 1  # the Pareto front
    assert all(marks[chart_id]["title"] > 0 for chart_id in CHART_IDS)


def test_the_script_runs_plan_json_and_shows_it_for_review(tmp_path):
    """train.py holds no plan constants that could drift from plan.json: it applies the plan it loads
    (runtime/plan/apply.py), and shows the plan as comments."""
    from zplan.codegen.script import render_script_files
    from zplan.runtime.training.main import run_training  # torch: imported by the tests that run the runtime only

    plan = sample_plan("tiny-dp", parallel={"zero_stage": 2})
    render_script_files(plan, tmp_path, "tiny.py")
    code = (tmp_path / "train.py").read_text()
    assert "train_main(" in code  # the run it hands its constants to (runtime/training/main.py)
    assert "parallelize(model, weights, mesh, plan, model_file, ctx.device)" in inspect.getsource(run_training)
    assert "ZERO_STAGE" not in code and "TP_PLAN" not in code and "MICRO_BATCH" not in code
    assert "#   ZeRO stage       2 (" in code
    compile(code, "train.py", "exec")


@pytest.mark.parametrize(("zero", "weights_first"), [(0, True), (1, True), (2, False), (3, False)])
def test_parallelize_makes_the_weights_where_the_zero_stage_says(zero, weights_first, monkeypatch):
    """ZeRO 0/1 replicate parameters (DDP needs real tensors): weights before apply_data_parallel; ZeRO 2/3
    shard them (FSDP2 on the meta model): after, so each rank makes only its shards."""
    import zplan.runtime.plan.apply as plan_apply

    calls = []
    for step in ("apply_experts", "apply_tensor_parallel", "apply_recompute", "apply_pipeline",
                 "disable_generation_cache", "apply_data_parallel", "materialize_weights"):
        monkeypatch.setattr(plan_apply, step, lambda model, *args, _step=step, **kwargs: calls.append(_step) or model)
    plan = sample_plan("tiny-dp", parallel={"zero_stage": zero})
    model_file = SimpleNamespace(loss_fn=None, example_inputs=lambda micro_batch, seq_len: None)
    plan_apply.parallelize("model", None, {"tp": None, "pp": None, "dp": None}, plan, model_file, "cpu")
    replicated = ["materialize_weights", "apply_data_parallel"]
    assert calls == ["apply_experts", "apply_tensor_parallel", "apply_recompute", "apply_pipeline",
                     "disable_generation_cache", *(replicated if weights_first else replicated[::-1])]
