"""A tensor-parallel run (2 gloo processes, --tp 2) of a tiny Hugging Face Llama through the emitted train.py, its
checkpoint exported with `zplan export --hf` (the command line), loaded back by transformers.

Two outputs of the same run are compared: the checkpoint (DCP shards of each rank, exported by streaming) and
train.py --save-weights FILE.safetensors (gathered to rank 0); AutoModelForCausalLM.from_pretrained(DIR) must
give the logits of the model loaded from the weights file.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import Ranks
from tests.hf_zoo import model_sources, save_llama_config

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

BIN = Path(sys.executable).parent


def save_tokenizer(folder: Path) -> None:
    """A byte-level BPE beside the config, as a Hugging Face folder has it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(["a tiny corpus for a tiny tokenizer"] * 10, trainers.BpeTrainer(
        vocab_size=100, special_tokens=["<unk>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:64]))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(folder)


@pytest.mark.slow
def test_a_tp2_checkpoint_exports_to_a_folder_transformers_loads(tmp_path):
    from zplan.api import compile_plan, prepare, write_outputs
    from zplan.schemas import Pins

    model_file = tmp_path / "hf_llama_hooks.py"
    model_file.write_text(model_sources()["llama_hooks"])  # builds the model of llama_config/config.json
    source = save_llama_config(tmp_path)
    save_tokenizer(source)
    out = tmp_path / "plan"
    write_outputs(compile_plan(prepare(str(model_file), 2, "cpu-local", 8, 32, "fp32", Pins(tp=2))), out,
                  str(model_file))
    assert json.loads((out / "plan.json").read_text())["parallel"]["tp"] == 2
    Ranks([str(out / "train.py"), "--steps", "3", "--lr", "1e-2", "--checkpoint-dir", str(tmp_path / "ckpt"),
           "--save-weights", str(tmp_path / "weights.safetensors")], 2, tmp_path / "logs").wait_ok()

    exported = tmp_path / "exported"
    result = subprocess.run([str(BIN / "zplan"), "export", str(tmp_path / "ckpt"), "--to", str(exported), "--hf",
                             "--config-from", str(source), "--max-shard-size", "30KB"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert len(list(exported.glob("model-*.safetensors"))) > 1 and (exported / "tokenizer.json").is_file()

    weights = safetensors_torch.load_file(tmp_path / "weights.safetensors")
    trained = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(source),
                                                            attn_implementation="eager")
    trained.load_state_dict(weights)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True,
                                                                     attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for name, tensor in loaded.state_dict().items():  # trained: not the seed-0 weights the source folder lacks
        assert torch.equal(tensor, weights[name]), name
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, trained.eval()(input_ids=ids).logits,
                                   rtol=0, atol=1e-5)
    assert transformers.AutoTokenizer.from_pretrained(exported)("a tiny corpus")["input_ids"]

    again = subprocess.run([str(BIN / "zplan"), "export", str(tmp_path / "ckpt"), "--to", str(exported), "--hf",
                            "--config-from", str(source)], capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "not empty" in again.stderr and "Traceback" not in again.stderr


@pytest.mark.slow
def test_a_run_compiled_from_a_folder_exports_with_that_folder_by_default(tmp_path):
    """`zplan compile HF_FOLDER`: the checkpoint records the folder (train_state.json's model_ref), so `--hf` needs no
    --config-from."""
    from zplan.api import compile_plan, prepare, write_outputs
    from zplan.export_hf import export_hf_folder
    from zplan.schemas import Pins

    source = tmp_path / "source"
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False, tie_word_embeddings=True)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(source)
    save_tokenizer(source)
    out = tmp_path / "plan"
    write_outputs(compile_plan(prepare(str(source), 1, "cpu-local", 2, 16, "fp32", Pins())), out, str(source))
    Ranks([str(out / "train.py"), "--steps", "2", "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-weights",
           str(tmp_path / "weights.safetensors")], 1, tmp_path / "logs").wait_ok()
    state = json.loads(next((tmp_path / "ckpt").glob("step-*/train_state.json")).read_text())
    assert state["model_ref"] == str(source.resolve())

    exported = export_hf_folder(tmp_path / "ckpt", tmp_path / "exported")
    weights = safetensors_torch.load_file(tmp_path / "weights.safetensors")
    assert "lm_head.weight" not in safetensors_torch.load_file(exported / "model.safetensors")  # tied: written once
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    assert (exported / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
