"""The legality table (schemas.legality): every rule has its reason, the same condition answers on scalars and on
arrays, and the enumerator's masks and the placement's combinations are the table's."""

import ast
import itertools
import re
from pathlib import Path

import numpy as np
import pytest
from torch import nn

from zplan.api import check_pins
from zplan.errors import SpecError
from zplan.planner.clusters import BUILTIN_CLUSTERS
from zplan.planner.cost import inputs
from zplan.planner.enumerate import _grid
from zplan.planner.placement import STATES, TIERS, enumerate_legal_placements
from zplan.runtime.parallel.data_parallel import apply_data_parallel
from zplan.schemas import LayerCost, ModelSummary, Pins, legality
from zplan.schemas.spec import CompressionConfig

A100 = BUILTIN_CLUSTERS["dgx-a100-80g"]


def summary() -> ModelSummary:
    units = [LayerCost(name="embed", kind="embedding", params=1, fwd_flops=0.0, act_bytes=0.0)]
    units += [LayerCost(name=f"blocks.{i}", kind="block", params=1, fwd_flops=1.0, act_bytes=1.0) for i in range(8)]
    return ModelSummary(name="m", source="family", tracer="closed-form", num_blocks=8, hidden=768, heads=8,
                        kv_heads=8, ffn_hidden=3072, vocab=1000, seq_len=128, params=9, layers=units,
                        block_prefix="blocks", tp_rules=[])


def test_every_rule_has_a_name_its_fields_a_reason_and_a_fix():
    assert len(legality.BY_NAME) == len(legality.RULES)  # names are unique
    for rule in legality.RULES:
        assert rule.fields and set(rule.fields) <= set(legality.DOMAINS), rule.name
        assert len(rule.reason) > 20 and rule.fix, rule.name


@pytest.mark.parametrize("rule", legality.RULES, ids=lambda rule: rule.name)
def test_the_scalar_check_and_the_array_mask_agree_on_every_configuration(rule):
    grid = list(itertools.product(*(legality.DOMAINS[f] for f in rule.fields)))
    arrays = {f: np.array([point[i] for point in grid], dtype=np.int64) for i, f in enumerate(rule.fields)}
    mask = np.broadcast_to(rule.holds(arrays), len(grid))
    scalar = [not legality.violations(dict(zip(rule.fields, point, strict=True)), [rule]) for point in grid]
    assert mask.dtype == bool and mask.tolist() == scalar
    assert not all(scalar), f"{rule.name} rules nothing out"


@pytest.mark.parametrize("pins", [Pins(), Pins(cp=2), Pins(compress=CompressionConfig(grad="1bit")),
                                  Pins(compress=CompressionConfig(grad="int8", activations="int8")),
                                  Pins(cp=2, compress=CompressionConfig(weights="int8"))])
def test_the_enumerators_masks_are_the_tables(pins):
    g = _grid(summary(), A100, 8, 16, pins)
    compression = legality.config(**(pins.compress or CompressionConfig()).model_dump())
    points = [dict(tp=int(g.tp[i]), pp=int(g.pp[i]), cp=int(g.cp[i]), ep=int(g.ep[i]), zero=int(g.zero[i]),
                   offload=int(g.offload[i]),
                   sequence_parallel=int(g.sp[i]), interleave=int(g.interleave[i]), **compression)
              for i in range(len(g.tp))]
    masks = {rule.name: rule.mask for rule in g.rules if rule.name}
    expected = legality.applicable(points[0])
    assert set(masks) == {rule.name for rule in expected}
    assert {"offload_needs_zero", "context_parallel_without_offload", "interleave_needs_pipeline"} <= set(masks)
    for rule in expected:
        assert masks[rule.name].tolist() == [not legality.violations(p, [rule]) for p in points], rule.name
    # what the grid keeps breaks no rule of the table (and context parallel with compression keeps nothing)
    kept = np.nonzero(np.logical_and.reduce([rule.mask for rule in g.rules]))[0]
    assert (len(kept) > 0) == (pins.cp is None or pins.compress is None)
    assert not any(legality.violations(points[i]) for i in kept)


def test_the_placements_are_the_tables():
    for zero, offload, pinned in itertools.product(range(4), legality.OFFLOAD_TIERS, (False, True)):
        by_table = []
        for combo in itertools.product(TIERS, repeat=3):
            values = legality.config(zero=zero, offload=offload, offload_pinned=pinned,
                                     **dict(zip(legality.STATES, combo, strict=True)))
            if not legality.violations(values, legality.PLACEMENT_RULES):
                by_table.append(dict(zip(STATES, combo, strict=True)))
        assert enumerate_legal_placements(zero, offload, pinned) == by_table
        assert by_table or (pinned and offload != "none" and zero == 0)


def test_the_codes_are_the_cost_models():
    assert legality.OFFLOAD_TIERS == inputs.OFFLOAD_TIERS
    assert (legality.NAMES["grad"], legality.NAMES["weights"], legality.NAMES["activations"]) == (
        inputs.GRAD_COMPRESSION, inputs.WEIGHT_COMPRESSION, inputs.ACTIVATION_COMPRESSION)


def test_config_encodes_names_and_refuses_unknown_ones():
    assert legality.config(offload="nvme", grad="1bit", precision="nvfp4", sequence_parallel=True, tp=None) == {
        "offload": 2, "grad": 2, "precision": 4, "sequence_parallel": 1}
    with pytest.raises(ValueError, match="offload is one of none, cpu, nvme"):
        legality.config(offload="disk")
    with pytest.raises(ValueError, match="no legality field"):
        legality.config(stage=1)


def test_satisfiable_finds_the_pins_a_rule_leaves_no_room_for():
    rules = legality.applicable(dict.fromkeys(("delayed_update", "zero", "offload")))
    assert legality.satisfiable(legality.config(delayed_update=1, offload="cpu"), rules)
    assert not legality.satisfiable(legality.config(delayed_update=1, zero=3), rules)
    assert not legality.satisfiable(legality.config(delayed_update=1, offload="nvme"), rules)


def test_the_table_is_torch_and_numpy_free():
    tree = ast.parse((Path(legality.__file__)).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 and node.module}
    assert not imported & {"numpy", "torch"}


@pytest.mark.parametrize("pins, needle", [
    (Pins(zero=0, offload="cpu"), "the pins --offload cpu and --zero 0 conflict: CPU or NVMe offload needs ZeRO >= 1"),
    (Pins(cp=2, offload="nvme"), "the pins --cp 2 and --offload nvme conflict: context parallel runs without offload"),
    (Pins(pp=1, interleave=2), "interleave > 1 needs a pipeline"),
])
def test_the_pin_checks_read_the_table(pins, needle):
    with pytest.raises(SpecError, match=re.escape(needle)):
        check_pins(8, pins)


@pytest.mark.parametrize("zero, offload, grad, weights, needle", [
    (0, "cpu", "none", "none", "cpu offload with ZeRO 0: CPU or NVMe offload needs ZeRO >= 1"),
    (1, "none", "none", "int8", "--compress weights=int8 with ZeRO 1: weights=int8 needs ZeRO 3"),
    (2, "none", "int8", "none", "--compress grad=int8 with ZeRO 2: grad=int8 needs ZeRO 0 or 1"),
    (1, "cpu", "1bit", "none", "--compress grad=1bit with cpu offload: grad=1bit needs no offload"),
])
def test_data_parallel_refuses_what_the_table_rules_out(zero, offload, grad, weights, needle):
    with pytest.raises(NotImplementedError, match=re.escape(needle)):
        apply_data_parallel(nn.Linear(2, 2), None, zero, "fp32", offload, "blocks", grad, weights)
