"""Pipeline parallelism (runtime/parallel/pipeline.py) under gloo against one process.

Distributed (slow): examples/tiny.py with 4 blocks (tied output head, learned position embedding) trains
3 AdamW steps with active gradient clipping, pp=2 under GPipe, 1F1B and interleaved 1F1B (2 chunks per
rank, 4 stages; and 3 chunks per rank, 6 stages, the first holding only the embedding and the last only the
head), dp=2 x pp=2 with DDP (ZeRO 0; 1F1B and interleaved) and FSDP2 (ZeRO 3; interleaved)
over the dp sub-mesh, and pp=4 (1F1B, the tied head on the first and last of 4 ranks). The loss and
gradient norm of every step and the final parameters must equal one process training the same model on
the same global batch, in plain torch, within 1e-5. The workers are this file run as a script.

Single process (fast): the stages composed reproduce the model's forward and gradients for tiny.py, gpt.py,
llama.py and tiny Hugging Face Llama, Gemma-2, Mixtral and GPT-2 models (stages from the tracer's units); a
forward that works between the embedding and the blocks, and after the head, runs on every stage; one that
reads the embedding's values there is refused.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[2]
SEED, STEPS, LR, WEIGHT_DECAY, GRAD_CLIP = 5, 3, 1e-3, 0.1, 0.5
VOCAB, SEQ_LEN, HIDDEN, HEADS, LAYERS = 64, 16, 32, 4, 4
MICRO_BATCH, NUM_MICRO_BATCHES = 2, 4
TOLERANCE = 1e-5

UNITS = [  # as the tracer reports examples/tiny.py's units (schemas LayerCost: name, modules)
    SimpleNamespace(name="embedding", modules=["wte", "wpe"]),
    *(SimpleNamespace(name=f"blocks.{i}", modules=[f"blocks.{i}"]) for i in range(LAYERS)),
    SimpleNamespace(name="head", modules=["ln_f", "lm_head"]),
]
TWO_STAGES = [["embedding", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "head"]]  # plan Stage.layer_names
# interleaved on 2 ranks: stage s is chunk s // 2 of rank s % 2; with pp=4, one stage per rank
FOUR_STAGES = [["embedding", "blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3", "head"]]
# uneven interleaved (3 chunks a rank for 4 blocks: planner.search.interleaved_partition counts the embedding and the
# head as a block each): a chunk of the embedding alone and one of the head alone
SIX_STAGES = [["embedding"], ["blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3"], ["head"]]
RUNS = {  # world size -> run name -> (dp, schedule, ZeRO stage over dp, stages); pp = world // dp
    2: {"gpipe": (1, "gpipe", 0, TWO_STAGES), "1f1b": (1, "1f1b", 0, TWO_STAGES),
        "interleaved-1f1b": (1, "interleaved-1f1b", 0, FOUR_STAGES),
        "interleaved-uneven": (1, "interleaved-1f1b", 0, SIX_STAGES)},
    4: {"dp2-ddp-1f1b": (2, "1f1b", 0, TWO_STAGES), "dp2-ddp-interleaved": (2, "interleaved-1f1b", 0, FOUR_STAGES),
        "dp2-fsdp-interleaved": (2, "interleaved-1f1b", 3, FOUR_STAGES),
        # the tied head on ranks 0 and 3 only: the middle ranks hold no copy
        "pp4-1f1b": (1, "1f1b", 0, FOUR_STAGES)},
}


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_model() -> nn.Module:
    tiny = _import(REPO / "examples" / "tiny.py", "tiny_for_pipeline_test")
    return tiny.build_model(num_layers=LAYERS, hidden=HIDDEN, heads=HEADS, vocab_size=VOCAB, max_seq_len=SEQ_LEN)


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def adamw(params) -> torch.optim.Optimizer:
    params = list(params)
    return torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=LR, fused=True)


def global_batch(dp: int, step: int) -> torch.Tensor:
    from zplan.runtime.training.data import synthetic_token_batch

    return synthetic_token_batch(VOCAB, SEQ_LEN, dp * MICRO_BATCH * NUM_MICRO_BATCHES, SEED, step)  # (B, T)


# ---- the worker: one process of a torchrun-like launch ---------------------------------------------


def _wrap_for_data_parallel(chunk: nn.Module, dp_mesh, zero_stage: int) -> nn.Module:
    if zero_stage == 0:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(chunk, process_group=dp_mesh.get_group())
    from torch.distributed.fsdp import fully_shard

    for block in chunk.get_submodule("blocks").values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=True)
    return fully_shard(chunk, mesh=dp_mesh, reshard_after_forward=True)


def _train_pipelined(mesh, dp: int, schedule: str, zero_stage: int, stage_units: list[list[str]]):
    import torch.distributed as dist

    from zplan.runtime.parallel.pipeline import build_pipeline, gather_full_state_dict, stage_module_paths

    torch.manual_seed(SEED)
    model = tiny_model()
    stages = stage_module_paths(stage_units, UNITS)
    example = torch.zeros(MICRO_BATCH, SEQ_LEN, dtype=torch.long)
    run = build_pipeline(model, mesh["pp"], stages, schedule, NUM_MICRO_BATCHES, next_token_loss, example)
    del model
    if dp > 1:
        for i, chunk in enumerate(run.chunks):
            run.chunks[i] = _wrap_for_data_parallel(chunk, mesh["dp"], zero_stage)
    optimizer = adamw(run.parameters())
    dp_rank, per_rank = mesh["dp"].get_local_rank(), MICRO_BATCH * NUM_MICRO_BATCHES
    losses, norms = [], []
    run.train()
    for step in range(STEPS):
        mine = global_batch(dp, step)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        micro_batches = list(mine.split(MICRO_BATCH))
        loss = run.step(micro_batches)
        norm = run.clip_grad_norm_(GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss, group=mesh["dp"].get_group())  # the mean over the global batch
        losses.append(loss.item() / dp)
        norms.append(float(norm))
    if mesh["pp"].get_local_rank() == mesh["pp"].size() - 1:  # the last stage holds the tied head
        assert run.tied_names == {"lm_head.weight": "wte.weight"}, run.tied_names
    return losses, norms, gather_full_state_dict(run)


def worker(out_file: str, world: int) -> None:
    from zplan.runtime.launch.distributed import run_distributed
    from zplan.runtime.parallel.mesh import build_mesh

    def work(ctx) -> None:
        results = {}
        for name, (dp, schedule, zero_stage, stage_units) in RUNS[world].items():
            mesh = build_mesh(pp=world // dp, dp=dp, tp=1, device_type="cpu")
            losses, norms, weights = _train_pipelined(mesh, dp, schedule, zero_stage, stage_units)
            results[name] = {"losses": losses, "norms": norms, "weights": weights}
        if ctx.is_main:
            torch.save(results, out_file)

    run_distributed(work)


# ---- the tests -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, out_file: Path) -> dict:
    """`world` processes of this file's worker with torchrun's environment (without torchrun's start-up)."""
    port = str(_free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
           "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    processes = [
        subprocess.Popen([sys.executable, __file__, str(out_file), str(world)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(world)
    ]
    outputs = [p.communicate(timeout=240)[0] for p in processes]
    assert all(p.returncode == 0 for p in processes), "\n".join(outputs)[-8000:]
    return torch.load(out_file)


def reference_run(dp: int) -> dict:
    """One process, the whole global batch at once, plain torch."""
    torch.manual_seed(SEED)
    model = tiny_model()
    optimizer = adamw(model.parameters())
    losses, norms = [], []
    for step in range(STEPS):
        tokens = global_batch(dp, step)
        loss = next_token_loss(model(tokens), tokens)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module")
def pipelined_runs(tmp_path_factory) -> dict:
    return launch(2, tmp_path_factory.mktemp("pp2") / "results.pt")


@pytest.fixture(scope="module")
def four_process_runs(tmp_path_factory) -> dict:
    return launch(4, tmp_path_factory.mktemp("dp2pp2") / "results.pt")


def _compare(name: str, got: dict, ref: dict) -> None:
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True))
    norm_diff = max(abs(a - b) for a, b in zip(got["norms"], ref["norms"], strict=True))
    assert set(got["weights"]) == set(ref["weights"])
    param_diff = max((got["weights"][k] - ref["weights"][k]).abs().max().item() for k in ref["weights"])
    print(f"{name}: max |loss - single process| = {loss_diff:.2e}, |grad norm - ...| = {norm_diff:.2e}, "
          f"|parameter - ...| = {param_diff:.2e}")
    assert max(ref["norms"]) > GRAD_CLIP  # clipping was active, so the norm over all stages mattered
    assert ref["losses"][-1] < ref["losses"][0]  # it trains
    assert loss_diff <= TOLERANCE, (got["losses"], ref["losses"])
    assert norm_diff <= TOLERANCE, (got["norms"], ref["norms"])
    assert param_diff <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "interleaved-uneven"])
def test_pipeline_matches_single_process(schedule, pipelined_runs):
    _compare(f"pp=2 {schedule}", pipelined_runs[schedule], reference_run(dp=1))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS[4]))
def test_four_processes_match_single_process(name, four_process_runs):
    dp = RUNS[4][name][0]
    _compare(f"dp={dp} x pp={4 // dp} {name}", four_process_runs[name], reference_run(dp=dp))


# ---- single process: the split and its contract --------------------------------------------------


def _example_model(name: str) -> tuple[nn.Module, list[list[str]]]:
    torch.manual_seed(SEED)
    if name == "tiny":
        return tiny_model(), [["wte", "wpe", "blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3", "ln_f", "lm_head"]]
    if name == "gpt":
        gpt = _import(REPO / "examples" / "gpt.py", "gpt_for_pipeline_test")
        model = gpt.build_model(num_layers=2, hidden=HIDDEN, heads=HEADS, vocab_size=VOCAB, max_seq_len=SEQ_LEN)
        return model, [["wte", "wpe"], ["blocks.0", "blocks.1", "ln_f", "lm_head"]]
    llama = _import(REPO / "examples" / "llama.py", "llama_for_pipeline_test")
    model = llama.build_model(num_layers=2, hidden=HIDDEN, heads=HEADS, kv_heads=2, ffn_hidden=64, vocab_size=VOCAB)
    return model, [["embed", "layers.0"], ["layers.1", "norm", "lm_head"]]


@pytest.mark.parametrize("name", ["tiny", "gpt", "llama"])
def test_stages_reproduce_the_forward_and_its_gradients(name):
    """Composed in one process, the stages give the model's logits, and backward through them its gradients."""
    from zplan.runtime.parallel.pipeline import check_split, run_stages, split_model

    model, stages = _example_model(name)
    chunks = split_model(model, stages)
    tokens = global_batch(1, 0)[:4]  # (4, T): positions and tokens vary
    check_split(model, chunks, tokens)
    next_token_loss(model(tokens), tokens).backward()
    expected = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    next_token_loss(run_stages(chunks, tokens)[-1], tokens).backward()
    assert max((p.grad - expected[k]).abs().max().item() for k, p in model.named_parameters()) <= 1e-6
    names = [n for chunk in chunks for n, _ in chunk.named_parameters()]
    assert set(names) == {n for n, _ in model.named_parameters(remove_duplicate=False)}  # original names


class SoftCapGPT(nn.Module):
    """A forward that does more after the head (Gemma 2's logit soft-cap) and between the embedding and the
    blocks (a scale, a mask the blocks take): every stage runs it, the soft-cap lands on the logits only."""

    def __init__(self, values_between=False):
        super().__init__()
        self.values_between = values_between
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(MaskedBlock() for _ in range(2))
        self.lm_head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx):
        x = self.wte(idx) * HIDDEN**0.5
        mask = torch.ones(idx.shape, dtype=x.dtype, device=x.device)  # (B, T), from the batch's shape
        if self.values_between:  # from the embedding's values: later stages see zeros there
            mask = mask * x.sum(-1).sign()
        for block in self.blocks:
            x = block(x, mask=mask)
        return 3.0 * torch.tanh(self.lm_head(x) / 3.0)


class MaskedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, mask):
        return x + self.proj(self.norm(x)) * mask[..., None]


def test_the_forward_runs_on_every_stage():
    from zplan.runtime.parallel.pipeline import PipelineSplitError, check_split, split_model

    stages = [["wte", "blocks.0"], ["blocks.1", "lm_head"]]
    tokens = global_batch(1, 0)[:2]
    model = SoftCapGPT()
    outputs = check_split(model, split_model(model, stages), tokens)
    mask = torch.ones(tokens.shape)
    assert torch.equal(outputs[0], model.blocks[0](model.wte(tokens) * HIDDEN**0.5, mask))  # no soft-cap on it
    assert torch.allclose(outputs[-1], model(tokens))
    reads_values = SoftCapGPT(values_between=True)
    with pytest.raises(PipelineSplitError, match="do not reproduce its forward"):
        check_split(reads_values, split_model(reads_values, stages), tokens)


HF_CONFIGS = {  # tiny Hugging Face models whose blocks sit in a submodule and take masks and rotary tables
    "llama": ("LlamaConfig", dict(num_key_value_heads=2)),
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=8)),  # soft-caps the logits after the head
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "gpt2": ("GPT2Config", dict(n_embd=HIDDEN, n_layer=4, n_head=HEADS, n_positions=64, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0)),  # tied head, wte + wpe
}


def hf_model(name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config_class, extra = HF_CONFIGS[name]
    sizes = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                 max_position_embeddings=64)
    config = getattr(transformers, config_class)(vocab_size=VOCAB, **({} if name == "gpt2" else sizes), **extra)
    torch.manual_seed(SEED)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_hugging_face_stages_reproduce_the_forward_and_its_gradients(name):
    """Stages cut from the tracer's units (model.embed_tokens | model.layers.i | model.norm, lm_head) give the
    model's logits and, backward through them, its gradients."""
    from zplan.model.model_file import next_token_loss as model_file_loss  # the runtime's default loss
    from zplan.model_input import trace_module
    from zplan.runtime.parallel.pipeline import check_split, run_stages, split_model, stage_module_paths

    model = hf_model(name)
    with torch.device("meta"):
        meta = hf_model(name)
    _, summary = trace_module(meta, torch.zeros(1, SEQ_LEN, dtype=torch.long, device="meta"), SEQ_LEN, "fp32")
    units = [layer.name for layer in summary.layers]
    stages = stage_module_paths([units[:2], units[2:4], units[4:]], summary.layers)  # emb + 1 | 2 | 1 + head
    chunks = split_model(model, stages)
    tokens = global_batch(1, 0)[:4]
    check_split(model, chunks, tokens)
    model_file_loss(model(tokens), tokens).backward()
    expected = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    model_file_loss(chunks[-1].outputs_for_loss(run_stages(chunks, tokens)[-1]), tokens).backward()
    assert max((p.grad - expected[k]).abs().max().item() for k, p in model.named_parameters()) <= 1e-6


def test_stage_lists_that_do_not_fit_the_model_are_refused():
    from zplan.runtime.parallel.pipeline import PipelineSplitError, unit_roles

    model = tiny_model()
    blocks = [f"blocks.{i}" for i in range(LAYERS)]
    cases = {
        "is not a module of TinyGPT": [["wte", "wpe", "blocks.0"], ["nope", *blocks[1:], "ln_f", "lm_head"]],
        "in no pipeline stage": [["wte", "wpe", *blocks], ["ln_f"]],  # lm_head missing
        "two pipeline stages": [["wte", "wpe", *blocks], ["blocks.3", "ln_f", "lm_head"]],
        "must all be in pipeline stage 0": [["wte"], ["wpe", *blocks, "ln_f", "lm_head"]],
        "must all be in the last pipeline stage": [["wte", "wpe", *blocks, "ln_f"], ["lm_head"]],
    }
    for message, stages in cases.items():
        with pytest.raises(PipelineSplitError, match=message):
            unit_roles(model, stages)


def test_stage_module_paths_expands_units():
    from zplan.runtime.parallel.pipeline import stage_module_paths

    assert stage_module_paths(TWO_STAGES, UNITS) == [
        ["wte", "wpe", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "ln_f", "lm_head"]]
    assert stage_module_paths([["wte", "blocks.0"]], []) == [["wte", "blocks.0"]]  # units named by module path


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]))
