"""`zplan export CKPT --to DIR --hf` (zplan.export_hf) on checkpoints of a tiny Hugging Face Llama trained a few steps
in one process, and train.py --save-weights FILE.safetensors (runtime.checkpoint.weights_file).

The reference is transformers itself: AutoModelForCausalLM.from_pretrained(DIR) must load the folder with no
missing or unexpected keys and give the trained model's logits; AutoTokenizer.from_pretrained(DIR) the source's
tokenizer; safetensors.torch.load_file reads the weights file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

from zplan.errors import ExportError, OutputError, ZplanError
from zplan.export_hf import export_hf_folder, parse_size
from zplan.runtime.checkpoint.save import save_checkpoint
from zplan.runtime.checkpoint.weights_file import save_full_weights
from zplan.runtime.launch.distributed import close_distributed, init_distributed

VOCAB = 320  # the tokenizer's 256 bytes, 3 special tokens and its merges
CORPUS = ["the plan is the only contract", "zplan compiles models and runs them", "hello world, hello plan"] * 20


@pytest.fixture
def ctx():
    """A process group of one (in-memory store: no port), as train.py has without torchrun."""
    context = init_distributed()
    yield context
    close_distributed(clean=True)


def llama_config(tie: bool, **sizes) -> LlamaConfig:
    args = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, use_cache=False, tie_word_embeddings=tie)
    return LlamaConfig(**{**args, **sizes})


def save_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on CORPUS, saved as transformers saves a fast tokenizer."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 16, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    wrapped.save_pretrained(folder)
    return wrapped


def source_folder(folder: Path, tie: bool, **sizes) -> Path:
    """A Hugging Face folder as `zplan compile HF_FOLDER` takes it: config, generation config, weights, tokenizer."""
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(llama_config(tie, **sizes), attn_implementation="eager").save_pretrained(folder)
    save_tokenizer(folder)
    return folder


def trained_checkpoint(tmp_path: Path, ctx, tie: bool, model_ref: str | None) -> tuple[torch.nn.Module, Path]:
    """The model of the source's config trained 3 AdamW steps (what the runtime checkpoints: the model file's
    state-dict names are transformers' own), and its checkpoint."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(tie), attn_implementation="eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, save_checkpoint(tmp_path / "ckpt", 3, model, optimizer, ctx, keep=1, model_ref=model_ref)


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def load_exported(folder: Path, **kwargs) -> torch.nn.Module:
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, attn_implementation="eager",
                                                       **kwargs)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_hf_folder_loads_with_transformers_and_gives_the_trained_logits(ctx, tmp_path, tie):
    source = source_folder(tmp_path / "source", tie)
    model, checkpoint = trained_checkpoint(tmp_path, ctx, tie, model_ref=str(source))
    out = export_hf_folder(checkpoint, tmp_path / "export", max_shard_bytes=20_000)  # the source from train_state

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and shards == sorted(set(index["weight_map"].values()))
    assert shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    weights = {shard: load_file(out / shard) for shard in shards}
    # at most 20,000 bytes of tensors a shard, or one bigger tensor alone (the (320, 32) fp32 embedding: 40,960)
    assert all(sum(t.numel() * 4 for t in w.values()) <= 20_000 or len(w) == 1 for w in weights.values())
    assert index["weight_map"] == {name: shard for shard, w in weights.items() for name in w}
    assert ("lm_head.weight" in index["weight_map"]) is not tie  # a tied head is written once, as save_pretrained
    assert index["metadata"]["total_size"] == sum(
        p.numel() * 4 for n, p in model.state_dict().items() if not (tie and n == "lm_head.weight"))
    copied = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}
    assert copied <= {p.name for p in out.iterdir()}
    assert {p.name for p in (tmp_path / "source").iterdir() if p.name.startswith(("tokenizer", "special"))} <= \
        {p.name for p in out.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left

    exported = load_exported(out)
    assert exported.dtype == torch.float32
    torch.testing.assert_close(logits(exported), logits(model), rtol=0, atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = "hello plan, the models"
    assert tokenizer(text)["input_ids"] == AutoTokenizer.from_pretrained(tmp_path / "source")(text)["input_ids"]
    assert len(tokenizer(text)["input_ids"]) < len(text)  # the trained merges, not bytes


def test_dtype_one_shard_and_config_from(ctx, tmp_path):
    """--dtype bf16 casts the floating-point weights and says so in config.json; everything in one shard is
    model.safetensors without an index (as save_pretrained); --config-from when the run recorded no folder."""
    source = source_folder(tmp_path / "source", tie=False)
    model, checkpoint = trained_checkpoint(tmp_path, ctx, False, model_ref=None)
    out = export_hf_folder(checkpoint, tmp_path / "export", config_from=source, dtype="bf16")
    assert not (out / "model.safetensors.index.json").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    exported = load_exported(out)
    assert exported.dtype == torch.bfloat16
    weights = load_file(out / "model.safetensors")
    for name, tensor in model.state_dict().items():
        assert torch.equal(weights[name], tensor.to(torch.bfloat16)), name


@pytest.mark.parametrize("case", ["no config source", "another architecture", "other shapes", "tied in the config",
                                  "not empty", "a file"])
def test_bad_input_is_one_message_and_nothing_is_written(ctx, tmp_path, case):
    source = source_folder(tmp_path / "source", tie=False)
    _, checkpoint = trained_checkpoint(tmp_path, ctx, False, model_ref=None if case == "no config source" else
                                       str(tmp_path / "train.py"))
    out, config_from, match = tmp_path / "export", source, None
    if case == "no config source":
        config_from, match = None, "pass --config-from HF_DIR"
    elif case == "another architecture":  # 3 layers: layer 2's tensors are not in the checkpoint
        config_from = source_folder(tmp_path / "deeper", False, num_hidden_layers=3)
        match = r"missing from the checkpoint: model\.layers\.2\..*--config-from"
    elif case == "other shapes":
        config_from = source_folder(tmp_path / "wider", False, intermediate_size=48)
        match = r"shaped otherwise: model\.layers\.0\.mlp\.gate_proj\.weight \(64, 32\) \(the config's: \(48, 32\)\)"
    elif case == "tied in the config":  # the run trained lm_head apart from the embedding
        config_from = source_folder(tmp_path / "tied", True)
        match = r"ties model\.embed_tokens\.weight, lm_head\.weight .* different values"
    elif case == "not empty":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        match = "not empty.*--force"
    else:
        out.write_text("a file")
        match = "is a file"
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ExportError, match=match):
        export_hf_folder(checkpoint, out, config_from=config_from)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    if case == "not empty":
        assert [p.name for p in out.iterdir()] == ["notes.txt"]
        export_hf_folder(checkpoint, out, config_from=config_from, force=True)  # replaced as a whole
        assert "notes.txt" not in {p.name for p in out.iterdir()} and (out / "model.safetensors").is_file()
        assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_shard_sizes_parse_as_transformers_reads_them():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("20000") == 20_000
    assert parse_size("1.5MB") == 1_500_000
    with pytest.raises(ZplanError, match="--max-shard-size"):
        parse_size("big")


def test_save_weights_writes_safetensors_that_load_file_reads(ctx, tmp_path):
    model, _ = trained_checkpoint(tmp_path, ctx, True, model_ref=None)
    save_full_weights(model, tmp_path / "out" / "x.safetensors", ctx)
    weights = load_file(tmp_path / "out" / "x.safetensors")
    expected = model.state_dict()
    assert set(weights) == set(expected)  # a tied weight under each of its names, as state_dict() has them
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["x.safetensors"]  # no temporary file left
    save_full_weights(model, tmp_path / "x.pt", ctx)
    assert torch.load(tmp_path / "x.pt", weights_only=True).keys() == expected.keys()
    with pytest.raises(OutputError, match=r"x\.txt.*\.safetensors"):
        save_full_weights(model, tmp_path / "x.txt", ctx)
    assert not (tmp_path / "x.txt").exists()


def test_save_weights_suffix_is_checked_when_train_py_parses_it():
    from zplan.runtime.launch.arguments import parse_train_arguments

    assert parse_train_arguments(None, 1e-3, ["--save-weights", "w.safetensors"]).save_weights == "w.safetensors"
    with pytest.raises(SystemExit) as exit_info:
        parse_train_arguments(None, 1e-3, ["--save-weights", "w.txt"])
    assert exit_info.value.code == 2


def test_the_inference_loader_reads_the_exported_folder(ctx, tmp_path):
    """runtime.inference.build.load_weights (what generate.py and serve.py call with --weights) on the exported
    folder: shard by shard, the tied head from the embedding, into the model the model file builds."""
    from zplan.runtime.inference.build import load_weights

    source = source_folder(tmp_path / "source", tie=True)
    model, checkpoint = trained_checkpoint(tmp_path, ctx, True, model_ref=str(source))
    out = export_hf_folder(checkpoint, tmp_path / "export", max_shard_bytes=20_000)
    torch.manual_seed(7)
    fresh = AutoModelForCausalLM.from_config(llama_config(True), attn_implementation="eager")
    load_weights(fresh, out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight


@pytest.mark.parametrize("damage", ["no weights", "lost shard", "index leads out"])
def test_a_damaged_folder_is_one_message_naming_it(ctx, tmp_path, damage):
    from zplan.runtime.inference.build import load_weights

    source = source_folder(tmp_path / "source", tie=False)
    model, checkpoint = trained_checkpoint(tmp_path, ctx, False, model_ref=str(source))
    out = export_hf_folder(checkpoint, tmp_path / "export", max_shard_bytes=20_000)
    index = out / "model.safetensors.index.json"
    if damage == "no weights":
        for path in out.glob("model*"):
            path.unlink()
        match = r"neither model\.safetensors\.index\.json nor model\.safetensors.*--hf"
    elif damage == "lost shard":
        shard = sorted(out.glob("model-*.safetensors"))[1]
        shard.unlink()
        match = rf"names .*{shard.name}, which is not there"
    else:
        data = json.loads(index.read_text())
        data["weight_map"]["lm_head.weight"] = "../source/model.safetensors"
        index.write_text(json.dumps(data))
        match = r"a path outside"
    with pytest.raises(ZplanError, match=match):
        load_weights(model, out)
