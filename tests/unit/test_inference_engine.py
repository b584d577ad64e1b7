"""The inference engine (runtime/inference) against independent references on tiny models: the model's own
forward (logits), a naive generation loop that reruns model(idx) on the whole sequence (greedy tokens), each
prompt run alone (batching), hand-computed nucleus filtering, and the fp32 engine (quantized logits).

Two tiny models: gpt-style (examples/gpt.py: learned positions, LayerNorm, GELU, biases, tied head) and
llama-style (examples/llama.py: RMSNorm, SwiGLU, grouped-query attention, RoPE, untied head). The engine's
Linears run on the CPU either oneDNN-packed (its default here) or through F.linear (the layout it uses on GPUs);
the main checks run both.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zplan.errors import ZplanError
from zplan.examples import gpt, llama
from zplan.model_input import trace_module
from zplan.runtime.inference import sampling
from zplan.runtime.inference.decoder_spec import UnsupportedModelError
from zplan.runtime.inference.engine import GenerationError, InferenceEngine
from zplan.runtime.inference.sampling import (
    MIN_TEMPERATURE,
    SamplingError,
    SamplingFailure,
    SamplingParams,
    make_generators,
    sample_next,
    top_p_filter,
)
from zplan.runtime.inference.tokenizer import ByteTokenizer

VOCAB = 300  # > 256, so the byte tokenizer's end-of-text id exists
MODELS = {
    "gpt": (gpt, dict(num_layers=2, hidden=64, heads=4, vocab_size=VOCAB, max_seq_len=64)),
    "llama": (llama, dict(num_layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab_size=VOCAB,
                          rope_theta=10000.0)),
}
PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11, 12, 13], [42]]


def summary_of(build, **kwargs):
    """The planner's ModelSummary of the model, traced on meta."""
    with torch.device("meta"):
        meta_model = build(**kwargs)
    return trace_module(meta_model, torch.zeros(1, 8, dtype=torch.long, device="meta"), 8, "fp32")[1]


def make(name: str, seed: int = 0, **engine_kwargs):
    """(model, engine) for one of MODELS, random weights from `seed` (biases and norms too, so a missing one
    would show)."""
    module, kwargs = MODELS[name]
    torch.manual_seed(seed)
    model = module.build_model(**kwargs).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    engine = InferenceEngine.from_model(model, summary_of(module.build_model, **kwargs),
                                        **{"max_seq_len": 64, **engine_kwargs})
    return model, engine


@pytest.fixture(params=["onednn", "dense"])
def layout(request, monkeypatch):
    if request.param == "dense":
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    return request.param


@torch.no_grad()
def naive_greedy(model: nn.Module, prompt: list[int], new: int) -> list[int]:
    """Rerun the model on the whole sequence for every token; take the argmax."""
    seq = list(prompt)
    for _ in range(new):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


# ---- logits and greedy generation -------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_forward_logits_equal_the_model(name, layout):
    model, engine = make(name)
    tokens = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(tokens)
    ours = engine.forward_logits(tokens)
    packed = engine.store.layer(0)["qkv.weight"].layout == torch._mkldnn
    assert packed == (layout == "onednn")
    assert ours.dtype == torch.float32 and ours.shape == reference.shape
    diff = (ours - reference).abs().max().item()
    print(f"{name} ({layout}): max |engine - model| logits = {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.parametrize("name", MODELS)
def test_cached_greedy_equals_naive_loop(name, layout):
    model, engine = make(name)
    for prompt in PROMPTS:
        assert engine.generate([prompt], 12) == [naive_greedy(model, prompt, 12)]


@pytest.mark.parametrize("name", MODELS)
def test_batched_prompts_of_different_lengths_equal_each_alone(name):
    model, engine = make(name, seed=3)
    new = [10, 4, 7]  # different lengths of generation too
    batched = engine.generate(PROMPTS, new)
    alone = [engine.generate([p], n)[0] for p, n in zip(PROMPTS, new, strict=True)]
    assert batched == alone
    assert [len(t) for t in batched] == new
    assert batched[1] == naive_greedy(model, PROMPTS[1], 4)


def test_stream_yields_one_list_per_step_with_none_after_the_end():
    _, engine = make("gpt")
    steps = list(engine.stream([[1, 2], [3]], [2, 4]))
    assert len(steps) == 4 and all(len(s) == 2 for s in steps)
    assert [s[0] is None for s in steps] == [False, False, True, True]
    assert all(s[1] is not None for s in steps)


def test_stop_token_ends_a_sequence():
    model, engine = make("llama", seed=4)
    prompt = [5, 6, 7]
    free = naive_greedy(model, prompt, 8)
    stop = free[3]
    first_stop = free.index(stop)  # it may come earlier than position 3
    out = engine.generate([prompt, prompt], 8, [SamplingParams(stop_token=stop), SamplingParams()])
    assert out[0] == free[:first_stop + 1]  # ends with the stop token
    assert out[1] == free


# ---- sampling -----------------------------------------------------------------------------------------------


def test_top_p_filter_by_hand():
    probs = torch.tensor([0.1, 0.5, 0.15, 0.25])
    # sorted: 0.5, 0.25, 0.15, 0.1; cumulative before each: 0, 0.5, 0.75, 0.9
    assert top_p_filter(probs, 0.6).tolist() == [0.0, 0.5, 0.0, 0.25]
    assert top_p_filter(probs, 0.5).tolist() == [0.0, 0.5, 0.0, 0.0]
    assert top_p_filter(probs, 0.0).tolist() == [0.0, 0.5, 0.0, 0.0]
    assert top_p_filter(probs, 1.0).tolist() == probs.tolist()


def test_top_p_sampling_is_reproducible_and_top_p_zero_is_greedy():
    _, engine = make("gpt", seed=5)
    prompts = [[1, 2, 3], [1, 2, 3]]
    hot = [SamplingParams(temperature=1.5, top_p=0.95, seed=11), SamplingParams(temperature=1.5, top_p=0.95, seed=12)]
    first = engine.generate(prompts, 16, hot)
    assert engine.generate(prompts, 16, hot) == first  # same seeds, same tokens
    assert first[0] != first[1]  # different seeds draw differently (a near-uniform tiny model: 16 draws)
    # the seed is per sequence: the same request inside another batch draws the same tokens
    assert engine.generate([[9], [1, 2, 3]], [3, 16], [SamplingParams(), hot[0]])[1] == first[0]
    greedy = engine.generate(prompts[:1], 16)
    assert engine.generate(prompts[:1], 16, SamplingParams(temperature=1.0, top_p=0.0, seed=3)) == greedy


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-1.0), dict(temperature=float("nan")), dict(temperature=float("inf")), dict(temperature=True),
    dict(temperature="0.5"), dict(temperature=10**400), dict(top_p=1.5), dict(top_p=-0.1), dict(top_p=float("nan")),
])
def test_sampling_params_out_of_range_are_refused(kwargs):
    with pytest.raises(SamplingError):
        SamplingParams(**kwargs)


def sample_alone(logits: torch.Tensor, params: list[SamplingParams]) -> list:
    """Each row of `logits` sampled in a batch of its own."""
    return [sample_next(logits[b:b + 1], [p], make_generators([p]))[0] for b, p in enumerate(params)]


def test_a_tiny_temperature_is_greedy_and_changes_no_other_row():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    params = [SamplingParams(), SamplingParams(temperature=1e-300), SamplingParams(temperature=0.8, seed=7),
              SamplingParams(temperature=1.0, top_p=0.5, seed=8), SamplingParams(temperature=5e-324, top_p=0.3)]
    tokens = sample_next(logits, params, make_generators(params))
    assert all(isinstance(t, int) for t in tokens)
    assert tokens == sample_alone(logits, params)
    greedy = logits.argmax(dim=-1).tolist()
    assert tokens[1] == greedy[1] and tokens[4] == greedy[4]
    assert SamplingParams(temperature=MIN_TEMPERATURE * 0.99).greedy and not SamplingParams(
        temperature=MIN_TEMPERATURE).greedy


@pytest.mark.parametrize("temperature", [MIN_TEMPERATURE, 1e-3, 1.0, 10.0, 1e6])
@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 0.5, 1.0])
def test_sampling_is_finite_for_extreme_logits(temperature, top_p):
    """Logits at float32's limits, -inf (masked tokens) among them, with the floor's temperature: a token, never
    NaN; the only candidates are the largest logits."""
    big = torch.finfo(torch.float32).max
    logits = torch.full((3, 8), -float("inf"))
    logits[0, :3] = torch.tensor([big, -big, 0.0])
    logits[1, 2:6] = torch.tensor([1e30, 1e30, -1e30, 5.0])
    logits[2, 7] = -big  # one finite logit
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=s) for s in range(3)]
    for _ in range(20):
        tokens = sample_next(logits, params, make_generators(params))
        assert tokens[0] == 0 and tokens[1] in (2, 3) and tokens[2] == 7


def test_a_row_that_cannot_be_sampled_fails_alone():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    logits[1, 5] = float("nan")
    logits[3, 9] = float("inf")
    logits[4] = -float("inf")  # no finite logit
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=0.7, seed=2), SamplingParams(),
              SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=1.2, top_p=0.8, seed=4)]
    tokens = sample_next(logits, params, make_generators(params))
    for b in (1, 3, 4):
        assert isinstance(tokens[b], SamplingFailure) and "NaN or infinity" in tokens[b].message
    ok = [0, 2, 5]
    assert [tokens[b] for b in ok] == [sample_alone(logits[ok], [params[b] for b in ok])[i] for i in range(3)]


def test_a_failed_draw_fails_its_row_only(monkeypatch):
    real = sampling.sample_row

    def draw(logits, params, generator):
        if params.seed == 13:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real(logits, params, generator)

    monkeypatch.setattr(sampling, "sample_row", draw)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.9, seed=12), SamplingParams(temperature=0.9, seed=13), SamplingParams()]
    tokens = sample_next(logits, params, make_generators(params))
    assert isinstance(tokens[1], SamplingFailure) and "RuntimeError: probability tensor" in tokens[1].message
    assert [tokens[0], tokens[2]] == [sample_alone(logits[[0]], params[:1])[0], int(logits[2].argmax())]


def test_a_sequence_whose_logits_turn_nan_ends_alone(monkeypatch):
    """The engine yields a SamplingFailure for that sequence once, None after; the others generate exactly what
    they generate without it; generate() names the prompt."""
    _, engine = make("gpt", seed=6)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=0.9, seed=5)]
    clean = engine.generate(prompts, 8, params)
    decode, steps = engine._decode, []

    def poisoned(tokens, positions, length):
        logits = decode(tokens, positions, length)
        steps.append(1)
        if len(steps) == 3:  # the fourth token of sequence 1
            logits[1, 0] = float("nan")
        return logits

    monkeypatch.setattr(engine, "_decode", poisoned)
    out = list(engine.stream(prompts, 8, params))
    column = [step[1] for step in out]
    assert column[:3] == clean[1][:3] and isinstance(column[3], SamplingFailure)
    assert all(t is None for t in column[4:])
    for b in (0, 2):
        assert [step[b] for step in out if step[b] is not None] == clean[b]
    steps.clear()
    with pytest.raises(GenerationError, match="prompt 1: the model's logits for this sequence hold NaN"):
        engine.generate(prompts, 8, params)


# ---- weight-only quantization ---------------------------------------------------------------------------------


def quantized_bytes_by_hand(model: nn.Module, bits: int, group: int) -> int:
    """Weight-only storage counted from the model: every 2-D Linear weight (block Linears and the head; a tied
    head is the token table, counted once) at bits/8 bytes an element plus one fp32 scale per group; everything
    else (embeddings that are not the head, norms, biases) fp32."""
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    total = 0
    for p in {id(p): p for p in model.parameters()}.values():  # tied tensors once
        total += p.numel() * bits // 8 + p.numel() // group * 4 if id(p) in linear_weights else 4 * p.numel()
    return total


@pytest.mark.parametrize("name", MODELS)
def test_quantized_logits_track_fp32(name):
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    model, fp32 = make(name, seed=6)
    reference = fp32.forward_logits(tokens).flatten()
    assert fp32.weight_bytes() == 4 * sum(p.numel() for p in model.parameters())  # parameters() lists tied once
    cosines, ratios = {}, {}
    for precision, bits in (("int8", 8), ("int4", 4)):
        _, engine = make(name, seed=6, weight_precision=precision, group_size=32)
        logits = engine.forward_logits(tokens).flatten()
        cosines[precision] = F.cosine_similarity(logits, reference, dim=0).item()
        ratios[precision] = engine.weight_bytes() / fp32.weight_bytes()
        assert engine.weight_bytes() == quantized_bytes_by_hand(model, bits, 32)
    print(f"{name}: logits cosine vs fp32 {cosines}; weight bytes / fp32 {ratios}")
    assert cosines["int8"] >= 0.999  # measured 0.99997-0.99999
    assert cosines["int4"] >= 0.97  # measured 0.990 (llama) - 0.996 (gpt)


@pytest.mark.parametrize("name", MODELS)
def test_16bit_compute_tracks_fp32(name):
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    _, fp32 = make(name, seed=6)
    _, bf16 = make(name, seed=6, compute_dtype=torch.bfloat16, weight_precision="bf16")
    assert bf16.cache.k.dtype == torch.bfloat16 and bf16.store.layer(0)["qkv.weight"].dtype == torch.bfloat16
    cosine = F.cosine_similarity(bf16.forward_logits(tokens).flatten(), fp32.forward_logits(tokens).flatten(), dim=0)
    assert cosine.item() >= 0.999  # measured 0.99998
    assert bf16.weight_bytes() * 2 == fp32.weight_bytes()


@pytest.mark.parametrize("name", MODELS)
def test_quantized_cached_greedy_equals_its_own_uncached_loop(name):
    """int8 decode steps (the fused CPU kernel, few rows) against the same engine's uncached forward rerun on the
    whole sequence (the dequantize + matmul reference, many rows)."""
    _, engine = make(name, seed=7, weight_precision="int8", group_size=32)
    prompt, seq = [3, 4, 5], [3, 4, 5]
    for _ in range(8):
        seq.append(int(engine.forward_logits(torch.tensor([seq]))[0, -1].argmax()))
    assert engine.generate([prompt], 8) == [seq[3:]]


# ---- the weight store protocol ---------------------------------------------------------------------------


class RecordingStore:
    """Wraps the engine's store and records its calls."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def layer(self, i):
        self.calls.append(("layer", i))
        return self.inner.layer(i)

    def done(self, i):
        self.calls.append(("done", i))

    def nbytes(self):
        return self.inner.nbytes()

    def close(self):
        self.inner.close()


def test_layers_are_asked_for_in_order_once_per_pass():
    _, engine = make("llama")
    engine.store = RecordingStore(engine.store)
    engine.generate([[1, 2], [3]], 3)  # prefill + 2 decode steps
    one_pass = [(kind, i) for i in range(2) for kind in ("layer", "done")]
    assert engine.store.calls == one_pass * 3


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_streamed_weights_give_the_resident_engines_tokens(tier, tmp_path):
    """weight_tier cpu / nvme: the blocks stream through runtime.inference.zero_inference.StreamedWeights (here
    to the CPU itself); logits and greedy tokens equal the resident engine's."""
    model, resident = make("llama", seed=8, weight_precision="int8", group_size=32)
    _, streamed = make("llama", seed=8, weight_precision="int8", group_size=32, weight_tier=tier,
                       nvme_dir=str(tmp_path), prefetch_layers=1)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    assert (streamed.forward_logits(tokens) - resident.forward_logits(tokens)).abs().max().item() <= 1e-5
    assert streamed.generate(PROMPTS, 6) == resident.generate(PROMPTS, 6)
    assert streamed.weight_bytes() == resident.weight_bytes()
    streamed.close()


# ---- refusals ------------------------------------------------------------------------------------------------


def test_requests_the_engine_cannot_serve_are_refused():
    _, engine = make("gpt", max_batch=2, max_seq_len=16)
    with pytest.raises(GenerationError, match="max_batch=2"):
        engine.stream([[1], [2], [3]], 2)
    with pytest.raises(GenerationError, match="empty"):
        engine.stream([[1], []], 2)
    with pytest.raises(GenerationError, match="max_seq_len=16"):
        engine.stream([[1] * 10], 7)
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        engine.stream([[1, VOCAB]], 2)
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        engine.stream([[-1]], 2)
    assert issubclass(GenerationError, ZplanError)
    assert len(engine.generate([[1] * 10], 6)[0]) == 6  # exactly max_seq_len is fine


def test_tensor_parallel_degree_must_divide_the_heads():
    from zplan.runtime.inference.decoder import check_split
    from zplan.runtime.inference.decoder_spec import recognise

    module, kwargs = MODELS["llama"]
    model = module.build_model(**kwargs)
    spec = recognise(model, summary_of(module.build_model, **kwargs))
    check_split(spec, 2)
    with pytest.raises(UnsupportedModelError, match="tp=4 must divide heads=4, kv_heads=2"):
        check_split(spec, 4)


class PostNormBlock(gpt.Block):
    """Looks like a gpt block (same modules) but normalises after the residual add: the engine must refuse."""

    def forward(self, x):
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


class FusedQKVAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.o = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h))


def test_unsupported_models_are_refused():
    kwargs = MODELS["gpt"][1]
    post_norm = gpt.build_model(**kwargs)
    post_norm.blocks = nn.ModuleList(PostNormBlock(64, 4, 256) for _ in range(2))
    with pytest.raises(UnsupportedModelError, match="logits differ from model"):
        InferenceEngine.from_model(post_norm, summary_of(gpt.build_model, **kwargs), max_seq_len=64)
    fused = gpt.build_model(**kwargs)
    for block in fused.blocks:
        block.attn = FusedQKVAttention(64, 4)
    with pytest.raises(UnsupportedModelError, match="attention module with q, k, v, o Linears"):
        InferenceEngine.from_model(fused, summary_of(gpt.build_model, **kwargs), max_seq_len=64)
    mixed = gpt.build_model(**kwargs)
    mixed.blocks[1].attn = FusedQKVAttention(64, 4)
    with pytest.raises(UnsupportedModelError, match=r"block blocks\.1 differs from block 0"):
        InferenceEngine.from_model(mixed, summary_of(gpt.build_model, **kwargs), max_seq_len=64)


# ---- the tokenizer ------------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_utf8():
    tok = ByteTokenizer(VOCAB)
    text = "héllo, wörld: 日本語 🙂"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_id, 299]) == text  # ids >= 256 are skipped
    assert tok.eos_id == 256 and ByteTokenizer(256).eos_id is None
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # a cut multi-byte character is replaced
    with pytest.raises(ZplanError, match="at least 256"):
        ByteTokenizer(255)
