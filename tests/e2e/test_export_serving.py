"""End to end: the generate.py compiled for examples/tiny.py (`zplan compile --mode inference`) run with --weights on a
Hugging Face style folder (model.safetensors.index.json and its shards, as `zplan export --hf` and save_pretrained
write them; or one model.safetensors), against the engine in this process on the same weights.

The folder is written with the safetensors package and a hand-made index (an independent writer): tiny.py is no
transformers model, so `zplan export --hf` has no config.json for it (tests/unit/test_export_hf.py exports a Llama and
loads that folder with transformers and with the same loader).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.e2e.test_inference_programs import MAX_BATCH, NEW_TOKENS, PROMPTS, generated_tokens, reference_tokens

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    """examples/tiny.py compiled for serving, as tests/e2e/test_inference_programs.py compiles it."""
    out = tmp_path_factory.mktemp("inference") / "plan"
    subprocess.run([str(BIN / "zplan"), "compile", str(ROOT / "examples" / "tiny.py"), "--mode", "inference",
                    "--gpus", "1", "--cluster", "cpu-local", "--precision", "fp32", "--batch", str(MAX_BATCH),
                    "--prompt-len", "48", "--gen-len", str(NEW_TOKENS), "-o", str(out)],
                   capture_output=True, text=True, check=True, timeout=120)
    return out


def trained_tiny() -> dict[str, torch.Tensor]:
    """tiny.py's seed-0 weights moved far from the init (their greedy text differs from the init's)."""
    from zplan.model.model_file import load_model_file
    from zplan.runtime.training.materialize import build_model

    model = build_model(load_model_file(ROOT / "examples" / "tiny.py").build_model, 0, "cpu")
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def write_folder(folder: Path, state: dict[str, torch.Tensor], shards: int) -> None:
    """`state` as save_pretrained lays it out: `shards` files and an index, or model.safetensors alone."""
    folder.mkdir()
    names = list(state)
    if shards == 1:
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: state[name] for name in names[i::shards]}
        save_file(part, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))


@pytest.mark.slow
@pytest.mark.parametrize("shards", [3, 1])
def test_generate_runs_on_a_weights_folder(compiled, tmp_path, shards):
    trained = trained_tiny()
    folder = tmp_path / "exported"
    state = {name: tensor for name, tensor in trained.items() if name != "lm_head.weight"}  # tied: written once
    assert len(state) < len(trained)
    write_folder(folder, state, shards)
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")  # launch/generate.sh runs `python`
    result = subprocess.run(["bash", str(compiled / "launch" / "generate.sh"), "--tokens", "--max-new-tokens",
                             str(NEW_TOKENS), "--weights", str(folder)], input=PROMPTS[0] + "\n",
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "random initialisation" not in result.stderr
    assert generated_tokens(result.stdout) == reference_tokens(compiled, PROMPTS[:1], trained)
    assert generated_tokens(result.stdout) != reference_tokens(compiled, PROMPTS[:1])  # not the seed-0 init
