"""Candidate enumeration against a plain-Python brute force of the same legality rules."""

import itertools

import pytest

from zplan.planner.clusters import BUILTIN_CLUSTERS
from zplan.planner.cost.inputs import OFFLOAD_TIERS
from zplan.planner.enumerate import INTERLEAVE_CHOICES, MAX_MICRO_BATCH, enumerate_candidates
from zplan.schemas import LayerCost, ModelSummary, Pins

A100 = BUILTIN_CLUSTERS["dgx-a100-80g"]


def summary(blocks=12, heads=12, kv_heads=4) -> ModelSummary:
    units = [LayerCost(name="embed", kind="embedding", params=1, fwd_flops=0.0, act_bytes=0.0)]
    units += [LayerCost(name=f"blocks.{i}", kind="block", params=1, fwd_flops=1.0, act_bytes=1.0)
              for i in range(blocks)]
    return ModelSummary(name="m", source="family", tracer="closed-form", num_blocks=blocks, hidden=768,
                        heads=heads, kv_heads=kv_heads, ffn_hidden=3072, vocab=1000, seq_len=128,
                        params=blocks + 1, layers=units, block_prefix="blocks", tp_rules=[])


def brute_force(model, gpus, batch, runtime_gaps_pinned=False):
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
            and batch % (dp * mb) == 0 and (sp == 0 or tp > 1) and (off == 0 or z >= 1) and (off < 2 or z == 3)
            and (v == 1 or pp > 1) and pp * v <= model.num_blocks
            and (pp == 1 or batch // dp // mb >= pp)  # 1F1B: at least one micro-batch per stage
            and (v == 1 or (model.num_blocks % (pp * v) == 0 and (batch // dp // mb) % pp == 0))
            # the runtime runs CPU offload with ZeRO 1/2/3, NVMe not yet: NVMe only when pinned
            and (off == 0 or (off == 1 and z >= 1) or runtime_gaps_pinned)
        )
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


@pytest.mark.parametrize("pins", [Pins(offload="nvme")])
def test_what_the_runtime_cannot_run_yet_is_there_only_when_pinned(pins):
    model = summary()
    expected = {c for c in brute_force(model, 8, 16, runtime_gaps_pinned=True)
                if c[8] == OFFLOAD_TIERS.index(pins.offload) and (pins.zero is None or c[4] == pins.zero)}
    assert as_set(enumerate_candidates(model, A100, 8, 16, pins)) == expected
    assert not [c for c in brute_force(model, 8, 16) if c[8] == 2 or (c[8] == 1 and c[4] < 1)]


def test_cpu_offload_with_zero1_is_chosen_unpinned():
    """The runtime runs ZeRO-1 + CPU offload (runtime.offload.cpu_adam_optimizer): no pin needed."""
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
