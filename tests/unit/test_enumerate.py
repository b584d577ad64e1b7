"""Candidate enumeration against a plain-Python brute force of the same legality rules."""

import itertools

import pytest

from zplan.planner.clusters import BUILTIN_CLUSTERS
from zplan.planner.cost.inputs import OFFLOAD_TIERS
from zplan.planner.enumerate import (
    INTERLEAVE_CHOICES,
    MAX_MICRO_BATCH,
    enumerate_candidates,
    explain_no_candidates,
)
from zplan.schemas import LayerCost, ModelSummary, Pins

A100 = BUILTIN_CLUSTERS["dgx-a100-80g"]


def summary(blocks=12, heads=12, kv_heads=4) -> ModelSummary:
    units = [LayerCost(name="embed", kind="embedding", params=1, fwd_flops=0.0, act_bytes=0.0)]
    units += [LayerCost(name=f"blocks.{i}", kind="block", params=1, fwd_flops=1.0, act_bytes=1.0)
              for i in range(blocks)]
    return ModelSummary(name="m", source="family", tracer="closed-form", num_blocks=blocks, hidden=768,
                        heads=heads, kv_heads=kv_heads, ffn_hidden=3072, vocab=1000, seq_len=128,
                        params=blocks + 1, layers=units, block_prefix="blocks", tp_rules=[])


def brute_force(model, gpus, batch):
    out = set()
    for tp, pp, mb, z, r, sp, v, off in itertools.product(
        range(1, gpus + 1), range(1, gpus + 1), range(1, MAX_MICRO_BATCH + 1), range(4), range(3), range(2),
        INTERLEAVE_CHOICES, range(3)
    ):
        if gpus % (tp * pp):
            continue
        dp = gpus // (tp * pp)
        legal = (
            model.heads % tp == 0 and model.kv_heads % tp == 0 and pp <= model.num_blocks
            and batch % (dp * mb) == 0 and (sp == 0 or tp > 1) and (off == 0 or z >= 1)
            and (v == 1 or pp > 1) and pp * v <= model.num_blocks + 2  # a chunk may hold the embedding or head alone
            and (pp == 1 or batch // dp // mb >= pp)  # 1F1B: at least one micro-batch per stage
            and (v == 1 or (batch // dp // mb) % pp == 0)
        )  # the runtime runs CPU and NVMe offload with ZeRO 1/2/3 (the A100 profile has NVMe)
        if legal:
            out.add((tp, pp, dp, mb, z, r, sp, v, off))
    return out


def as_set(c):
    return set(zip(*(x.tolist() for x in (c.tp, c.pp, c.dp, c.micro_batch, c.zero, c.recompute, c.sp,
                                          c.interleave, c.offload)), strict=True))


@pytest.mark.parametrize("gpus,batch", [(8, 16), (4, 24), (16, 32)])
def test_enumeration_equals_brute_force(gpus, batch):
    model = summary()
    assert as_set(enumerate_candidates(model, A100, gpus, batch, Pins())) == brute_force(model, gpus, batch)


@pytest.mark.parametrize("pins", [Pins(offload="nvme"), Pins(offload="nvme", zero=1), Pins(offload="cpu", zero=2)])
def test_an_offload_pin_keeps_exactly_its_tier(pins):
    model = summary()
    expected = {c for c in brute_force(model, 8, 16)
                if c[8] == OFFLOAD_TIERS.index(pins.offload) and (pins.zero is None or c[4] == pins.zero)}
    assert expected and as_set(enumerate_candidates(model, A100, 8, 16, pins)) == expected


def test_nvme_offload_is_legal_with_zero_1_2_3_unpinned_too():
    """runtime.optim.nvme_states runs NVMe with ZeRO 1 (NvmeStates with RowShards) and ZeRO 2/3 (NvmeStates with
    WholeShards): the search prices it like any other candidate; ZeRO 0 never offloads."""
    unpinned = as_set(enumerate_candidates(summary(), A100, 8, 16, Pins()))
    assert {c[4] for c in unpinned if c[8] == 2} == {1, 2, 3}
    for zero in (1, 2, 3):
        pinned = enumerate_candidates(summary(), A100, 8, 16, Pins(offload="nvme", zero=zero))
        assert len(pinned) > 0 and set(pinned.zero.tolist()) == {zero} and set(pinned.offload.tolist()) == {2}
    assert len(enumerate_candidates(summary(), A100, 8, 16, Pins(offload="nvme", zero=0))) == 0


def test_cpu_offload_with_zero1_is_chosen_unpinned():
    """The runtime runs ZeRO-1 + CPU offload (runtime.optim.host_states): no pin needed."""
    model = summary()
    unpinned = as_set(enumerate_candidates(model, A100, 8, 16, Pins()))
    assert any(c[8] == 1 and c[4] == 1 for c in unpinned)
    assert not any(c[8] == 1 and c[4] == 0 for c in unpinned)
    pinned = as_set(enumerate_candidates(model, A100, 8, 16, Pins(offload="cpu", zero=1)))
    assert pinned == {c for c in unpinned if c[8] == 1 and c[4] == 1}


def test_pins_fix_values():
    model = summary()
    cand = enumerate_candidates(model, A100, 16, 32, Pins(tp=2, zero=3, recompute="full", offload="cpu"))
    assert len(cand) > 0
    assert set(cand.tp.tolist()) == {2} and set(cand.zero.tolist()) == {3}
    assert set(cand.recompute.tolist()) == {2} and set(cand.offload.tolist()) == {1}


def test_no_nvme_tier_on_a_cluster_without_nvme():
    no_nvme = A100.model_copy(update={"nvme_bytes": 0})
    cand = enumerate_candidates(summary(), no_nvme, 8, 16, Pins())
    assert 2 not in set(cand.offload.tolist())


def test_a_pinned_tp_must_divide_the_heads():
    assert len(enumerate_candidates(summary(heads=12, kv_heads=4), A100, 8, 16, Pins(tp=8))) == 0
    assert len(enumerate_candidates(summary(heads=12, kv_heads=4), A100, 8, 16, Pins(tp=4))) > 0


@pytest.mark.parametrize("pins, cluster, gpus, batch, named, rule", [
    (Pins(offload="nvme", zero=1), A100.model_copy(update={"nvme_bytes": 0}), 8, 16, ["--offload nvme"],
     "NVMe offload needs a cluster with NVMe"),
    (Pins(tp=8), A100, 8, 16, ["--tp 8"], "tp divides the 12 attention heads and 4 KV heads"),
    (Pins(pp=4, interleave=4), A100, 8, 16, ["--pp 4", "--interleave 4"], "pp * interleave <= the blocks + 2"),
    (Pins(micro_batch=3), A100, 8, 16, ["--micro-batch 3"], "the global batch 16 divides by dp * micro-batch"),
    (Pins(sequence_parallel=True), A100, 1, 16, ["--sequence-parallel"], "sequence parallel needs tp > 1"),
    (Pins(pp=4, micro_batch=4), A100, 4, 8, ["--pp 4", "--micro-batch 4"], "a pipeline gets at least pp micro-batches"),
])
def test_the_conflict_message_names_the_pins_and_the_rule(pins, cluster, gpus, batch, named, rule):
    model = summary()
    assert len(enumerate_candidates(model, cluster, gpus, batch, pins)) == 0
    message = explain_no_candidates(model, cluster, gpus, batch, pins)
    assert rule in message, message
    assert "; or " not in message  # one rule alone explains it
    pin_part = message.split("break")[0]
    assert all(pin in pin_part for pin in named), message


def test_two_rules_that_each_explain_a_conflict_are_both_named():
    # dp=2 and pp=4 leave tp=1 and 2 micro-batches for 4 stages: relaxing either rule would leave candidates
    message = explain_no_candidates(summary(), A100, 8, 16, Pins(pp=4, micro_batch=4, dp=2))
    assert "the pins --dp 2 and --pp 4 break the rule: dp * tp * pp * cp = 8 GPUs" in message
    assert "; or the pins --pp 4 and --micro-batch 4 and --dp 2 break the rule: a pipeline gets" in message


def test_search_raises_the_conflict_message():
    from zplan.errors import SpecError
    from zplan.planner.search import choose, score
    from zplan.schemas.spec import TrainSpec

    model, no_nvme = summary(), A100.model_copy(update={"nvme_bytes": 0})
    train = TrainSpec(global_batch=16, seq_len=128, precision="bf16")
    pins = Pins(offload="nvme", zero=2)
    with pytest.raises(SpecError, match="the pin --offload nvme breaks the rule: NVMe offload needs a cluster"):
        choose(model, no_nvme, 8, train, pins, score(model, no_nvme, 8, train, pins))
