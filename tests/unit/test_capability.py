"""The capability contract (schemas/capability.py): what a model's traits rule out, read alike by the enumerator,
the compile-time pin check and the emitted program's check_plan."""

import pytest

from tests.unit.test_enumerate import A100, summary
from tests.unit.test_plan_check import model_file, plan_for  # noqa: F401 (model_file is a fixture)
from zplan.api import check_pins_against_model
from zplan.errors import PlanMismatchError, SpecError
from zplan.planner.enumerate import enumerate_candidates
from zplan.runtime.plan.check import check_plan
from zplan.schemas import ModelTrait, Pins
from zplan.schemas.capability import RULES, capability_problems

FUSED = ModelTrait(kind="fused_projection", module="blocks.0.attn.qkv", detail="one Linear sliced in three")
ROUTER = ModelTrait(kind="parameters_outside_split_linears", module="blocks.0.router", detail="a Router")
SPLIT = ModelTrait(kind="forward_not_split_by_stages", module="blocks.0", detail="called with mask")


def with_traits(*traits, block_tokens=None):
    return summary().model_copy(update={"traits": list(traits), "block_tokens": block_tokens})


def degrees(model, gpus=8, batch=64):
    c = enumerate_candidates(model, A100, gpus, batch, Pins())
    return set(c.tp.tolist()), set(c.pp.tolist()), set(c.sp.tolist())


def test_every_trait_kind_has_a_rule():
    kinds = ModelTrait.model_fields["kind"].annotation.__args__
    assert set(kinds) == set(RULES)


def test_the_enumerator_proposes_only_what_the_traits_allow():
    assert degrees(with_traits()) == ({1, 2, 4}, {1, 2, 4, 8}, {0, 1})
    assert degrees(with_traits(FUSED)) == ({1}, {1, 2, 4, 8}, {0})  # no tensor (nor sequence) parallel
    assert degrees(with_traits(ROUTER)) == ({1, 2, 4}, {1, 2, 4, 8}, {0})  # tensor parallel, not sequence
    assert degrees(with_traits(SPLIT)) == ({1, 2, 4}, {1}, {0, 1})  # no pipeline
    assert degrees(with_traits(block_tokens=17)) == ({1, 2, 4}, {1, 2, 4, 8}, {0})  # 17 tokens: no tp divides


def test_a_pipeline_runs_at_least_as_many_micro_batches_as_stages():
    c = enumerate_candidates(summary(), A100, 8, 8, Pins())
    micro_batches = 8 // (c.dp * c.micro_batch)
    assert (micro_batches[c.pp > 1] >= c.pp[c.pp > 1]).all() and (c.pp > 1).any()


def test_a_pin_the_traits_rule_out_fails_at_compile_naming_module_and_pin():
    with pytest.raises(SpecError, match=r"--tp: the runtime cannot run tensor parallel on this model: "
                                        r"blocks\.0\.attn\.qkv \(one Linear sliced in three\).*use --tp 1"):
        check_pins_against_model(Pins(tp=2), with_traits(FUSED))
    with pytest.raises(SpecError, match=r"--pp: .*blocks\.0 \(called with mask\).*use --pp 1"):
        check_pins_against_model(Pins(pp=2), with_traits(SPLIT))
    with pytest.raises(SpecError, match="17 tokens per sample, which tp=2 does not divide"):
        check_pins_against_model(Pins(tp=2, sequence_parallel=True), with_traits(block_tokens=17))
    check_pins_against_model(Pins(tp=2, pp=2), with_traits(ROUTER))  # allowed: no error


def test_messages_name_every_capability_asked_for():
    problems = capability_problems([FUSED, SPLIT], tp=2, pp=2, sequence_parallel=True)
    assert [p.split(":")[0] for p in problems] == ["parallel.tp", "parallel.sequence_parallel", "parallel.pp"]


def test_a_hand_edited_plan_that_contradicts_the_traits_is_refused_by_check_plan(model_file):  # noqa: F811
    plan = plan_for(model_file)
    check_plan(plan, model_file, world_size=2)
    edited = plan.model_copy(update={
        "model": plan.model.model_copy(update={"traits": [SPLIT]}),
        "parallel": plan.parallel.model_copy(update={"pp": 2, "dp": 1})})
    with pytest.raises(PlanMismatchError, match=r"parallel\.pp: the runtime cannot run pipeline on this model: "
                                                r"blocks\.0 \(called with mask\)"):
        check_plan(edited, model_file, world_size=2)
