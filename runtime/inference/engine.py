"""The inference engine: batched generation with a preallocated KV cache, per-sequence sampling, weight-only
INT8/INT4 or fp8 W8A8 block Linears (runtime/inference/fp8.py), weights resident or streamed layer by layer
(ZeRO-Inference), and tensor parallelism.

    engine = InferenceEngine.from_model(model, summary, max_batch=8, max_seq_len=256)
    for step in engine.stream([[1, 2, 3], [4, 5]], max_new_tokens=16):
        ...  # step: one new token per prompt, None for a sequence that has finished (a SamplingFailure: it failed)

One generation (stream) at a time: prefill runs all prompts in one pass, right-padded to the longest, so with
causal attention a real token never sees padding; the first token of each sequence comes from its last prompt
position. Each decode step then feeds every sequence's newest token at its own position (learned position
embedding or RoPE of that position) and attends to its own cached positions 0..pos only, so a sequence's tokens do
not depend on the others in the batch (up to float rounding of batched matmuls). Sequences that have finished stay
in the batch (their rows are computed and ignored) until all have finished. A sequence that cannot be sampled
(runtime/inference/sampling.py: its logits hold NaN) yields a SamplingFailure and finishes; the others go on.

Under tensor parallelism every rank of the mesh builds the engine from the same model and calls stream with the
same arguments; tp rank 0 samples and broadcasts the tokens, so all ranks yield the same ones.
The engine keeps references to (and may share memory with) the model's tensors; do not train the model while
the engine is in use.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from zplan.cuda import paged_attention
from zplan.cuda.weight_quant import QuantizedWeight, dequantize_groupwise
from zplan.errors import ZplanError
from zplan.model.model_file import logits_of
from zplan.runtime.inference import decoder, fp8
from zplan.runtime.inference.decoder import Shards, linear, norm
from zplan.runtime.inference.decoder_spec import DecoderSpec, UnsupportedModelError, recognise
from zplan.runtime.inference.kv_cache import KVCache
from zplan.runtime.inference.paged_cache import BLOCK_TOKENS, PagedKVCache
from zplan.runtime.inference.sampling import FAILED, SamplingFailure, SamplingParams, make_generators, sample_next
from zplan.runtime.inference.step_batch import StepBatch, paged_slots
from zplan.runtime.inference.weight_store import ResidentWeights, WeightStore, tensor_bytes
from zplan.runtime.inference.zero_inference import StreamedWeights
from zplan.schemas.inference import WeightPrecision, WeightTier
from zplan.schemas.model import ModelSummary

WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WEIGHT_TIERS = ("gpu", "cpu", "nvme")
CHECK_TOKENS = 8  # length of the input the build-time check runs
# quantized or 16-bit engines: cosine of logits vs the model (fp8 W8A8: 0.998 or more measured on the test models)
CHECK_MIN_COSINE = {"int8": 0.99, "int4": 0.95, "fp8": 0.98}


class GenerationError(ZplanError):
    """A generation request the engine cannot serve (too many prompts, too long, ids outside the vocabulary)."""


class InferenceEngine:
    def __init__(self, spec: DecoderSpec, store: WeightStore, outer: dict[str, torch.Tensor], outer_bytes: int, *,
                 compute_dtype: torch.dtype, device: torch.device, max_batch: int, max_seq_len: int, tp_mesh=None):
        self.spec, self.store, self.outer = spec, store, outer
        self.max_batch, self.max_seq_len, self.vocab_size = max_batch, max_seq_len, spec.vocab
        self.compute_dtype, self.device = compute_dtype, device
        self.tp = 1 if tp_mesh is None else tp_mesh.size()
        self._group = None if tp_mesh is None else tp_mesh.get_group()
        self._outer_bytes = outer_bytes
        self.kv_heads = spec.kv_heads // self.tp  # this rank's key/value heads
        self._cache: KVCache | None = None  # stream()'s cache, allocated on its first use (serving pages its own)
        has_rope = spec.rope_theta is not None or spec.rope_inv_freq is not None
        self._rope = decoder.rope_table(spec, max_seq_len, compute_dtype, device) if has_rope else None
        self._gqa = spec.kv_heads != spec.heads
        self._windows = spec.windows or (None,) * spec.num_layers  # per layer: sliding window or None
        # the prefill's plain causal SDPA (is_causal, no mask) serves every layer unless one needs a mask
        self._masked = spec.attn_softcap is not None or any(w is not None for w in self._windows)
        self._generation = 0  # bumped by each stream(): an older stream's iterator then refuses to continue

    # ---- building -----------------------------------------------------------------------------------------

    @classmethod
    @torch.no_grad()
    def from_model(cls, model: nn.Module, summary: ModelSummary, *, compute_dtype: torch.dtype = torch.float32,
                   device: torch.device = torch.device("cpu"), max_batch: int = 8, max_seq_len: int = 256,
                   weight_precision: WeightPrecision = "fp32", group_size: int = 128, weight_tier: WeightTier = "gpu",
                   nvme_dir: str | None = None, prefetch_layers: int = 1, tp_mesh=None) -> InferenceEngine:
        """Recognise `model` (materialised, on the CPU; the same on every tp rank), pack and place its weights,
        and check the engine's logits against model(idx) on a short input (UnsupportedModelError if they
        differ)."""
        device = torch.device(device)
        _check_choices(weight_precision, weight_tier, max_batch, max_seq_len)
        spec = recognise(model, summary)
        if spec.position_rows and max_seq_len > spec.position_rows:
            raise ZplanError(f"max_seq_len {max_seq_len} exceeds the model's {spec.position_rows} learned positions: "
                             f"use max_seq_len <= {spec.position_rows}")
        shards = Shards()
        if tp_mesh is not None:
            if tp_mesh.ndim != 1:
                raise ZplanError(f"tp_mesh must be a 1-D DeviceMesh, got {tp_mesh.ndim} dimensions")
            decoder.check_split(spec, tp_mesh.size())
            shards = Shards(tp_mesh.size(), tp_mesh)
        bits = decoder.QUANT_BITS.get(weight_precision)
        if weight_precision == "fp8":
            fp8.check_device(device)  # a GPU without fp8 tensor cores is refused before any packing
        layers = _pack_layers(model.get_submodule(summary.block_prefix), spec, shards,
                              WEIGHT_DTYPES.get(weight_precision, compute_dtype), compute_dtype, bits, group_size,
                              fp8_device=device if weight_precision == "fp8" else None)
        outer = _pack_outer(model, spec, compute_dtype, bits, group_size)
        outer_bytes = sum(tensor_bytes(t) for t in {id(t): t for t in outer.values()}.values())
        outer = {name: t.to(device) for name, t in outer.items()}
        if spec.tied_head and "head.weight" in outer:  # keep one table after the move
            outer["head.weight"] = outer["tok.weight"]
        # the CPU's fastest layout for resident fp32 Linears: oneDNN's packed weights (F.linear's (out, in) on GPUs)
        onednn = device.type == "cpu" and compute_dtype == torch.float32 and torch.backends.mkldnn.is_available()
        store = _weight_store(layers, device, weight_tier, nvme_dir, prefetch_layers, max_batch if onednn else 0)
        if onednn and "head.weight" in outer:  # packed head (when tied, a copy beside the embedding table)
            outer["head.weight"] = torch.ops.mkldnn._reorder_linear_weight(outer["head.weight"], max_batch)
        engine = cls(spec, store, outer, outer_bytes, compute_dtype=compute_dtype, device=device,
                     max_batch=max_batch, max_seq_len=max_seq_len, tp_mesh=tp_mesh)
        engine._check_against(model, weight_precision, compute_dtype)
        return engine

    def _check_against(self, model: nn.Module, weight_precision: WeightPrecision, compute_dtype: torch.dtype) -> None:
        """The engine's uncached logits against model(idx) on CHECK_TOKENS fixed tokens: fp32 within float
        rounding, other precisions by cosine similarity (CHECK_MIN_COSINE)."""
        length = min(CHECK_TOKENS, self.max_seq_len)
        idx = torch.randint(0, self.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
        training = model.training
        model.eval()  # no dropout in the reference
        attention = _eager_reference(model) if self.spec.attn_softcap is not None else None
        try:
            reference = logits_of(model(idx)).float()  # (1, T, V), on the CPU (a tensor or transformers' output)
        finally:
            model.train(training)
            if attention is not None:
                model.set_attn_implementation(attention)
        ours = self.forward_logits(idx.to(self.device)).cpu()
        if weight_precision == "fp32" and compute_dtype == torch.float32:
            diff = (ours - reference).abs().max().item()
            ok = diff <= 1e-4 + 1e-3 * reference.abs().max().item()
            found = f"max |difference| {diff:.3g} (max |logit| {reference.abs().max().item():.3g})"
        else:
            cosine = F.cosine_similarity(ours.flatten(), reference.flatten(), dim=0).item()
            ok = cosine >= CHECK_MIN_COSINE.get(weight_precision, 0.99)
            found = f"cosine similarity {cosine:.5f}"
        if not ok:
            raise UnsupportedModelError(
                f"the inference engine's logits differ from model(idx) ({found}): the model's blocks do something "
                "the engine does not (it runs pre-norm x + attn(norm1(x)); x + mlp(norm2(x)) with the parts listed "
                "in runtime/inference/decoder.py); run this model without zplan's engine")

    # ---- computing -----------------------------------------------------------------------------------------

    def _reduce(self, t: torch.Tensor) -> None:
        torch.distributed.all_reduce(t, group=self._group)

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> (B, T, h); positions (T,) or (B, 1), for the learned position table."""
        if "tok.weight" in self.outer:
            x = F.embedding(tokens, self.outer["tok.weight"])  # (B, T, h)
        else:  # the tied table is quantized: dequantize just the rows looked up
            qw = decoder.quantized(self.outer, "tok")
            rows = tokens.reshape(-1)
            picked = QuantizedWeight(qw.qweight[rows], qw.scales[rows], None, qw.bits, qw.group_size,
                                     (rows.numel(), qw.shape[1]))
            x = dequantize_groupwise(picked).to(self.compute_dtype).view(*tokens.shape, -1)
        if self.spec.embed_scale is not None:  # Gemma: sqrt(hidden), as a tensor of x's dtype as transformers has it
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        if "pos.weight" in self.outer:
            x = x + self.outer["pos.weight"][positions]  # (T, h) or (B, 1, h)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., h) -> fp32 logits (..., V)."""
        logits = linear(self.outer, "head", norm(self.outer, "norm", self.spec.final_norm, x), bias=False).float()
        cap = self.spec.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _layers(self, x: torch.Tensor, attend, rotary) -> torch.Tensor:
        """All blocks, asking the weight store for layer 0..L-1 in order; attend(i, q, k, v) for layer i."""
        reduce = self._reduce if self.tp > 1 else None
        for i in range(self.spec.num_layers):
            x = decoder.block_forward(self.spec, self.store.layer(i), x, partial(attend, i), rotary, reduce)
            self.store.done(i)
        return x

    def _masks(self, query_positions: torch.Tensor, length: int) -> dict:
        """Per distinct window (None: full causal) the keys each query sees: query_positions (B|1, T) ->
        bool (B|1, 1, T, S); an empty dict when the layers need none (prefill: is_causal)."""
        keys = torch.arange(length, device=self.device)  # (S,)
        masks = {}
        for window in set(self._windows):
            visible = keys <= query_positions[..., None]  # (B|1, T, S): causal
            if window is not None:
                visible &= query_positions[..., None] - keys < window  # transformers': q - window < j
            masks[window] = visible[:, None]
        return masks

    def _attention(self, i: int, q, k, v, masks: dict) -> torch.Tensor:
        """Layer i: q (B, a, T, d), k and v (B, a_kv, S, d), masks from _masks (empty: causal, T == S) ->
        (B, T, a d)."""
        spec, mask = self.spec, masks.get(self._windows[i])
        if spec.attn_softcap is None:
            if mask is None:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=spec.attn_scale,
                                                   enable_gqa=self._gqa)  # (B, a, T, d)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.attn_scale,
                                                   enable_gqa=self._gqa)
        else:  # Gemma 2: scores soft-capped before the mask, as transformers' eager attention
            if self._gqa:
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, a, S, d)
                v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
            scale = spec.head_dim ** -0.5 if spec.attn_scale is None else spec.attn_scale
            scores = torch.matmul(q, k.transpose(2, 3)) * scale  # (B, a, T, S)
            scores = torch.tanh(scores / spec.attn_softcap) * spec.attn_softcap
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
            y = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)  # (B, a, T, d)
        return y.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)

    def _rotary(self, index):
        """RoPE at the rows `index` picks from the (S, r) cos/sin tables, or None without RoPE."""
        if self._rope is None:
            return None
        cos, sin = self._rope[0][index], self._rope[1][index]
        return lambda t: decoder.rotate(t, cos, sin)

    @torch.no_grad()
    def forward_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Uncached forward (for tests and the build-time check): tokens (B, T) -> fp32 logits (B, T, V)."""
        seq = tokens.shape[1]
        positions = torch.arange(seq, device=self.device)
        masks = self._masks(positions[None], seq) if self._masked else {}
        rotary = self._rotary(slice(0, seq))  # (T, r)
        x = self._layers(self._embed(tokens.to(self.device), positions),
                         lambda i, q, k, v: self._attention(i, q, k, v, masks), rotary)
        return self._logits(x)

    @property
    def cache(self) -> KVCache:
        """stream()'s KV cache for max_batch sequences of max_seq_len positions."""
        if self._cache is None:
            self._cache = KVCache(self.spec.num_layers, self.max_batch, self.kv_heads, self.max_seq_len,
                                  self.spec.head_dim, self.compute_dtype, self.device)
        return self._cache

    def paged_cache(self, num_blocks: int) -> PagedKVCache:
        """A paged KV cache of num_blocks blocks for this engine's layers and this rank's heads; builds the paged
        attention kernel now where it applies (a first build takes ~30 s: before serving, not in the first request)."""
        paged_attention.kernel_applies(self.device, self.compute_dtype)
        return PagedKVCache(self.spec.num_layers, num_blocks, self.kv_heads, self.spec.head_dim,
                            self.compute_dtype, self.device)

    @torch.no_grad()
    def forward_paged(self, cache: PagedKVCache, batch: StepBatch) -> torch.Tensor:
        """One scheduler iteration (runtime/inference/scheduler.py): every token of `batch` in one pass, its keys
        and values written to their slots of `cache`, each segment attending to its own positions 0..context-1 ->
        fp32 logits (len(batch.sample), V) at the last token of the segments batch.sample names.

        The Linears run once over all N tokens. The decodes (batch.decodes single tokens) attend by
        zplan.cuda.paged_attention's C++ kernel on the CPU in fp32 (the cache read in place), else in batches of like
        context length (_decode_groups) over their slots gathered, padded and masked; each prompt chunk attends
        alone, causally from its first position; a chunk that is a whole prompt attends to its own fresh keys."""
        dev = self.device
        cache.clear(batch.fresh)
        tokens = torch.tensor(batch.tokens, dtype=torch.long, device=dev)  # (N,)
        positions = torch.tensor(batch.positions, dtype=torch.long, device=dev)  # (N,)
        slots = torch.tensor(batch.slots, dtype=torch.long, device=dev)  # (N,)
        decodes = batch.decodes
        # per attention call: (first token, tokens, slots to read (B, S) or None: its own keys, masks, whether its
        # tokens are B decodes, one query each)
        parts = []
        kernel = decodes and paged_attention.kernel_applies(dev, self.compute_dtype)
        if kernel:  # the decodes in one C++ call per layer, reading the cache in place
            blocks = max(len(table) for table in batch.tables[:decodes])
            tables = torch.tensor([table + [0] * (blocks - len(table)) for table in batch.tables[:decodes]],
                                  dtype=torch.long)  # (D, B)
            lengths = torch.tensor([context for _, context in batch.segments[:decodes]], dtype=torch.long)  # (D,)
        else:  # the torch way: gathered in runs of like length
            for start, end in _decode_groups([context for _, context in batch.segments[:decodes]]):
                width = max(context for _, context in batch.segments[start:end])
                read = paged_slots(batch.tables[start:end], width, dev)  # (D, S)
                parts.append((start, end - start, read, self._masks(positions[start:end, None], width), True))
        first = decodes
        for (count, context), table in zip(batch.segments[decodes:], batch.tables[decodes:], strict=True):
            query_positions = positions[first:first + count][None]  # (1, n)
            if context == count:  # a whole prompt: causal over its own keys
                parts.append((first, count, None, self._masks(query_positions, context) if self._masked else {},
                              False))
            else:
                read = paged_slots([table], context, dev)  # (1, S)
                parts.append((first, count, read, self._masks(query_positions, context), False))
            first += count

        def attend(i, q, k, v):  # q (1, a, N, d), k and v (1, a_kv, N, d)
            cache.write(i, slots, k[0].transpose(0, 1), v[0].transpose(0, 1))  # (N, a_kv, d)
            outputs = []
            if kernel:
                spec = self.spec
                y = paged_attention.paged_decode_attention(
                    q[0, :, :decodes].transpose(0, 1), cache.k[i], cache.v[i], tables, lengths,
                    scale=spec.head_dim ** -0.5 if spec.attn_scale is None else spec.attn_scale,
                    window=self._windows[i], softcap=spec.attn_softcap, block_tokens=BLOCK_TOKENS)  # (D, a, d)
                outputs.append(y.reshape(1, decodes, -1))
            for start, count, read, masks, decoding in parts:
                query = q[:, :, start:start + count]  # (1, a, n, d)
                if read is None:
                    keys, values = k[:, :, start:start + count], v[:, :, start:start + count]
                else:
                    keys, values = cache.read(i, read)  # (B, a_kv, S, d)
                if decoding:
                    query = query[0].transpose(0, 1)[:, :, None]  # (D, a, 1, d)
                outputs.append(self._attention(i, query, keys, values, masks).reshape(1, count, -1))
            return torch.cat(outputs, dim=1)  # (1, N, a d)

        x = self._layers(self._embed(tokens[None], positions), attend, self._rotary(positions))  # (1, N, h)
        return self._logits(x[0, torch.tensor(batch.sample_rows(), dtype=torch.long, device=dev)])

    def _prefill(self, tokens: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) right-padded; caches positions 0..T-1; fp32 logits (B, V) at positions last (B,)."""
        batch, seq = tokens.shape

        positions = torch.arange(seq, device=self.device)
        masks = self._masks(positions[None], seq) if self._masked else {}

        def attend(i, q, k, v):
            self.cache.write_prefix(i, k, v)
            return self._attention(i, q, k, v, masks)

        rotary = self._rotary(slice(0, seq))  # (T, r)
        x = self._layers(self._embed(tokens, torch.arange(seq, device=self.device)), attend, rotary)  # (B, T, h)
        return self._logits(x[torch.arange(batch, device=self.device), last])

    def _decode(self, tokens: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
        """One step: tokens (B,) at positions (B,) (all < length) -> fp32 logits (B, V)."""
        batch = tokens.shape[0]
        rows = torch.arange(batch, device=self.device)
        masks = self._masks(positions[:, None], length)  # (B, 1, 1, S) each: own past (within the window)

        def attend(i, q, k, v):  # q (B, a, 1, d), k and v (B, a_kv, 1, d)
            self.cache.write_step(i, k, v, rows, positions)
            keys, values = self.cache.prefix(i, batch, length)  # (B, a_kv, S, d)
            return self._attention(i, q, keys, values, masks)  # (B, 1, a d)

        rotary = self._rotary(positions[:, None, None])  # (B, 1, 1, r)
        x = self._layers(self._embed(tokens[:, None], positions[:, None]), attend, rotary)  # (B, 1, h)
        return self._logits(x[:, 0])

    def sample(self, logits: torch.Tensor, params, generators) -> list[int | SamplingFailure]:
        """Tokens chosen on tp rank 0 and broadcast, so every rank continues with the same ones (a failed row
        travels as FAILED; tp rank 0 keeps its message)."""
        sampled = sample_next(logits, params, generators)
        if self.tp == 1:
            return sampled
        chosen = torch.tensor([t if isinstance(t, int) else FAILED for t in sampled], dtype=torch.int64,
                              device=self.device)
        torch.distributed.broadcast(chosen, src=torch.distributed.get_global_rank(self._group, 0), group=self._group)
        if torch.distributed.get_rank(self._group) == 0:
            return sampled
        return [SamplingFailure("sampling failed on tensor-parallel rank 0") if t == FAILED else t
                for t in chosen.tolist()]

    # ---- generating ----------------------------------------------------------------------------------------

    def _validate(self, prompts, max_new_tokens, sampling) -> tuple[list[int], list[SamplingParams]]:
        if not prompts or len(prompts) > self.max_batch:
            raise GenerationError(f"{len(prompts)} prompts: send 1 to max_batch={self.max_batch} at a time")
        new = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(new) != len(prompts) or len(params) != len(prompts):
            raise GenerationError(f"max_new_tokens and sampling must be one value or one per prompt "
                                  f"({len(prompts)}), got {len(new)} and {len(params)}")
        for b, (prompt, n) in enumerate(zip(prompts, new, strict=True)):
            if not prompt:
                raise GenerationError(f"prompt {b} is empty: send at least one token")
            if n < 1:
                raise GenerationError(f"max_new_tokens of prompt {b} is {n}: ask for at least one token")
            if len(prompt) + n > self.max_seq_len:
                raise GenerationError(f"prompt {b} has {len(prompt)} tokens + {n} new > max_seq_len="
                                      f"{self.max_seq_len}: shorten it or ask for fewer tokens")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise GenerationError(f"prompt {b} holds token ids outside the vocabulary [0, {self.vocab_size}): "
                                      f"{bad[:5]}")
        return new, params

    def stream(self, prompts: list[list[int]], max_new_tokens: int | list[int],
               sampling: SamplingParams | list[SamplingParams] = SamplingParams()
               ) -> Iterator[list[int | SamplingFailure | None]]:
        """Yields once per decode step a list of len(prompts): each sequence's new token, None once it has
        finished (after its stop token or max_new_tokens), or a SamplingFailure where that sequence could not be
        sampled (it has then finished; the others go on); ends when all have finished. Checks the request now
        (GenerationError), before the first step."""
        new, params = self._validate(prompts, max_new_tokens, sampling)
        self._generation += 1
        return self._steps(prompts, new, params, self._generation)

    @torch.no_grad()
    def _steps(self, prompts, new: list[int], params: list[SamplingParams], generation: int):
        batch = len(prompts)
        lengths = [len(p) for p in prompts]
        tokens = torch.zeros(batch, max(lengths), dtype=torch.int64)  # (B, T) right-padded with 0
        for b, prompt in enumerate(prompts):
            tokens[b, :len(prompt)] = torch.tensor(prompt)
        generators = make_generators(params)
        last = torch.tensor(lengths, device=self.device) - 1  # (B,)
        logits = self._prefill(tokens.to(self.device), last)
        produced = [0] * batch
        finished = [False] * batch
        positions = last.clone()  # where each sequence's newest token goes
        while True:
            chosen = self.sample(logits, params, generators)
            step: list[int | SamplingFailure | None] = []
            for b in range(batch):
                if finished[b]:
                    step.append(None)
                    continue
                step.append(chosen[b])
                if isinstance(chosen[b], SamplingFailure):
                    finished[b] = True
                    continue
                produced[b] += 1
                finished[b] = produced[b] >= new[b] or chosen[b] == params[b].stop_token
            yield step
            if all(finished):
                return
            if generation != self._generation:
                raise GenerationError("another stream() started on this engine: finish one generation before "
                                      "starting the next")
            advance = torch.tensor([0 if f else 1 for f in finished], device=self.device)
            positions = positions + advance  # finished sequences stay where they are
            fed = torch.tensor([c if isinstance(c, int) else 0 for c in chosen], device=self.device)
            logits = self._decode(fed, positions, int(positions.max()) + 1)

    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int],
                 sampling: SamplingParams | list[SamplingParams] = SamplingParams()) -> list[list[int]]:
        """The generated tokens of each prompt (a stop token included); GenerationError when a sequence cannot be
        sampled."""
        out: list[list[int]] = [[] for _ in prompts]
        for step in self.stream(prompts, max_new_tokens, sampling):
            for b, token in enumerate(step):
                if isinstance(token, SamplingFailure):
                    raise GenerationError(f"prompt {b}: {token.message}")
                if token is not None:
                    out[b].append(token)
        return out

    def weight_bytes(self) -> int:
        """Bytes of all weights as stored on this rank: blocks (its shards) plus embeddings, final norm and head (a
        tied table once; the oneDNN-packed copy of a tied head on the CPU is a layout, not counted)."""
        return self.store.nbytes() + self._outer_bytes

    def close(self) -> None:
        self.store.close()


def _decode_groups(contexts: list[int], min_fill: float = 0.5) -> list[tuple[int, int]]:
    """(start, end) runs of the decodes, longest context first (the scheduler's order), each read as one batch
    padded to its first context: a run ends where a context is below min_fill of it, so that padding stays under
    half of what is read."""
    groups, start = [], 0
    for i, context in enumerate(contexts):
        if context < min_fill * contexts[start]:
            groups.append((start, i))
            start = i
    if contexts:
        groups.append((start, len(contexts)))
    return groups


def _eager_reference(model: nn.Module) -> str | None:
    """Switch a transformers model to eager attention for the build-time check (its SDPA path drops the attention
    soft-capping the engine computes); the implementation to restore, or None when it is not one."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current in (None, "eager") or not hasattr(model, "set_attn_implementation"):
        return None
    model.set_attn_implementation("eager")
    return current


def _check_choices(weight_precision: WeightPrecision, weight_tier: WeightTier, max_batch: int,
                   max_seq_len: int) -> None:
    if weight_precision not in (*WEIGHT_DTYPES, *decoder.QUANT_BITS, "fp8"):
        raise ZplanError(f"weight_precision {weight_precision!r}: use one of fp32, bf16, fp16, int8, int4, fp8")
    if weight_tier not in WEIGHT_TIERS:
        raise ZplanError(f"weight_tier {weight_tier!r}: use one of {', '.join(WEIGHT_TIERS)}")
    if max_batch < 1 or max_seq_len < 1:
        raise ZplanError(f"max_batch ({max_batch}) and max_seq_len ({max_seq_len}) must be positive")


def _pack_layers(blocks: nn.Module, spec: DecoderSpec, shards: Shards, weight_dtype: torch.dtype,
                 dtype: torch.dtype, bits: int | None, group_size: int, fp8_device: torch.device | None = None
                 ) -> list[dict[str, torch.Tensor]]:
    """Every block packed (decoder.pack_layer: this rank's shards, on the CPU), its Linears quantized to `bits`
    (int8/int4) when given, or to fp8 W8A8 for `fp8_device` when given (from this rank's shards at `weight_dtype`:
    the per-channel scales are this rank's)."""
    layers = [decoder.pack_layer(block, spec, shards, weight_dtype, dtype) for block in blocks]
    if bits or fp8_device is not None:
        for layer in layers:
            for name in decoder.LINEARS:
                if f"{name}.weight" not in layer:
                    continue
                if fp8_device is not None:
                    decoder.quantize_linear_fp8(layer, name, fp8_device)
                else:
                    decoder.quantize_linear(layer, name, bits, group_size)
    return layers


def _weight_store(layers: list[dict[str, torch.Tensor]], device: torch.device, tier: WeightTier, nvme_dir: str | None,
                  prefetch_layers: int, onednn_batch: int) -> WeightStore:
    """Blocks resident on `device` (tier "gpu"; oneDNN-packed for batches of onednn_batch when > 0), or streamed
    from host memory / NVMe by ZeRO-Inference's StreamedWeights (tiers "cpu", "nvme")."""
    if tier != "gpu":
        return StreamedWeights(layers, device, tier, nvme_dir, prefetch_layers)
    layers = [{name: t.to(device) for name, t in layer.items()} for layer in layers]
    if onednn_batch:
        for layer in layers:
            decoder.onednn_pack(layer, decoder.LINEARS, onednn_batch)
    return ResidentWeights(layers)


def _pack_outer(model: nn.Module, spec: DecoderSpec, dtype: torch.dtype, bits: int | None,
                group_size: int) -> dict[str, torch.Tensor]:
    """Token / position tables, final norm and head on the CPU (replicated under TP). With int8/int4 the head is
    quantized too (and so a tied token table, whose looked-up rows are dequantized)."""
    get = model.get_submodule
    out = {"tok.weight": get(spec.outer["tok"]).weight.detach().to(dtype)}
    if "pos" in spec.outer:
        out["pos.weight"] = get(spec.outer["pos"]).weight.detach().to(dtype)
    final = get(spec.outer["norm"])
    out["norm.weight"] = (final.weight.detach().float() + spec.final_norm.offset).to(dtype)  # Gemma: 1 + weight
    if getattr(final, "bias", None) is not None:
        out["norm.bias"] = final.bias.detach().to(dtype)
    head = get(spec.outer["head"])
    out["head.weight"] = out["tok.weight"] if spec.tied_head else head.weight.detach().to(dtype)
    if bits:
        decoder.quantize_linear(out, "head", bits, group_size)
        if spec.tied_head:
            del out["tok.weight"]
            out["tok.qweight"], out["tok.scales"] = out["head.qweight"], out["head.scales"]
    return out
