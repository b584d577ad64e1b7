"""Hugging Face folders of other families than Llama, end to end on 2 gloo processes: `zplan compile FOLDER`, the
emitted train.py starting from the folder's weights (--init-from by default), `zplan export --hf`, transformers'
from_pretrained of the export.

Qwen2, Mistral, Gemma-2, Phi-3 (fused qkv_proj and gate_up_proj) and GPT-2 (fused Conv1D c_attn, tied embeddings) as
tiny configs saved by save_pretrained (use_cache=False, eager attention for Gemma-2, Phi-3 and GPT-2), and GPT-2 as
the Hub's openai-community/gpt2 stores it (a base model's names, without `transformer.`, and the attn.bias masks that
transformers leaves unread). Each is compiled under tensor parallel 2, pipeline parallel 2 or ZeRO-3 (RUNS: every
layout by at least two families), and all runs train 3 steps in one launch of this file (its __main__ runs the train.py
scripts one after another in one process group, as hf_parallel_worker.py does, with checkpoints). Checked against
transformers: the step-0 loss equals transformers' loss of from_pretrained(FOLDER) on the same batch, and the export
of the last checkpoint loads with from_pretrained to the run's weights (--save-weights) and their logits (fp32, 1e-5).
A resume does not read the pretrained weights (the checkpoint replaces them): it runs with them gone.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import Ranks, read_log
from zplan.runtime.training.data import synthetic_token_batch
from zplan.schemas import Pins

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

WORLD, GLOBAL_BATCH, SEQ_LEN, VOCAB, SEED, STEPS, LR = 2, 8, 32, 128, 7, 3, 1e-2
# initializer_range 0.2: the loss depends on every weight well above the 1e-5 the checks allow
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, use_cache=False, initializer_range=0.2,
              attention_dropout=0.0)
FAMILIES = {  # name: (config class, its arguments, attention)
    "qwen2": ("Qwen2Config", COMMON, "sdpa"),
    "mistral": ("MistralConfig", COMMON, "sdpa"),
    "gemma2": ("Gemma2Config", {**COMMON, "head_dim": 8}, "eager"),
    "phi3": ("Phi3Config", {**COMMON, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "resid_pdrop": 0.0,
                            "embd_pdrop": 0.0}, "eager"),
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False,
                                initializer_range=0.2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1), "eager"),
}
HUB_GPT2 = "gpt2_hub"  # gpt2's folder with the weights as the Hub's openai-community/gpt2 has them
PINS = {"tp2": Pins(tp=2), "pp2": Pins(pp=2), "zero3": Pins(zero=3, dp=2)}
# model/hf_folder.py builds every folder with sdpa attention, which transformers refuses for Gemma-2
RUNS = {  # run: (family folder, layout)
    "phi3-tp2": ("phi3", "tp2"), "phi3-zero3": ("phi3", "zero3"), "gpt2-tp2": ("gpt2", "tp2"),
    "gpt2_hub-pp2": (HUB_GPT2, "pp2"), "qwen2-zero3": ("qwen2", "zero3"), "mistral-pp2": ("mistral", "pp2"),
    "gemma2-pp2": ("gemma2", "pp2"), "gemma2-tp2": ("gemma2", "tp2"),
}



def save_family(name: str, folder: Path) -> Path:
    """A tiny model of family `name` with weights of seed 123, saved by save_pretrained as 20 KB shards."""
    import transformers

    config_class, arguments, attention = FAMILIES[name]
    torch.manual_seed(123)
    config = getattr(transformers, config_class)(**arguments)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    model.save_pretrained(folder, max_shard_size="20KB")
    return folder


def save_hub_gpt2(folder: Path) -> Path:
    """GPT-2 as openai-community/gpt2's model.safetensors stores it: GPT2Model's names (h.0..., wte.weight; no
    lm_head, tied) and each block's causal mask attn.bias (1, 1, n_positions, n_positions), beside the
    GPT2LMHeadModel config."""
    from safetensors.torch import load_file, save_file

    save_family("gpt2", folder)
    weights = {k: v for shard in sorted(folder.glob("*.safetensors")) for k, v in load_file(shard).items()}
    for shard in [*folder.glob("*.safetensors"), folder / "model.safetensors.index.json"]:
        shard.unlink()
    hub = {name.removeprefix("transformer."): tensor for name, tensor in weights.items()}
    mask = torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64)
    hub.update({f"h.{layer}.attn.bias": mask.clone() for layer in range(2)})
    save_file(hub, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def attention(folder_name: str) -> str:
    return FAMILIES["gpt2" if folder_name == HUB_GPT2 else folder_name][2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(root, {run: its out folder}, {run: why it did not compile}) after one launch over every run."""
    from zplan.api import compile_plan, prepare, write_outputs
    from zplan.errors import ZplanError

    root = tmp_path_factory.mktemp("families")
    for name in FAMILIES:
        save_family(name, root / name)
    save_hub_gpt2(root / HUB_GPT2)
    outs, refused = {}, {}
    for run, (folder, layout) in RUNS.items():
        try:
            plan = compile_plan(prepare(str(root / folder), WORLD, "cpu-local", GLOBAL_BATCH, SEQ_LEN, "fp32",
                                        PINS[layout]))
        except ZplanError as error:
            refused[run] = str(error)
            continue
        outs[run] = root / run
        write_outputs(plan, outs[run], str(root / folder))
    output = Ranks([__file__, *map(str, outs.values())], WORLD, root / "logs").wait_ok()
    assert "2 not this model's, left unread as transformers leaves them (h.0.attn.bias, h.1.attn.bias)" in output
    return root, outs, refused


def out_of(runs, run: str) -> Path:
    """The out folder of `run`; the test fails with the compile's error when it did not compile."""
    _, outs, refused = runs
    if run in refused:
        pytest.fail(refused[run])
    return outs[run]


def causal_lm(folder: Path, attn: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn, dtype=torch.float32).eval()


@pytest.mark.parametrize("run", RUNS)
def test_step0_loss_equals_transformers(runs, run):
    """Each rank read its slices of the folder's tensors (tp's columns and rows in the fused projections' stored
    order, pp's stages, ZeRO-3's shards): the first loss is transformers' on the same batch."""
    root, folder = runs[0], RUNS[run][0]
    out = out_of(runs, run)
    tokens = synthetic_token_batch(VOCAB, SEQ_LEN, GLOBAL_BATCH, SEED, 0)  # (B, T), train.py's step 0
    with torch.no_grad():
        expected = causal_lm(root / folder, attention(folder))(tokens, labels=tokens).loss.item()
    loss = read_log(out / "log.jsonl")[0]["loss"]
    assert abs(loss - expected) < 1e-5, (run, loss, expected)


@pytest.mark.parametrize("run", RUNS)
def test_exported_folder_holds_the_trained_model(runs, run, tmp_path):
    """`zplan export CKPT --to DIR --hf` of the run's last checkpoint: from_pretrained(DIR) holds the run's weights
    (--save-weights, gathered at the end) with nothing missing or unexpected, and gives their logits."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from zplan.export_hf import export_hf_folder

    root, folder = runs[0], RUNS[run][0]
    out = out_of(runs, run)
    exported = export_hf_folder(out / "ckpt", tmp_path / "exported", max_shard_bytes=20_000)
    loaded, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True, dtype=torch.float32,
                                                        attn_implementation=attention(folder))
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    weights = load_file(out / "weights.safetensors")
    trained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(root / folder),
                                               attn_implementation=attention(folder))
    trained.load_state_dict(weights)
    state = loaded.state_dict()
    assert set(state) == set(weights)
    assert all(torch.equal(state[name], weights[name]) for name in weights), run
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = loaded.eval()(input_ids=ids).logits
        torch.testing.assert_close(logits, trained.eval()(input_ids=ids).logits, rtol=0, atol=1e-5)
        before = causal_lm(root / folder, attention(folder))(input_ids=ids).logits
    assert (logits - before).abs().max() > 1e-3  # trained: not the folder's weights


def test_a_resume_does_not_read_the_pretrained_weights(runs, tmp_path):
    """--resume: the checkpoint's weights replace the folder's (the plan's default --init-from), which are not read:
    the resume runs with them moved away, and its first loss is transformers' loss of the checkpoint's weights."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    root, out = runs[0], out_of(runs, "qwen2-zero3")
    checkpoints, log, hidden = tmp_path / "ckpt", tmp_path / "log.jsonl", tmp_path / "hidden"
    shutil.copytree(out / "ckpt", checkpoints)
    hidden.mkdir()
    weights_files = [p for p in (root / "qwen2").iterdir() if p.name.startswith("model")]
    for path in weights_files:
        path.rename(hidden / path.name)
    try:
        output = Ranks([str(out / "train.py"), "--steps", str(STEPS + 1), "--seed", str(SEED), "--lr", str(LR),
                        "--checkpoint-dir", str(checkpoints), "--resume", "--log-json", str(log)], WORLD,
                       tmp_path / "logs").wait_ok()
    finally:
        for path in weights_files:
            (hidden / path.name).rename(path)
    assert "resumed from" in output and "weights from" not in output, output[-4000:]
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(root / "qwen2"), attn_implementation="sdpa")
    model.load_state_dict(load_file(out / "weights.safetensors"))  # the weights after STEPS steps
    tokens = synthetic_token_batch(VOCAB, SEQ_LEN, GLOBAL_BATCH, SEED, STEPS)  # the batch of the step resumed
    with torch.no_grad():
        expected = model.eval()(tokens, labels=tokens).loss.item()
    (record,) = read_log(log)
    assert abs(record["loss"] - expected) < 1e-5, (record, expected)


def test_a_file_of_another_layout_names_its_tensors(runs, tmp_path):
    """--init-from with a family's tensors stored otherwise is refused before any collective, naming them: Phi-3's
    q, k and v apart (as a Llama-layout conversion writes them), GPT-2's Conv1D weights transposed (nn.Linear's)."""
    from safetensors.torch import load_file, save_file

    from zplan.errors import CheckpointError
    from zplan.model.model_file import load_model_file
    from zplan.runtime.checkpoint.pretrained import open_pretrained

    root = runs[0]
    split = {}
    for name, tensor in load_file(next((root / "phi3").glob("*.safetensors"))).items():
        if name.endswith("qkv_proj.weight"):  # (q 32 | k 16 | v 16, hidden 32)
            for part, piece in zip("qkv", tensor.split([32, 16, 16]), strict=True):
                split[name.replace("qkv_proj", f"{part}_proj")] = piece.contiguous()
        else:
            split[name] = tensor
    save_file(split, tmp_path / "phi3.safetensors")
    with pytest.raises(CheckpointError) as phi3:
        open_pretrained(tmp_path / "phi3.safetensors", load_model_file(root / "phi3"))
    assert "self_attn.qkv_proj.weight" in str(phi3.value) and "self_attn.k_proj.weight" in str(phi3.value)

    hub = load_file(root / HUB_GPT2 / "model.safetensors")
    save_file({name: t.T.contiguous() if name.endswith("c_attn.weight") else t for name, t in hub.items()},
              tmp_path / "gpt2.safetensors")
    with pytest.raises(CheckpointError) as gpt2:
        open_pretrained(tmp_path / "gpt2.safetensors", load_model_file(root / HUB_GPT2))
    assert "2 of another shape (h.0.attn.c_attn.weight [96, 32] (the model's [32, 96])" in str(gpt2.value)
    assert "unexpected" not in str(gpt2.value)  # the attn.bias masks: left unread, as transformers leaves them


def test_export_with_another_familys_config_names_the_tensors(runs, tmp_path):
    """`zplan export --hf --config-from` a folder of another family (Mistral's q/k/v for Phi-3's fused
    projections): refused before anything is written, naming the tensors on both sides."""
    from zplan.errors import ExportError
    from zplan.export_hf import export_hf_folder

    root = runs[0]
    with pytest.raises(ExportError) as error:
        export_hf_folder(out_of(runs, "phi3-tp2") / "ckpt", tmp_path / "exported", config_from=root / "mistral")
    assert "missing from the checkpoint: model.layers.0.self_attn.q_proj.weight" in str(error.value)
    assert "not in the config's model: model.layers.0.mlp.gate_up_proj.weight" in str(error.value)
    assert not (tmp_path / "exported").exists()


# ---- the runs: this file's __main__, on every rank ---------------------------------------------------------------


def _run_all(out_dirs: list[Path], ctx) -> None:
    """Each out folder's train.py, as its main runs it, one after another in the process group `ctx`."""
    from tests.distributed.hf_parallel_worker import _import_script
    from zplan.runtime.training.main import parse_script_arguments, run_training, script_of

    for index, out in enumerate(out_dirs):
        module = _import_script(out / "train.py", f"zplan_family_train_{index}")
        sys.argv = [str(out / "train.py"), "--steps", str(STEPS), "--seed", str(SEED), "--lr", str(LR),
                    "--log-json", str(out / "log.jsonl"), "--save-weights", str(out / "weights.safetensors"),
                    "--checkpoint-dir", str(out / "ckpt")]
        script = script_of(module)
        run_training(parse_script_arguments(script), ctx, script)


if __name__ == "__main__":
    from zplan.runtime.launch.distributed import run_distributed

    run_distributed(lambda ctx: _run_all([Path(p) for p in sys.argv[1:]], ctx))
