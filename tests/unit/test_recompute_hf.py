"""Activation recompute on Hugging Face decoders (tests/hf_zoo.py), as the runtime applies it: the generation cache
off (model.modules.disable_generation_cache), then selective or full recompute per block. The gradients equal those
without recompute, bit for bit. With the cache on, a recomputed block appends its keys to the cache a second time
and torch's checkpoint refuses the mismatch (that was a compiled plan that could not run)."""

from pathlib import Path

import pytest
import torch

from tests.hf_zoo import DECODERS, deterministic_decoder_sources, write_model_files
from zplan.model.model_file import load_model_file
from zplan.model.modules import disable_generation_cache
from zplan.runtime.training.recompute import apply_recompute

BLOCKS = {"gpt2": "transformer.h"}  # the others keep their blocks at model.layers


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("zoo")
    files = write_model_files(folder)  # the decoders set up for training: use_cache=False
    files["llama_cache_on"] = folder / "llama_cache_on.py"  # transformers' default, use_cache=True
    files["llama_cache_on"].write_text(deterministic_decoder_sources()["llama"])
    return files


def _gradients(files, name: str, mode: str, cache_off: bool = True) -> torch.Tensor:
    model_file = load_model_file(files[name])
    torch.manual_seed(0)
    model = model_file.build_model()
    if cache_off:
        disable_generation_cache(model)
    apply_recompute(model, mode, BLOCKS.get(name, "model.layers"))
    batch = model_file.example_inputs(2, 16)
    outputs = model(**batch) if isinstance(batch, dict) else model(batch)
    model_file.loss_fn(outputs, batch).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_recompute_gives_the_gradients_of_no_recompute(files, name):
    reference = _gradients(files, name, "none")
    for mode in ("selective", "full"):
        assert torch.equal(_gradients(files, name, mode), reference), mode


def test_with_the_generation_cache_on_selective_recompute_fails(files):
    with pytest.raises(RuntimeError, match="encountered during backward"):
        _gradients(files, "llama_cache_on", "selective", cache_off=False)
