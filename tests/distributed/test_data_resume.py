"""train.py --data across a resume under another data-parallel size (gloo): 2 steps at dp 2 with a checkpoint, then
2 more at dp 1 from it. The model records the token ids of every training forward, each row mapped back to its
sequence by slicing the token file here; no sequence may be seen twice or skipped, and the resumed steps must see
the global batches of the uninterrupted run. --val-data's loss is checked against the saved weights evaluated here,
and a resume with another seed (another order) is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.distributed.harness import Ranks, emit, import_file, read_log, train_args
from tests.distributed.test_checkpoint import GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN, TINY_GPT, VOCAB, make_plan
from zplan.runtime.data.token_file import write_token_file

pytestmark = pytest.mark.slow

SEED, LR, STEPS = 3, 3e-3, 4
EVAL_BATCHES = 2
# the tiny GPT of the checkpoint tests, recording each training forward's ids to RECORD_DIR/<pid>.txt (one row a line)
RECORDING_GPT = TINY_GPT + '''

_forward = TinyGPT.forward


def _recorded(self, idx):
    if self.training and os.environ.get("RECORD_DIR"):
        with open(os.path.join(os.environ["RECORD_DIR"], f"{os.getpid()}.txt"), "a") as f:
            f.writelines(",".join(map(str, row)) + "\\n" for row in idx.tolist())
    return _forward(self, idx)


TinyGPT.forward = _recorded
'''


def sequence_rows(tokens: np.ndarray) -> dict[tuple[int, ...], int]:
    """Each packed sequence's ids -> its index: sequence i is tokens[i*(T-1) : i*(T-1)+T] (docs/runtime.md)."""
    count = (len(tokens) - 1) // (SEQ_LEN - 1)
    return {tuple(int(t) for t in tokens[i * (SEQ_LEN - 1): i * (SEQ_LEN - 1) + SEQ_LEN]): i for i in range(count)}


def recorded_steps(folder: Path, rows: dict, micro_batches_per_step: int) -> list[list[list[int]]]:
    """[rank file][step] -> the sequence ids it trained on, for each file in `folder` (a rank's pid)."""
    out = []
    for path in sorted(folder.glob("*.txt")):
        ids = [rows[tuple(int(t) for t in line.split(","))] for line in path.read_text().splitlines()]
        per_step = micro_batches_per_step * MICRO_BATCH
        out.append([ids[i:i + per_step] for i in range(0, len(ids), per_step)])
    return out


def test_resume_under_another_dp_sees_each_sequence_once(tmp_path):
    model = tmp_path / "tiny_gpt.py"
    model.write_text(RECORDING_GPT)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, 60 * (SEQ_LEN - 1) + 1)  # 60 sequences: 4 steps of 8 stay in one epoch
    val = rng.integers(0, VOCAB, 20 * (SEQ_LEN - 1) + 1)
    for path, ids in ((tmp_path / "train.bin", tokens), (tmp_path / "val.bin", val)):
        write_token_file(path, [ids], dtype="uint16", vocab_size=VOCAB, separator=None, tokenizer=None, documents=None)
    rows = sequence_rows(tokens)
    assert len(rows) == 60  # random rows of 16 ids: all distinct
    data = ["--data", str(tmp_path / "train.bin")]

    # dp 2: steps 1-4, checkpoints after 2 and 4, validation after 2 and 4
    first = emit(make_plan(model, zero_stage=1, dp=2), model, tmp_path / "dp2")
    (tmp_path / "rec2").mkdir()
    log2 = tmp_path / "dp2" / "log.jsonl"
    Ranks([str(first), *train_args(STEPS, SEED, LR, log2), *data, "--checkpoint-dir", str(tmp_path / "ck2"),
           "--checkpoint-every", "2", "--val-data", str(tmp_path / "val.bin"), "--eval-every", "2",
           "--eval-batches", str(EVAL_BATCHES), "--save-weights", str(tmp_path / "w.pt")], 2, tmp_path / "logs",
          env={"RECORD_DIR": str(tmp_path / "rec2")}).wait_ok()
    ranks = recorded_steps(tmp_path / "rec2", rows, GLOBAL_BATCH // (2 * MICRO_BATCH))
    assert len(ranks) == 2 and all(len(steps) == STEPS for steps in ranks)
    uninterrupted = [ranks[0][s] + ranks[1][s] for s in range(STEPS)]  # which rank file is rank 0 does not matter
    flat = [i for step in uninterrupted for i in step]
    assert len(set(flat)) == STEPS * GLOBAL_BATCH  # no sequence twice in an epoch
    state = json.loads((tmp_path / "ck2" / "step-000002" / "train_state.json").read_text())
    assert state["data"]["sequences_consumed"] == 2 * GLOBAL_BATCH and state["data"]["identity"]["seed"] == SEED

    # dp 1 from step 2: steps 3-4 see the uninterrupted run's global batches
    second = emit(make_plan(model, zero_stage=1, dp=1), model, tmp_path / "dp1")
    (tmp_path / "rec1").mkdir()
    resume = ["--checkpoint-dir", str(tmp_path / "ck1"), "--resume", str(tmp_path / "ck2" / "step-000002")]
    Ranks([str(second), *train_args(STEPS, SEED, LR, tmp_path / "dp1" / "log.jsonl"), *data, *resume], 1,
          tmp_path / "logs", env={"RECORD_DIR": str(tmp_path / "rec1")}).wait_ok()
    (resumed,) = recorded_steps(tmp_path / "rec1", rows, GLOBAL_BATCH // MICRO_BATCH)
    assert len(resumed) == 2
    assert [sorted(step) for step in resumed] == [sorted(step) for step in uninterrupted[2:]]
    seen = [i for step in uninterrupted[:2] + resumed for i in step]
    assert len(seen) == len(set(seen)) == STEPS * GLOBAL_BATCH  # none twice, none skipped
    state = json.loads((tmp_path / "ck1" / "step-000004" / "train_state.json").read_text())
    assert state["data"]["sequences_consumed"] == STEPS * GLOBAL_BATCH

    # another seed is another order: refused, with the flag that allows it named
    refused = Ranks([str(second), *train_args(STEPS, SEED + 1, LR, tmp_path / "x.jsonl"), *data, *resume[2:]], 1,
                    tmp_path / "logs")
    assert refused.wait() == 2
    assert "--allow-other-data" in refused.output() and "seed" in refused.output()

    # validation: the mean next-token loss of the first EVAL_BATCHES global batches of val.bin, in file order, under
    # the final weights (evaluated here, one process, batches of MICRO_BATCH as each rank's micro-batches)
    records = read_log(log2)
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    net = import_file(model, "tiny_gpt_reference").build_model()
    net.load_state_dict(torch.load(tmp_path / "w.pt"))
    net.eval()
    val_rows = torch.tensor(np.array(list(sequence_rows(val))[:EVAL_BATCHES * GLOBAL_BATCH]))  # (n, T)
    with torch.no_grad():
        losses = [F.cross_entropy(net(part)[:, :-1].reshape(-1, VOCAB), part[:, 1:].reshape(-1)).item()
                  for part in val_rows.split(MICRO_BATCH)]
    expected = sum(losses) / len(losses)
    assert abs(records[-1]["val_loss"] - expected) < 1e-5
    assert abs(records[-1]["val_ppl"] - np.exp(expected)) < 1e-3
