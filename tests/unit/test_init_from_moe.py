"""Starting from a Hugging Face mixture of experts' own folder in one process: save_pretrained writes one tensor per
expert (Mixtral's block_sparse_moe.experts.K.w1/w3/w2, Qwen3-MoE's mlp.experts.K.gate_proj/up_proj/down_proj), the
model stacks them (gate_up_proj (E, 2F, h), down_proj (E, h, F)); --init-from joins them as transformers does
(runtime/checkpoint/expert_weights.py). The reference is from_pretrained(FOLDER) itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zplan.errors import CheckpointError
from zplan.model.model_file import load_model_file
from zplan.runtime.checkpoint.expert_weights import Joined, read_joined
from zplan.runtime.checkpoint.pretrained import load_pretrained, open_pretrained
from zplan.runtime.checkpoint.safetensors_read import weights_of

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SIZES = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, use_cache=False)
# a per-expert tensor of the second layer's last expert: the up part, concatenated after the gate
LAST_UP = {"mixtral": "model.layers.1.block_sparse_moe.experts.3.w3.weight",
           "qwen3_moe": "model.layers.1.mlp.experts.3.up_proj.weight"}


def config(family: str):
    from transformers import MixtralConfig, Qwen3MoeConfig

    if family == "mixtral":
        return MixtralConfig(**SIZES, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
    return Qwen3MoeConfig(**SIZES, intermediate_size=64, moe_intermediate_size=24, num_experts=4,
                          num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def saved(request, tmp_path_factory) -> tuple[Path, str]:
    """(the folder save_pretrained wrote, the name of one of its expert tensors: LAST_UP)."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(123)
    AutoModelForCausalLM.from_config(config(request.param), attn_implementation="sdpa").save_pretrained(path)
    assert LAST_UP[request.param] in weights_of(path)  # one tensor per expert, not the model's stacked names
    return path, LAST_UP[request.param]


def reference(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").state_dict()


def loaded(folder: Path, source: Path) -> tuple[torch.nn.Module, str]:
    """The folder's model built from another seed, then --init-from `source`; and the load's line."""
    model_file = load_model_file(folder)
    pretrained = open_pretrained(source, model_file)
    torch.manual_seed(0)
    model = model_file.build("cpu")
    return model, load_pretrained(pretrained, model, ctx=None)


def refused(folder: Path, weights: dict[str, torch.Tensor], path: Path) -> str:
    safetensors_torch.save_file(weights, path)
    with pytest.raises(CheckpointError) as error:
        open_pretrained(path, load_model_file(folder))
    return str(error.value)


def test_weights_equal_transformers_from_pretrained(saved):
    folder, _ = saved
    model, line = loaded(folder, folder)
    expected = reference(folder)
    state = model.state_dict()
    assert set(state) == set(expected)
    assert all(torch.equal(state[name], value) for name, value in expected.items())
    assert f"{len(expected)} tensors (4 of them joined from per-expert tensors)" in line, line


def test_a_file_with_the_stacked_names_loads_as_before(saved, tmp_path):
    """What zplan's own export writes: the model's state-dict names, experts already stacked."""
    folder, _ = saved
    expected = reference(folder)
    safetensors_torch.save_file(expected, tmp_path / "stacked.safetensors")
    model, line = loaded(folder, tmp_path / "stacked.safetensors")
    assert all(torch.equal(model.state_dict()[name], value) for name, value in expected.items())
    assert "joined" not in line


def test_a_missing_expert_tensor_is_named(saved, tmp_path):
    folder, name = saved
    weights = safetensors_torch.load_file(folder / "model.safetensors")
    del weights[name]
    message = refused(folder, weights, tmp_path / "no_expert.safetensors")
    assert "missing 1 of the model's tensors" in message and name in message, message


def test_pieces_of_another_shape_or_dtype_and_extra_experts_are_listed(saved, tmp_path):
    folder, name = saved
    weights = safetensors_torch.load_file(folder / "model.safetensors")
    weights[name] = weights[name][:-1]
    gate = name.replace("w3", "w1").replace("up_proj", "gate_proj")
    weights[gate] = weights[gate].to(torch.int32)
    extra = name.replace(".3.", ".4.")
    weights[extra] = torch.zeros(2)
    message = refused(folder, weights, tmp_path / "bad.safetensors")
    for part in (f"1 of another shape ({name} [", f"1 not floating point ({gate} torch.int32",
                 f"1 unexpected ({extra})"):
        assert part in message, (part, message)


def test_a_slice_reads_its_experts_and_the_gate_and_up_rows_it_names(tmp_path):
    """Experts 3 and 1, rows straddling gate and up out of order, some columns: the stacked tensor's slice."""
    gate = [torch.randn(4, 5) for _ in range(4)]
    up = [torch.randn(4, 5) for _ in range(4)]
    pieces = {f"e.{e}.gate": gate[e] for e in range(4)} | {f"e.{e}.up": up[e] for e in range(4)}
    safetensors_torch.save_file(pieces, tmp_path / "pieces.safetensors")
    stacked = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)  # (4, 8, 5), as MergeModulelist, Concatenate
    joined = Joined("experts.gate_up_proj", (("e.", ".gate"), ("e.", ".up")), dim=1)
    indices = [torch.tensor([3, 1]), torch.tensor([6, 1, 2, 5]), torch.tensor([0, 2, 3])]
    piece = read_joined(joined, weights_of(tmp_path / "pieces.safetensors"), indices)
    assert torch.equal(piece, stacked[indices[0]][:, indices[1]][:, :, indices[2]])
    empty = read_joined(joined, weights_of(tmp_path / "pieces.safetensors"), [torch.tensor([], dtype=torch.long),
                                                                              *indices[1:]])
    assert empty.shape == (0, 4, 3)
