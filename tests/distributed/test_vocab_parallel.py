"""The vocabulary split over tensor parallel (plan.parallel.vocab_parallel: runtime/parallel/vocab_parallel.py) trains
as one process does.

Five tiny models (MODELS), three of them with a vocabulary tp does not divide and three with a tied head, each with
one of the ways to the loss: the runtime's default next-token loss, a model file's loss_fn of F.cross_entropy on the
logits reshaped to (B*T, V), and a Hugging Face model's outputs.loss (transformers' ForCausalLMLoss, computed in its
forward from the batch's labels). Each is compiled in this process with each configuration's pins (CONFIGS), the
plan's vocab_parallel set True (so that these runs do not hang on the planner's choice), and trained STEPS steps by its
emitted train.py; vocab_parallel_worker.py runs the plans of one world size in one launch. Against a plain torch loop
in this process (the model from `torch.manual_seed(SEED); build_model()`, the whole global batch of the same tokens at
once, torch's AdamW with the planner's defaults under the same schedule and clipping; no zplan runtime code): the loss
of every step and every final weight within 1e-5 (fp32), the embedding and head tables whole in --save-weights. Each
rank reports the parameters of V rows that its live DTensors split over tp, so a run that left them replicated fails.

Besides: GPT's dp 2 x tp 2 ZeRO-1 run writes checkpoints; a tp 1 plan (ZeRO-3 over dp 4) resumes its step-2 one and
must see the losses of steps 3 and 4 and end at the weights the split run ended at, and `zplan export` of its last
checkpoint holds the whole tables, equal to its --save-weights. The validation loss (--val-data) after the last step
is the one-process model's, for the models that train on token ids. The dry run (fake tensors, a fake process group)
runs two of the plans. One launch of 2 processes and one of 4 (about a minute on two cores).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.distributed.harness import Ranks, import_file, max_loss_diff, max_weight_diff, read_log
from zplan.runtime.data.token_file import write_token_file
from zplan.runtime.training.data import synthetic_token_batch
from zplan.runtime.training.loop import WarmupCosine
from zplan.schemas import Pins, Plan
from zplan.schemas.spec import ADAMW_DEFAULTS, GRAD_CLIP

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

GLOBAL_BATCH, SEQ_LEN = 4, 16
STEPS, SEED, LR = 4, 5, ADAMW_DEFAULTS["lr"]  # train.py's default learning rate, 3e-4
TOLERANCE = 1e-5  # fp32: the loss of every step and every final weight
VAL_SEQUENCES, VAL_VOCAB = GLOBAL_BATCH, 250  # --val-data: one global batch, ids every model's vocabulary holds
WORKER = Path(__file__).with_name("vocab_parallel_worker.py")

MODELS = {
    # the runtime's default loss; the head tied to the embedding; 251 rows: 126 and 125 a rank at tp 2
    "gpt": '''"""examples/gpt.py, tiny."""
from zplan.examples import gpt

VOCAB_SIZE = 251
SEQ_LEN = 16


def build_model():
    return gpt.build_model(num_layers=2, hidden=64, heads=4, vocab_size=VOCAB_SIZE, max_seq_len=SEQ_LEN)
''',
    # its own loss: F.cross_entropy on the logits reshaped to (B*T, V)
    "llama": '''"""examples/llama.py, tiny, with its own loss."""
import torch.nn.functional as F
from zplan.examples import llama

VOCAB_SIZE = 256
SEQ_LEN = 16


def build_model():
    return llama.build_model(num_layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab_size=VOCAB_SIZE)


def loss_fn(outputs, batch):
    return F.cross_entropy(outputs[:, :-1].reshape(-1, VOCAB_SIZE), batch[:, 1:].reshape(-1))
''',
    # the runtime's default loss on a Hugging Face output object; an untied head
    "hf_llama": '''"""A tiny Hugging Face Llama."""
from transformers import AutoModelForCausalLM, LlamaConfig

VOCAB_SIZE = 250
SEQ_LEN = 16


def build_model():
    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.0))
''',
    # a training script's hooks: batches of input_ids and labels, the model's own loss from its forward; tied, uneven
    "hf_qwen2": '''"""A tiny Hugging Face Qwen2 with a training script's hooks: the model's own loss from the labels."""
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

VOCAB_SIZE = 255
SEQ_LEN = 16


def build_model():
    return AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, attention_dropout=0.0))


def _batch(ids):
    return {"input_ids": ids, "labels": ids}


def example_inputs(batch_size, seq_len):
    return _batch(torch.zeros(batch_size, seq_len, dtype=torch.long))


def train_data(batch_size, seq_len, seed=0):
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield _batch(torch.randint(0, VOCAB_SIZE, (batch_size, seq_len), generator=generator))


def loss_fn(outputs, batch):
    return outputs.loss  # transformers' shifted next-token cross-entropy from the labels
''',
    # its own loss on outputs.logits; Conv1D projections, a fused c_attn, the head tied; 257 rows: 129 and 128
    "hf_gpt2": '''"""A tiny Hugging Face GPT-2 with its own loss."""
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GPT2Config

VOCAB_SIZE = 257
SEQ_LEN = 16


def build_model():
    return AutoModelForCausalLM.from_config(GPT2Config(
        vocab_size=VOCAB_SIZE, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def loss_fn(outputs, batch):
    logits = outputs.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
''',
}
TABLES = {"gpt": ("wte.weight", "lm_head.weight"), "llama": ("embed.weight", "lm_head.weight"),
          "hf_llama": ("model.embed_tokens.weight", "lm_head.weight"),
          "hf_qwen2": ("model.embed_tokens.weight", "lm_head.weight"),
          "hf_gpt2": ("transformer.wte.weight", "lm_head.weight")}  # (embedding, head) of each model

# configuration -> (world size, pins); micro_batch 2: two micro-batches a step (dp 1), gradients accumulated
CONFIGS = {"tp2": (2, Pins(tp=2, sequence_parallel=False, micro_batch=2)),
           "tp2sp": (2, Pins(tp=2, sequence_parallel=True, micro_batch=2)),
           "tp2pp2": (4, Pins(tp=2, pp=2, sequence_parallel=False, micro_batch=2)),
           "dp2tp2zero1": (4, Pins(tp=2, dp=2, zero=1, sequence_parallel=False, micro_batch=1)),
           "dp2tp2zero3": (4, Pins(tp=2, dp=2, zero=3, sequence_parallel=False, micro_batch=1))}
ONLY = {"dp2tp2zero1": ("gpt",), "dp2tp2zero3": ("gpt",)}  # FSDP2 and ZeRO-1 over dp: the tied, uneven table
CASES = [(name, config) for config in CONFIGS for name in ONLY.get(config, MODELS)]
# writes checkpoints (ZeRO-1's moments of the uneven table: tp blocks of 126 and 125 rows, each cut over dp); RESUMED,
# a tp 1 plan on as many processes (FSDP2 over dp 4), resumes its step-2 one
CHECKPOINTED = ("gpt", "dp2tp2zero1")
RESUMED = (4, Pins(tp=1, dp=4, zero=3))
HOOKS = ("hf_qwen2",)  # train on their own batches (a train_data hook): no --val-data of token ids


def compile_for(model: Path, world: int, pins: Pins, out: Path, vocab_parallel: bool) -> Plan:
    """`zplan compile MODEL --gpus WORLD --cluster cpu-local --global-batch 4 --seq 16 --precision fp32 PINS -o OUT`
    in this process, parallel.vocab_parallel then set as given (the emitted train.py records the plan it is written
    with)."""
    from zplan.api import compile_plan, prepare, write_outputs

    plan = compile_plan(prepare(str(model), world, "cpu-local", GLOBAL_BATCH, SEQ_LEN, "fp32", pins))
    plan = plan.model_copy(update={"parallel": plan.parallel.model_copy(update={"vocab_parallel": vocab_parallel})})
    write_outputs(plan, out, str(model))
    return plan


def train_args(out: Path, *extra: str) -> list[str]:
    return ["--steps", str(STEPS), "--seed", str(SEED), "--lr", str(LR), "--log-json", str(out / "log.jsonl"),
            "--save-weights", str(out / "weights.pt"), *extra]


def validation_rows(root: Path) -> tuple[Path, torch.Tensor]:
    """A --val-data token file of VAL_SEQUENCES packed sequences (SEQ_LEN - 1 apart) and those sequences, (N, T)."""
    ids = np.random.default_rng(0).integers(0, VAL_VOCAB, VAL_SEQUENCES * (SEQ_LEN - 1) + 1)
    write_token_file(root / "val.bin", [ids], dtype="uint16", vocab_size=VAL_VOCAB, separator=None, tokenizer=None,
                     documents=None)
    rows = np.stack([ids[i * (SEQ_LEN - 1): i * (SEQ_LEN - 1) + SEQ_LEN] for i in range(VAL_SEQUENCES)])
    return root / "val.bin", torch.tensor(rows.astype(np.int64))


class Runs:
    """Every case compiled, and the cases of each world size trained in one launch on first use."""

    def __init__(self, models: dict[str, Path], root: Path):
        self.root, self.plans, self.out = root, {}, {}
        self.jobs: dict[int, list] = {}
        self.outputs: dict[int, str] = {}
        val_data, self.val_rows = validation_rows(root)
        for name, config in CASES:
            world, pins = CONFIGS[config]
            out = root / f"{name}-{config}"
            self.plans[name, config] = compile_for(models[name], world, pins, out, vocab_parallel=True)
            self.out[name, config] = out
            extra = ("--checkpoint-dir", str(self.checkpoints), "--checkpoint-every", "2") \
                if (name, config) == CHECKPOINTED else ()
            if name not in HOOKS:  # the validation loss after the last step, of token ids as training's
                extra += ("--val-data", str(val_data), "--eval-batches", "1")
            self.jobs.setdefault(world, []).append([str(out), train_args(out, *extra)])
        self.resumed = root / "gpt-tp1-resumed"
        self.plans["gpt", "tp1"] = compile_for(models["gpt"], RESUMED[0], RESUMED[1], self.resumed,
                                               vocab_parallel=False)
        self.jobs[RESUMED[0]].append([str(self.resumed), train_args(
            self.resumed, "--resume", str(self.checkpoints / "step-000002"))])  # after the run that writes it

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def output(self, world: int) -> str:
        """Every rank's output of the launch of `world` processes (run on first use); fails if a rank failed."""
        if world not in self.outputs:
            jobs = self.root / f"jobs{world}.json"
            jobs.write_text(json.dumps(self.jobs[world]))
            self.outputs[world] = Ranks([str(WORKER), str(jobs)], world, self.root / f"logs{world}").wait_ok()
        return self.outputs[world]

    def results(self, out: Path, world: int) -> tuple[list[dict], dict[str, torch.Tensor], dict[int, list[str]]]:
        """(log records by step, final weights, {rank: its parameters of V rows split over tp}) of the run in `out`."""
        output = self.output(world)
        assert f"vocab_parallel_worker: {out.name} done" in output, output[-8000:]
        split = {}
        for line in output.splitlines():
            if line.startswith("VOCAB "):
                record = json.loads(line[len("VOCAB "):])
                if record["out"] == out.name:
                    split[record["rank"]] = record["split"]
        return read_log(out / "log.jsonl"), torch.load(out / "weights.pt"), split


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("models")
    paths = {}
    for name, source in MODELS.items():
        paths[name] = folder / f"vocab_{name}.py"
        paths[name].write_text(source)
    return paths


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory) -> Runs:
    return Runs(models, tmp_path_factory.mktemp("runs"))


# ---- the reference: one process, plain torch ------------------------------------------------------------------


def global_batches(module, plan: Plan):
    """Each step's global batch as the run's ranks get it: train.py's synthetic tokens (GLOBAL_BATCH, SEQ_LEN), or a
    train_data hook's batches of micro_batch rows, num_micro_batches of them a step (dp 1), put together."""
    if not hasattr(module, "train_data"):
        for step in itertools.count():
            yield synthetic_token_batch(module.VOCAB_SIZE, SEQ_LEN, GLOBAL_BATCH, SEED, step)
    assert plan.parallel.dp == 1
    micro = module.train_data(plan.parallel.micro_batch, SEQ_LEN, seed=SEED)
    while True:
        parts = [next(micro) for _ in range(plan.parallel.num_micro_batches)]
        yield {key: torch.cat([part[key] for part in parts]) for key in parts[0]}


def reference_loss(module, outputs, batch) -> torch.Tensor:
    """The model file's loss_fn, else the next-token cross-entropy of the whole batch."""
    if hasattr(module, "loss_fn"):
        return module.loss_fn(outputs, batch)
    logits = outputs if isinstance(outputs, torch.Tensor) else outputs.logits  # (B, T, V)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1))


def train_one_process(module, plan: Plan) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor],
                                                   torch.nn.Module]:
    """(losses, final weights, initial weights, the model trained) of the plain torch loop, on one thread as each
    rank runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(SEED)
        model = module.build_model()
        model.train()
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": ADAMW_DEFAULTS["weight_decay"]},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=LR, betas=ADAMW_DEFAULTS["betas"], eps=ADAMW_DEFAULTS["eps"], fused=True)
        schedule = WarmupCosine(max_lr=LR, warmup_steps=max(1, STEPS // 10), total_steps=STEPS)  # train.py's
        losses = []
        for step, batch in zip(range(STEPS), global_batches(module, plan), strict=False):  # the batches: endless
            for group in optimizer.param_groups:
                group["lr"] = schedule(step)
            loss = reference_loss(module, model(**batch) if isinstance(batch, dict) else model(batch), batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, initial, model
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def single_process(models):
    """(model name, its plan) -> train_one_process's (losses, final weights, initial weights, model), on first
    use."""
    done: dict[tuple[str, int], tuple] = {}

    def get(name: str, plan: Plan):
        key = (name, plan.parallel.micro_batch)  # a hook's batches depend on the micro-batch
        if key not in done:
            done[key] = train_one_process(import_file(models[name], f"vocab_{name}_reference"), plan)
        return done[key]

    return get


# ---- the tests ---------------------------------------------------------------------------------------------------


def one_process_val_loss(module, model: torch.nn.Module, rows: torch.Tensor) -> float:
    """The loss of the validation rows (N, T) under `model` in eval mode, one process, as training's."""
    model.eval()
    try:
        with torch.no_grad():
            return reference_loss(module, model(rows), rows).item()
    finally:
        model.train()


@pytest.mark.parametrize("name, config", CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_split_vocabulary_trains_as_one_process(name, config, runs, models, single_process):
    plan = runs.plans[name, config]
    assert plan.parallel.vocab_parallel and plan.parallel.tp == 2
    records, weights, split = runs.results(runs.out[name, config], CONFIGS[config][0])
    embedding, head = TABLES[name]
    vocab = plan.model.vocab
    assert split and all(embedding in names or head in names for names in split.values()), split  # split, each rank
    ref_losses, ref_weights, initial, ref_model = single_process(name, plan)
    losses = [r["loss"] for r in records]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    assert weights[embedding].shape == ref_weights[embedding].shape == (vocab, plan.model.hidden)  # whole tables
    assert weights[head].shape == ref_weights[head].shape
    loss_diff, weight_diff = max_loss_diff(losses, ref_losses), max_weight_diff(weights, ref_weights)
    print(f"{name} {config} (V={vocab}): max |loss - single process| = {loss_diff:.2e}, "
          f"max |weight - single process| = {weight_diff:.2e}")
    assert loss_diff <= TOLERANCE, (losses, ref_losses)
    assert weight_diff <= TOLERANCE, weight_diff
    assert max_weight_diff(weights, initial) > 1e-4  # they moved: equal weights are not just the initial ones
    if name not in HOOKS:  # the validation loss (forward only, the split loss without a gradient)
        module = import_file(models[name], f"vocab_{name}_validation")
        expected = one_process_val_loss(module, ref_model, runs.val_rows)
        assert abs(records[-1]["val_loss"] - expected) <= TOLERANCE, (records[-1]["val_loss"], expected)


def test_a_split_checkpoint_resumes_at_tp1_and_exports_whole_tables(runs):
    from safetensors.torch import load_file

    from zplan.export import export_checkpoint

    records, trained, _ = runs.results(runs.out[CHECKPOINTED], CONFIGS[CHECKPOINTED[1]][0])
    resumed_records, resumed, split = runs.results(runs.resumed, RESUMED[0])
    assert not any(split.values()), split  # tp 1: nothing split
    losses, resumed_losses = [r["loss"] for r in records], [r["loss"] for r in resumed_records]
    assert len(resumed_losses) == STEPS - 2  # steps 3 and 4, from the tp 2 run's step-2 checkpoint
    assert max_loss_diff(resumed_losses, losses[2:]) <= TOLERANCE, (resumed_losses, losses)
    assert max_weight_diff(resumed, trained) <= TOLERANCE

    exported = load_file(export_checkpoint(runs.checkpoints / f"step-{STEPS:06d}", runs.root / "gpt.safetensors"))
    embedding, head = TABLES["gpt"]
    assert exported[embedding].shape == (runs.plans[CHECKPOINTED].model.vocab, runs.plans[CHECKPOINTED].model.hidden)
    assert set(exported) == set(trained) and max_weight_diff(exported, trained) == 0.0


def test_the_dry_run_runs_split_plans(runs):
    """The dry run runs the same code on fake tensors under a fake process group: a tied default loss at tp 2 and a
    Hugging Face model's own loss from its forward at tp 2 x pp 2."""
    from zplan.dryrun import dry_run, load_program

    for case in (("gpt", "tp2"), ("hf_qwen2", "tp2pp2")):
        result = dry_run(load_program(runs.out[case]), say=lambda message: None)
        assert all(rank.measured_peak_bytes > 0 for rank in result.ranks), case


def test_a_model_without_vocabulary_modules_is_refused():
    """split_vocabulary refuses, before it touches a mesh, a model whose head is not an nn.Linear over the vocabulary
    (here it multiplies by the embedding's table itself); vocabulary_problem says the same on the meta model."""
    from torch import nn

    from zplan.errors import PlanMismatchError
    from zplan.runtime.parallel.vocab_parallel import split_vocabulary, vocabulary_problem

    class TableHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(64, 8)
            self.blocks = nn.ModuleList([nn.Linear(8, 8)])

        def forward(self, ids):
            return self.blocks[0](self.wte(ids)) @ self.wte.weight.t()

    with torch.device("meta"):
        model = TableHead()
    problem = vocabulary_problem(model, "blocks", 64)
    assert problem and "0 nn.Linear of 64 outputs" in problem
    with pytest.raises(PlanMismatchError, match="parallel.vocab_parallel.*0 nn.Linear of 64 outputs"):
        split_vocabulary(model, None, "blocks", 64)
