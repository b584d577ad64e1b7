"""Memory formulas against hand computations from the papers they cite."""

import numpy as np
import pytest

from zplan.planner.clusters import BUILTIN_CLUSTERS
from zplan.planner.cost.inputs import Candidates, ModelNumbers
from zplan.planner.cost.memory import block_activation_bytes, inflight_microbatches, memory_per_gpu

A100 = BUILTIN_CLUSTERS["dgx-a100-80g"]
S, H, A, V, L = 2048, 4096, 32, 51200, 32


def gpt_numbers(act_per_sample=34 * S * H + 5 * A * S * S, core=5 * A * S * S) -> ModelNumbers:
    """Korthikanti's GPT block: an unfused attention core saves `core` of `act_per_sample` bytes."""
    block = 12 * H * H
    return ModelNumbers(num_blocks=L, hidden=H, heads=A, ffn_hidden=4 * H, vocab=V, seq_len=S,
                        params=L * block, embed_params=0.0, embed_fwd_flops=0.0, head_params=0.0,
                        head_fwd_flops=0.0, block_params=block, block_fwd_flops=24 * S * H * H,
                        block_act_bytes=act_per_sample, embed_act_bytes=0.0, head_act_bytes=0.0,
                        block_attention_core_bytes=core)


def one(**kw):
    base = dict(tp=1, pp=1, dp=8, micro_batch=1, zero=0, recompute=0, sp=0, interleave=1, offload=0)
    base.update(kw)
    return Candidates.single(**base)


@pytest.mark.parametrize("zero,expected", [
    (0, (2, 2, 12)),          # the paper's 2 + 2 + 12: bf16 weights and gradients, fp32 master, m and v
    (1, (2, 2, 12 / 8)),      # the paper's 4 + 12 / N
    (2, (4 / 8, 4 / 8, 8 / 8)),  # FSDP2's fp32 shards at rest (the masters), fp32 gradient shards: 16 / N
    (3, (4 / 8, 4 / 8, 8 / 8)),  # 16 psi / N
])
def test_model_states_are_the_runtimes(zero, expected):
    """bf16 on 8 GPUs, (weights, gradients, optimizer) bytes per parameter as the runtime holds them: ZeRO 0/1
    the ZeRO paper's mixed-precision layout (runtime.optim.layouts: bf16 parameters and gradients, the fp32 masters with
    Adam's moments in the optimizer), ZeRO 2/3 FSDP2's fp32 shards with fp32 gradients (Rajbhandari et al. Fig. 1,
    K = 12)."""
    model = gpt_numbers()
    mem = memory_per_gpu(model, one(zero=zero), A100, "bf16", np.array([1.0]))
    states = (mem.parameters[0], mem.gradients[0], mem.optimizer[0])
    assert states == pytest.approx(tuple(b * model.params for b in expected))


def test_one_bit_adam_keeps_fp32_parameters_under_autocast():
    """1-bit Adam (--compress grad=1bit) steps fp32 parameters: 4 + 4 + 8 at ZeRO 0, and autocast's bf16 copies of
    the weights (2 psi; the model has no embedding) among the buffers, beside DDP's two 25 MiB fp32 buckets."""
    model = gpt_numbers()
    mem = memory_per_gpu(model, one(zero=0).with_compression("1bit", "none", "none"), A100, "bf16", np.array([1.0]))
    assert (mem.parameters[0], mem.gradients[0], mem.optimizer[0]) == pytest.approx(
        (4 * model.params, 4 * model.params, 8 * model.params))
    assert mem.comm_buffers[0] >= 2 * model.params + 2 * 25 * 2**20


def test_compute_copies_are_held_from_forward_to_backward():
    """By hand for the 6.4B GPT on 8 GPUs in bf16. ZeRO-2 (FSDP2, reshard_after_forward=False): 4/8 + 4/8
    + 8/8 bytes per parameter at rest; in the step every block's gathered bf16 weights (2 bytes each)
    plus two blocks' fp32 reduce-scatter inputs (the block after's, kept until this block's; and this block's, larger
    than its bf16 gradients). ZeRO-3 gathers only the next block (prefetched) besides the same reduce-scatter input of
    the block after, and holds the larger of its own gathered weights with its bf16 gradients (2 + 2 bytes) and its
    own fp32 input (4 bytes): 4 + 2 + 4 bytes a block parameter. ZeRO-0 computes on its bf16 weights
    themselves: no copies, only DDP's two 25 MiB buckets and, in backward, the (V, h) table's gradient autograd makes
    before adding it to its bucket view (2 bytes a value)."""
    model = gpt_numbers()
    psi, block = model.params, model.block_params  # 32 * 12 h^2, 12 h^2
    z0 = memory_per_gpu(model, one(zero=0), A100, "bf16", np.array([1.0]))
    z2 = memory_per_gpu(model, one(zero=2), A100, "bf16", np.array([1.0]))
    z3 = memory_per_gpu(model, one(zero=3), A100, "bf16", np.array([1.0]))
    at_rest = (z2.parameters[0], z2.gradients[0], z2.optimizer[0])
    assert at_rest == pytest.approx((4 * psi / 8, 4 * psi / 8, 8 * psi / 8))
    assert z2.comm_buffers[0] == pytest.approx(2 * psi + 2 * 4 * block)
    assert z3.comm_buffers[0] == pytest.approx((4 + 2 + 4) * block)
    assert z0.comm_buffers[0] == pytest.approx(2 * 25 * 2**20 + 2 * V * H)
    # the peak: ZeRO-2 holds all its gathered weights (2 psi) where ZeRO-3 holds one block more; the rest is equal
    assert z2.total[0] - z3.total[0] == pytest.approx(2 * psi - 2 * block)
    fp32 = memory_per_gpu(model, one(zero=0), A100, "fp32", np.array([1.0]))
    assert fp32.comm_buffers[0] == pytest.approx(2 * 25 * 2**20 + 4 * V * H)  # no copies; the table gradient in fp32


def test_fp32_states_are_four_plus_four_plus_eight():
    model = gpt_numbers()
    mem = memory_per_gpu(model, one(zero=0), A100, "fp32", np.array([1.0]))
    assert (mem.parameters + mem.gradients + mem.optimizer)[0] == pytest.approx(16.0 * model.params)


def test_offload_keeps_the_parameter_and_gradient_shards_on_the_gpu_where_they_fit():
    """ZeRO 2/3 with offload: the optimizer alone leaves the GPU when the weight and gradient shards fit there
    (runtime.optim.host_states); FSDP2's CPUOffloadPolicy takes them to the host only when they do not."""
    model = gpt_numbers()
    shard = model.params / 8  # dp = 8: this GPU's shard of every parameter
    mem = memory_per_gpu(model, one(zero=2, offload=1), A100, "bf16", np.array([1.0]))
    # bf16, no recompute: fp32 shards 2 x 4 B x P/8 = 6.4 GB, the gathered bf16 copy 2 B x P = 12.9 GB (in the
    # 14.5 GB of buffers), activations 32 x (34 s h + 5 a s^2) B = 30.3 GB (32.1 GB with the logits), the reserve:
    # 55 GB, under 80 GB, so the shards stay
    assert not mem.parameters_offloaded[0]
    assert mem.optimizer[0] == 0.0 and mem.parameters[0] == mem.gradients[0] == pytest.approx(4 * shard)
    # each of the node's 8 GPUs keeps on the host, per parameter of its shard: the CPU Adam's fp32 master, m and v
    # (12) and the buffer the fp32 gradient comes down to (4)
    assert mem.cpu_bytes_per_node[0] == pytest.approx(8 * (12 + 4) * shard)
    # NVMe with the shards on the GPU: the moments in files, nothing else off the GPU
    nvme = memory_per_gpu(model, one(zero=3, offload=2), A100, "fp32", np.array([1.0]))
    assert not nvme.parameters_offloaded[0] and nvme.parameters[0] == pytest.approx(4 * shard)
    assert nvme.nvme_bytes_per_node[0] == pytest.approx(8 * 8 * shard) and nvme.cpu_bytes_per_node[0] == 0.0


def test_offload_moves_the_shards_to_the_host_when_the_gpu_cannot_hold_them():
    model = gpt_numbers()
    shard = model.params / 8
    small = A100.model_copy(update={"gpu": A100.gpu.model_copy(update={"hbm_bytes": 16e9})})  # < 32 GB activations
    mem = memory_per_gpu(model, one(zero=2, offload=1), small, "bf16", np.array([1.0]))
    # ZeRO-2 under FSDP2's CPUOffloadPolicy: weight and gradient shards leave the GPU with the optimizer
    assert mem.parameters_offloaded[0]
    assert mem.optimizer[0] == 0.0 and mem.gradients[0] == 0.0 and mem.parameters[0] == 0.0
    # per parameter of the shard on the host: 12 (fp32 master, m, v) + 4 (fp32 gradient)
    assert mem.cpu_bytes_per_node[0] == pytest.approx(8 * (12 + 4) * shard)
    # fp32: the weight shard is the master (4), beside m and v (8) and the gradient (4)
    fp32 = memory_per_gpu(model, one(zero=3, offload=1), small, "fp32", np.array([1.0]))
    assert fp32.parameters_offloaded[0] and fp32.cpu_bytes_per_node[0] == pytest.approx(8 * (8 + 4 + 4) * shard)
    # NVMe: the optimizer's bytes on NVMe, the FSDP2 shards still in host memory
    nvme = memory_per_gpu(model, one(zero=3, offload=2), small, "fp32", np.array([1.0]))
    assert nvme.nvme_bytes_per_node[0] == pytest.approx(8 * 8 * shard)
    assert nvme.cpu_bytes_per_node[0] == pytest.approx(8 * 8 * shard)


GATHERED = 4  # s*b*h units: the all-gathered inputs of the two column-parallel projections, 2 x 2sbh at 16-bit

@pytest.mark.parametrize("tp,sp,recompute,expected", [
    # Korthikanti et al. Table 2, per layer, s*b*h units (b = 1); with sequence parallel torch's tensor parallel
    # keeps the all-gathered projection inputs whole (Megatron re-gathers them in backward): GATHERED stays whole
    (1, 0, 0, 34 + 5 * A * S / H),
    (8, 0, 0, 10 + 24 / 8 + 5 * A * S / (H * 8)),
    (8, 1, 0, (34 - GATHERED + 5 * A * S / H) / 8 + GATHERED),
    (8, 1, 1, (34 - GATHERED) / 8 + GATHERED),          # sequence parallel + selective recompute
    (1, 0, 2, 2),               # full recompute keeps the layer input
    (8, 1, 2, 2 / 8),
])
def test_activation_bytes_match_korthikanti_table_2(tp, sp, recompute, expected):
    model = gpt_numbers()
    got = block_activation_bytes(model, one(tp=tp, sp=sp, recompute=recompute), "bf16")
    assert got[0] / (S * H) == pytest.approx(expected)


def test_flash_attention_model_has_nothing_for_selective_recompute_to_drop():
    model = gpt_numbers(act_per_sample=34 * S * H, core=0.0)  # no (s, s) tensors saved
    none = block_activation_bytes(model, one(tp=8, sp=1, recompute=0), "bf16")
    selective = block_activation_bytes(model, one(tp=8, sp=1, recompute=1), "bf16")
    assert none[0] == selective[0] == pytest.approx(((34 - GATHERED) / 8 + GATHERED) * S * H)


def test_first_stage_of_1f1b_holds_p_microbatches_and_interleaving_more():
    cand = Candidates(**{k: np.array(v) for k, v in dict(
        tp=[1, 1, 1], pp=[4, 4, 4], dp=[1, 1, 1], micro_batch=[1, 1, 1], zero=[0, 0, 0], recompute=[0, 0, 0],
        sp=[0, 0, 0], interleave=[1, 2, 1], offload=[0, 0, 0]).items()})
    got = inflight_microbatches(cand, np.array([16.0, 16.0, 2.0]))
    assert got.tolist() == pytest.approx([4.0, 4.0 * (1 + 3 / 8), 2.0])


# ---- embedding, head, logits and loss: replicated over tp where the model's vocabulary cannot be split, split by
# vocabulary rows where it can (runtime/parallel/vocab_parallel.py; ParallelConfig.vocab_parallel)
# ----------------

E, HD = V * H + S * H, 2 * H + V * H  # a token + position table; a final norm and an untied head


def edged_numbers(vocab_splittable: bool = False) -> ModelNumbers:
    block = 12 * H * H
    return ModelNumbers(num_blocks=L, hidden=H, heads=A, ffn_hidden=4 * H, vocab=V, seq_len=S,
                        params=E + L * block + HD, embed_params=E, embed_fwd_flops=0.0, head_params=HD,
                        head_fwd_flops=2.0 * S * H * V, block_params=block, block_fwd_flops=24 * S * H * H,
                        block_act_bytes=34 * S * H, embed_act_bytes=0.0, head_act_bytes=4.0 * S * H,
                        embed_vocab_params=V * H, head_vocab_params=V * H, vocab_splittable=vocab_splittable)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_tp_halves_the_blocks_but_not_an_unsplittable_embedding_or_head(precision):
    """tp=2, ZeRO 0 (16 bytes per parameter on every GPU), a model whose vocabulary the runtime cannot split: the
    embedding, the final norm and the head are whole on each rank; only the blocks' parameters are halved."""
    model, block = edged_numbers(), 12 * H * H
    single = memory_per_gpu(model, one(tp=2), A100, precision, np.array([1.0]))
    assert single.stage_params[0] == pytest.approx(E + HD + L * block / 2)  # not (E + HD + L * block) / 2
    assert (single.parameters + single.gradients + single.optimizer)[0] == pytest.approx(16 * (E + HD + L * block / 2))
    staged = memory_per_gpu(model, one(tp=2, pp=2), A100, precision, np.array([4.0]))
    # the head's stage: its 16 blocks halved, the head whole (HD > E here, and the logits live on it)
    assert staged.stage_params[0] == pytest.approx(max(E, HD) + (L / 2) * block / 2)


def test_a_split_vocabulary_divides_the_tables_not_the_rest_of_the_edges():
    """tp=4, a splittable vocabulary: each rank holds V/4 rows of the token table and of the head, and the position
    table and final norm whole; at tp=1 nothing is split."""
    model, block = edged_numbers(vocab_splittable=True), 12 * H * H
    mem = memory_per_gpu(model, one(tp=4), A100, "bf16", np.array([1.0]))
    edges = (V * H / 4 + S * H) + (2 * H + V * H / 4)
    assert mem.stage_params[0] == pytest.approx(edges + L * block / 4)
    assert memory_per_gpu(model, one(tp=1), A100, "bf16", np.array([1.0])).stage_params[0] == pytest.approx(
        E + HD + L * block)


@pytest.mark.parametrize("vocab_splittable, share", [(False, 1.0), (True, 16.0 / 12.0 / 2)])
def test_logits_and_the_loss_peak_on_a_rank(vocab_splittable, share):
    """One stage, tp=2 with sequence parallel and full recompute, b=1, fp32, by hand: the blocks keep their inputs
    (s*h*4 / 2 each) plus one recomputed block (34 s h / 2); the larger of the embedding's output (s*h*elem) and
    the head's saved inputs (head_act_bytes, 4 s h here, whole: the final norm and the head's input are replicated);
    a model file's own loss's fp32 temporaries, 3 * 4 bytes per logit (benchmarks/loss_memory.py: the logits
    themselves are gone) of all V on every rank when the vocabulary is replicated, and 16 per local logit of V/tp under
    torch's loss_parallel when it is split."""
    model = edged_numbers(vocab_splittable)
    mem = memory_per_gpu(model, one(tp=2, sp=1, recompute=2), A100, "fp32", np.array([1.0]))
    blocks = L * S * H * 4 / 2 + 34 * S * H / 2
    assert mem.activations[0] == pytest.approx(blocks + S * H * 4 + S * V * 12.0 * share)
    assert mem.terms["logits and loss"][0] == pytest.approx(S * V * 12.0 * share)
    assert sum(mem.terms.values())[0] == pytest.approx(mem.total[0])  # the named terms add up to the peak


def test_unit_costs_split_the_vocabulary_as_the_memory_model_does():
    """planner.partition's per-unit bytes at tp=2: a block's states are halved, the embedding's and head's (V, h)
    tables halved too (a family spec's are plain nn.Embedding / nn.Linear tables), their other parameters (the
    position table, the final norm) whole, and the head's unit carries its half of the logits and the loss."""
    from zplan.planner.cost.units import unit_costs
    from zplan.planner.family import family_summary

    summary = family_summary("gpt:layers=4,hidden=256,heads=4,seq=128,vocab=1000")
    cand = one(tp=2, dp=1, micro_batch=2)
    units = unit_costs(summary, cand, A100, "bf16")
    kinds = [u.kind for u in summary.layers]
    table = 1000 * 256
    for unit, static in zip(summary.layers, units.static_bytes, strict=True):
        split = unit.params / 2 if unit.kind == "block" else unit.params - (table / 2 if unit.params >= table else 0)
        assert static == pytest.approx(16.0 * split)
    head = kinds.index("head")
    # the runtime's default loss on this rank's 2 x 128 x 500 logits: them and their gradient beside them (bf16), and
    # two fp32 chunk temporaries (each the whole of them: fewer than a chunk)
    local_logits = 2 * 128 * 1000 / 2
    assert units.act_bytes[head] == pytest.approx(2 * 128 * 256 * 2 + local_logits * (2 * 2 + 2 * 4))


@pytest.mark.parametrize("vocab_splittable", [False, True])
def test_the_logits_gemm_is_divided_by_tp_only_when_the_vocabulary_is(vocab_splittable):
    """The head's forward + backward on one GPU: 3 * b * 2 s h V / split FLOPs, at the efficiency of that GEMM (no
    ops passed: no host time)."""
    from zplan.planner.cost.compute import edge_time_s, gemm_efficiency

    model = edged_numbers(vocab_splittable)
    flops = 2.0 * S * H * V
    for t in (1, 2, 8):
        split = t if vocab_splittable else 1
        expected = 3 * flops / split / (A100.peak_flops("bf16") * gemm_efficiency(np.array([flops / split]), A100)[0])
        assert edge_time_s(model.head_fwd_flops, model, one(tp=t), A100, "bf16", loss=True)[0] == pytest.approx(
            expected + S * V / split * _streamed_per_logit() / _activation_Bps())


def _streamed_per_logit() -> float:
    from zplan.planner.cost.compute import LOSS_STREAMED_BYTES_PER_LOGIT

    return LOSS_STREAMED_BYTES_PER_LOGIT["bf16"]


def _activation_Bps() -> float:
    from zplan.planner.cost.compute import activation_ops_Bps

    return activation_ops_Bps(A100)


def _loss_memory_benchmark():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "loss_memory.py"
    spec = importlib.util.spec_from_file_location("loss_memory_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("loss", ["default", "upcast"])
def test_loss_budget_is_what_the_runtimes_loss_holds(precision, loss):
    """A small run of benchmarks/loss_memory.py on real CPU tensors (B=2, T=256, V=4096: the (B, T-1, V) copy of
    flatten happens for the upcast loss; one chunk of the in-place default loss) and on fake ones: the planner's
    bytes per logit are within 5 % of the measured peak, for the runtime's in-place default loss and the usual
    fp32-upcast one."""
    bench = _loss_memory_benchmark()
    real = bench.bytes_per_logit(2, 256, 4096, precision, fake=False, loss=loss)
    assert bench.bytes_per_logit(2, 256, 4096, precision, fake=True, loss=loss) == pytest.approx(real)
    assert bench.planner_bytes_per_logit(2, 256, 4096, precision, loss) == pytest.approx(real, rel=0.05)


def test_the_planner_prices_the_in_place_losss_chunk_as_the_runtime_cuts_it():
    from zplan.model.cross_entropy import CHUNK_ELEMENTS
    from zplan.planner.cost.memory_activations import IN_PLACE_LOSS_CHUNK_ELEMENTS

    assert IN_PLACE_LOSS_CHUNK_ELEMENTS == CHUNK_ELEMENTS


@pytest.mark.parametrize("pins, hidden_states", [
    (dict(pp=1), 0.0),  # no pipeline
    (dict(pp=8), 1.0),  # 1F1B: the gradient received (first stage) or sent back (last)
    (dict(pp=8, tp=8, sp=1), 1.0 + 7 / 8),  # ... and the 7/8 of the received state beyond its block's slice
    (dict(pp=4, tp=2, sp=1, interleave=2), 2.0 + 4 * (1 + 3 / 8) * 1 / 2),  # a gradient a chunk; 5.5 states in flight
])
def test_pipeline_buffers_are_the_micro_batches_in_flight_not_the_step(pins, hidden_states):
    """What crosses stages beyond the activations, in (1, s, h) bf16 hidden states (2 * S * H bytes): the runtime's
    stages hold receive buffers for the micro-batches in flight only (runtime/parallel/pipeline_buffers.py), the same at
    8 and 64 micro-batches a step (torch's PipelineStage held (2v - 1) of them for each micro-batch of the step)."""
    from zplan.planner.cost.memory_activations import pipeline_receive_buffer_bytes

    for num_micro_batches in (8, 64):
        got = pipeline_receive_buffer_bytes(gpt_numbers(), one(**pins), np.array([num_micro_batches]), "bf16")
        assert got[0] == pytest.approx(hidden_states * 2 * S * H)


def test_int8_activations_cross_as_rows_of_h_bytes_and_a_scale():
    """--compress act=int8 (runtime/compression/activations.py): the gradient and, beside its decoded copy, the
    received int8 rows, each h + 4 bytes a token."""
    from zplan.planner.cost.memory_activations import pipeline_receive_buffer_bytes

    got = pipeline_receive_buffer_bytes(gpt_numbers(), one(pp=8, act_compress=1), np.array([64]), "bf16")
    assert got[0] == pytest.approx(2 * S * (H + 4))
