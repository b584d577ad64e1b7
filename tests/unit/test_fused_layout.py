"""The stored order of fused projections (model/fused_layout.py) against orders written out by hand, and a
grouped module computing what the model file's module computes."""

import copy

import pytest
import torch
from torch import nn

from zplan.model.fused_layout import (
    FusedLayout,
    give_output_in_file_order,
    mark_fused,
    stored_layouts,
    to_original,
    to_stored,
)

# Phi-3-like qkv: q of 4 heads, k and v of 2 heads, head_dim 1, in 2 kv-head groups:
# file order  q0 q1 q2 q3 | k0 k1 | v0 v1      (features 0..7)
# stored      q0 q1 k0 v0 | q2 q3 k1 v1        (group 0 of every part, then group 1)
QKV = FusedLayout(parts=(4, 2, 2), groups=2)


def test_stored_order_by_hand():
    assert QKV.stored_order().tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    gate_up = FusedLayout(parts=(3, 3), groups=3)  # g0 g1 g2 | u0 u1 u2 -> g0 u0 g1 u1 g2 u2
    assert gate_up.stored_order().tolist() == [0, 3, 1, 4, 2, 5]


def test_a_ranks_slice_of_the_stored_order_is_each_parts_slice():
    """tp=2: rank r's contiguous half of the stored order holds rank r's half of q, of k and of v, which
    local(2).original_order() puts back in the file order of the rank's parts."""
    stored = QKV.stored_order()
    local = QKV.local(2)
    assert (local.parts, local.groups) == ((2, 1, 1), 1)
    for rank, expected in enumerate(([0, 1, 4, 6], [2, 3, 5, 7])):  # q half, k half, v half of rank `rank`
        piece = stored[4 * rank: 4 * (rank + 1)]
        assert piece[local.original_order()].tolist() == expected


def test_to_stored_and_back_along_either_dimension():
    weight = torch.arange(8 * 3).reshape(8, 3)
    assert torch.equal(to_original(to_stored(weight, QKV, 0), QKV, 0), weight)
    assert to_stored(weight, QKV, 0)[:, 0].tolist() == [3 * i for i in QKV.stored_order().tolist()]
    conv1d_weight = weight.T.contiguous()  # (in, out)
    assert torch.equal(to_stored(conv1d_weight, QKV, 1), to_stored(weight, QKV, 0).T)


def test_a_marked_module_computes_the_same_outputs_and_names_its_layout():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU())
    grouped = copy.deepcopy(model)
    mark_fused(grouped[0], QKV)
    give_output_in_file_order(grouped[0], 1)
    x = torch.randn(5, 3)
    assert torch.equal(grouped(x), model(x))
    assert torch.equal(grouped[0].weight, to_stored(model[0].weight, QKV, 0))
    assert stored_layouts(grouped) == {"0.weight": (QKV, 0), "0.bias": (QKV, 0)}
    with pytest.raises(ValueError, match="already"):
        mark_fused(grouped[0], QKV)


def test_a_checkpoint_of_another_stored_order_is_refused_naming_the_tensor(tmp_path):
    from zplan.errors import CheckpointError
    from zplan.model.fused_layout import layouts_as_json
    from zplan.runtime.checkpoint.state import _check_fused_layouts

    ours = layouts_as_json({"h.0.qkv.weight": (QKV, 0)})
    _check_fused_layouts(tmp_path, ours, ours)
    _check_fused_layouts(tmp_path, {}, {})
    with pytest.raises(CheckpointError, match=r"h\.0\.qkv\.weight as one projection in the model file order"):
        _check_fused_layouts(tmp_path, {}, ours)  # written before zplan stored fused projections grouped
    other = layouts_as_json({"h.0.qkv.weight": (FusedLayout(parts=(4, 2, 2), groups=1), 0)})
    with pytest.raises(CheckpointError, match="groups"):
        _check_fused_layouts(tmp_path, other, ours)
