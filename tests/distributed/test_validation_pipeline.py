"""train.py --val-data under pipeline parallel (2 processes, gloo, fp32): the stages' forward-only evaluation
(runtime.parallel.pipeline.PipelineRun.evaluate) against one process, and training left as it was.

- pp 2, 1F1B, dropout 0.1: the last val_loss equals the saved weights' loss over the same validation batches in one
  process in eval mode (so dropout was off), and a run without --val-data logs the same training losses and ends with
  the same weights, bit for bit (so evaluating drew no random numbers and touched no gradient or schedule state).
- pp 2, interleaved 1F1B (2 chunks a rank), no dropout: val_loss after steps 2 and 4 equals that of dp 2 (pp 1) from
  the same seed, which trains the same weights (tests/distributed/test_data_parallel.py), and the one-process loss of
  its final weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.distributed.harness import Ranks, emit, import_file, read_log, train_args
from tests.distributed.test_checkpoint import GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN, TINY_GPT, VOCAB, make_plan
from tests.plan_samples import gpt_unit_names
from zplan.runtime.data.token_file import write_token_file
from zplan.schemas import Plan, Stage

pytestmark = pytest.mark.slow

SEED, LR, STEPS = 5, 3e-3, 4
EVAL_EVERY, EVAL_BATCHES = 2, 2
VAL_SEQUENCES = 20  # >= EVAL_BATCHES * GLOBAL_BATCH (16)


def pipeline_plan(model_path: Path, *, interleave: int) -> Plan:
    """The tiny GPT (tied head) on pp 2, dp 1, 4 micro-batches of 2: 1F1B cut after blocks.0, or interleaved 1F1B
    with 4 stages (wte+wpe | blocks.0 | blocks.1 | ln_f+head; stage s on rank s % 2)."""
    units = gpt_unit_names(2)  # wte, wpe, blocks.0, blocks.1, ln_f, head
    groups = [units[:3], units[3:]] if interleave == 1 else [units[:2], units[2:3], units[3:4], units[4:]]
    base = make_plan(model_path, zero_stage=0, dp=1)
    stages, first = [], 0
    for index, names in enumerate(groups):
        stages.append(Stage(index=index, first_layer=first, last_layer=first + len(names) - 1, layer_names=names,
                            fwd_flops_per_sample=0.0, params=0))
        first += len(names)
    parallel = base.parallel.model_copy(update=dict(pp=2, interleave=interleave,
                                                    schedule="interleaved-1f1b" if interleave > 1 else "1f1b"))
    fingerprint = base.fingerprint.model_copy(update=dict(world_size=2))
    return base.model_copy(update=dict(parallel=parallel, stages=stages, fingerprint=fingerprint))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("validation")
    (folder / "tiny_gpt.py").write_text(TINY_GPT)
    ids = np.random.default_rng(0).integers(0, VOCAB, VAL_SEQUENCES * (SEQ_LEN - 1) + 1)  # packed: T - 1 apart
    write_token_file(folder / "val.bin", [ids], dtype="uint16", vocab_size=VOCAB, separator=None, tokenizer=None,
                     documents=None)
    return {"model": folder / "tiny_gpt.py", "val": folder / "val.bin", "ids": ids}


def run(plan: Plan, files: dict, out: Path, *, dropout: float, validate: bool) -> tuple[list[dict], Path]:
    """train.py of `plan` on 2 processes, synthetic training data from SEED; (its log records, its saved weights)."""
    script = emit(plan, files["model"], out)
    log, weights = out / "log.jsonl", out / "weights.pt"
    evaluation = ["--val-data", str(files["val"]), "--eval-every", str(EVAL_EVERY),
                  "--eval-batches", str(EVAL_BATCHES)] if validate else []
    Ranks([str(script), *train_args(STEPS, SEED, LR, log), "--save-weights", str(weights), *evaluation], 2,
          out / "logs", env={"TINY_GPT_DROPOUT": str(dropout)}).wait_ok()
    return read_log(log), weights


def one_process_val_loss(files: dict, weights: Path) -> float:
    """The mean next-token loss of the first EVAL_BATCHES global batches of val.bin (in file order) under `weights`,
    one process in eval mode, micro-batches of MICRO_BATCH sequences as each rank's."""
    net = import_file(files["model"], "tiny_gpt_validation_reference").build_model()
    net.load_state_dict(torch.load(weights))
    net.eval()
    ids = files["ids"]
    rows = torch.tensor(np.stack([ids[i * (SEQ_LEN - 1): i * (SEQ_LEN - 1) + SEQ_LEN]
                                  for i in range(EVAL_BATCHES * GLOBAL_BATCH)]).astype(np.int64))  # (16, T)
    with torch.no_grad():
        losses = [F.cross_entropy(net(part)[:, :-1].reshape(-1, VOCAB), part[:, 1:].reshape(-1)).item()
                  for part in rows.split(MICRO_BATCH)]
    return sum(losses) / len(losses)


def val_losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}


def test_pipeline_validation_is_the_one_process_loss_and_leaves_training_alone(files, tmp_path):
    plan = pipeline_plan(files["model"], interleave=1)
    evaluated, weights = run(plan, files, tmp_path / "val", dropout=0.1, validate=True)
    plain, plain_weights = run(plan, files, tmp_path / "plain", dropout=0.1, validate=False)
    assert list(val_losses(evaluated)) == [2, 4]
    expected = one_process_val_loss(files, weights)
    print(f"pp 2 1F1B, dropout 0.1: val_loss {evaluated[-1]['val_loss']:.6f}, one process {expected:.6f}")
    assert abs(evaluated[-1]["val_loss"] - expected) < 1e-5
    assert abs(evaluated[-1]["val_ppl"] - np.exp(expected)) < 1e-3
    # evaluating changed nothing of training: the same losses and weights as without it, bit for bit
    assert [r["loss"] for r in evaluated] == [r["loss"] for r in plain]
    trained, untouched = torch.load(weights), torch.load(plain_weights)
    assert trained.keys() == untouched.keys()
    assert all(torch.equal(trained[name], untouched[name]) for name in trained)


def test_interleaved_pipeline_validation_matches_data_parallel(files, tmp_path):
    piped, weights = run(pipeline_plan(files["model"], interleave=2), files, tmp_path / "pp", dropout=0.0,
                         validate=True)
    data_parallel, _ = run(make_plan(files["model"], zero_stage=0, dp=2), files, tmp_path / "dp", dropout=0.0,
                           validate=True)
    got, expected = val_losses(piped), val_losses(data_parallel)
    print(f"pp 2 interleaved: val_loss {got}; dp 2: {expected}")
    assert list(got) == list(expected) == [2, 4]
    assert all(abs(got[step] - expected[step]) < 1e-5 for step in expected)
    assert abs(got[STEPS] - one_process_val_loss(files, weights)) < 1e-5
