"""The data loader and the pretrained-weights loader against their targets: four figures, one line each.

    .venv/bin/python benchmarks/data_and_weights.py [--json] [--quick] [--only KEY ...]

loader_over_step (target >= 20): how much faster the user-data loader delivers batches than a tiny training consumes
    them. examples/tiny.py is compiled for 1 process (`zplan compile examples/tiny.py --gpus 1 --cluster cpu-local
    --precision fp32 --zero 0 --global-batch 8`, micro-batch 8 of 64 tokens) and one process (gloo, one thread) makes
    train.py's calls with `--data TOKENS.bin` (a uint16 token file of 16M random ids below tiny's vocabulary of 256,
    with its sidecar): open_run_data, make_data_iter (runtime/data: memory-mapped, packed, shuffled), the run's own
    optimizer_step on those batches. Baseline: the optimizer steps per second of that training (forward, backward,
    clipping, AdamW, the loss read back); figure: the loader's steps' worth of micro-batches per second (a fresh
    make_data_iter, next() only) over it. Rounds alternate the two; medians. The 32 MB file is under the loader's
    bound on mapped pages (96 MiB), so its pages are never handed back here; on a 128 MB file of the same ids a
    micro-batch costs ~45 us instead of ~16 us (re-mapping the pages after each release), still > 500x tiny's step.
loader_rss_bytes (target < 200 MB): a uint16 token file of 2 GB (`--quick`: 200 MB; random ids below 50257, written in
    32 MB chunks with its sidecar) streamed end to end, in a subprocess, through open_run_data (which scans every id
    against the vocabulary) and make_data_iter, one process, micro-batches of 8 x 1024 tokens, until every sequence
    of the epoch has been delivered once. Figure: the peak resident memory (VmHWM, reset through /proc/self/clear_refs
    after the imports) minus the resident memory then. Also printed: the largest anonymous resident memory growth
    sampled (RssAnon, every 1024 micro-batches), and the file pages resident at the end (RssFile): the memory map's
    pages count in the resident set while they stay mapped (a read maps the whole page-cache folio, up to 2 MiB), so
    the loader hands them back (madvise MADV_DONTNEED, runtime/data/token_file.py) after each chunk of the scan and
    every ~96 MiB its micro-batches may have mapped; read again, they come back from the page cache.
prepare_over_tokenizer (target >= 0.8): `zplan data prepare`'s tokens/s over the tokenizer's own batch API. A
    byte-level BPE tokenizer (vocabulary 8000) is trained here on generated text (nothing is downloaded) and saved as
    save_pretrained writes it; the text (20 MB, `--quick` 2 MB, one document per line) is tokenized (1) by the Rust
    tokenizer's batch API over all its lines at once: the file read and split into lines, then
    `[e.ids for e in tokenizer.encode_batch(lines, add_special_tokens=False)]`, the ids as Python lists (what any
    caller of the batch API needs to use them; the Encoding objects alone hold nothing usable yet), nothing written:
    the baseline, and (2) by zplan.runtime.data.prepare over the same lines, which reads the file, encodes batches of
    documents with the same tokenizer (encode_batch_fast where the installed tokenizers has it: the same ids, no
    character offsets), joins them with the separator and writes the token file and its sidecar. The two are checked
    to give the same number of tokens. 5 runs each, alternating; ratio of the medians. Both run on all cores (the
    tokenizer's thread pool), so other work on the machine moves the wall-clock ratio; the ratio of the CPU seconds
    (all threads) is printed beside it.
init_peak_over_slice (target < 1.5): host memory of train.py --init-from under ZeRO-3 on 2 processes. A Llama is
    built on meta from a LlamaConfig (hidden 1280, 20 layers, MLP 3456, 20 heads, vocabulary 32000: 478M parameters,
    fp32; `--quick`: hidden 512, 4 layers, 45M), its random weights written tensor by tensor as ~400 MB safetensors
    shards with their model.safetensors.index.json (save_pretrained's layout). The folder is compiled as the model
    (`zplan compile FOLDER --gpus 2 --cluster cpu-local --precision fp32 --zero 3 --dp 2`), and 2 processes (gloo)
    make train.py's calls: open_pretrained, build_meta_model, parallelize (FSDP2 shards, materialised by the init
    replay), load_pretrained. Figure: the larger over the ranks of each rank's peak resident memory growth over
    parallelize plus the load (VmHWM, reset before them) over its shard bytes plus the file's largest tensor (the
    most a rank needs: its shards, and one whole tensor in flight). Also printed: the growth of the load alone.

The machine's 1-minute load average is printed before and after: on a shared machine the timings move with it.
About 4 minutes in full on 2 cores (the 2 GB file and the 478M-parameter checkpoint are written to a temporary
folder, removed at the end: about 4 GB of free disk), 45 s with --quick.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._launch import TINY, compile_plan_files, load_average, run_workers, worker_env, write_result  # noqa: E402

MB, MIB = 10**6, 2**20
KEYS = ("loader_over_step", "loader_rss_bytes", "prepare_over_tokenizer", "init_peak_over_slice")
TARGETS = {"loader_over_step": (">=", 20.0), "loader_rss_bytes": ("<", 200 * MB),
           "prepare_over_tokenizer": (">=", 0.8), "init_peak_over_slice": ("<", 1.5)}

# loader_over_step
TINY_VOCAB, TINY_GLOBAL_BATCH, TINY_TOKENS = 256, 8, 16 * 2**20
STEP_ROUNDS, STEPS_PER_ROUND, WARMUP_STEPS = 5, 10, 3
LOADER_STEPS_PER_ROUND = 200
# loader_rss_bytes
RSS_VOCAB, RSS_SEQ_LEN, RSS_MICRO_BATCH = 50257, 1024, 8
CHUNK_TOKENS = 16 * 2**20  # 32 MB of uint16 per write
SAMPLE_EVERY = 1024  # micro-batches between RssAnon samples
# prepare_over_tokenizer
WORDS = 5000  # distinct made-up words of 2-9 letters, Zipf-distributed
# init_peak_over_slice
SHARD_BYTES = 400 * MIB


def _status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon and RssFile of this process, in bytes."""
    text = Path("/proc/self/status").read_text()
    return {key: int(re.search(rf"{key}:\s+(\d+)", text).group(1)) * 1024
            for key in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux 4.0+)


def _no_hook() -> SimpleNamespace:
    """A model file without a train_data hook, for the data calls: tiny.py's own hook would make train.py refuse
    --data (it does not choose between the two)."""
    return SimpleNamespace(user_train_data=None)


def write_token_file(path: Path, tokens: int, vocab: int, seed: int = 0) -> None:
    """`tokens` random uint16 ids below `vocab`, written in chunks, and the sidecar."""
    import numpy as np

    from zplan.runtime.data.token_file import sidecar_path, sidecar_text

    rng = np.random.default_rng(seed)
    with open(path, "wb") as out:
        for start in range(0, tokens, CHUNK_TOKENS):
            out.write(rng.integers(0, vocab, min(CHUNK_TOKENS, tokens - start), dtype=np.uint16).tobytes())
    sidecar_path(path).write_text(sidecar_text(dtype="uint16", vocab_size=vocab, separator=None, tokenizer=None,
                                               num_tokens=tokens, documents=None))


# ---- loader_over_step ----------------------------------------------------------------------------


def loader_worker(result: str, out: str, tokens: str) -> None:
    import torch

    from zplan.model.model_file import load_model_file
    from zplan.runtime.launch.distributed import run_distributed
    from zplan.runtime.plan.apply import parallelize, plan_data_iter, plan_loss_fn, plan_mesh, plan_optimizer
    from zplan.runtime.plan.apply import train_config as make_train_config
    from zplan.runtime.plan.check import load_plan
    from zplan.runtime.training.data import make_data_iter, open_run_data
    from zplan.runtime.training.loop import WarmupCosine
    from zplan.runtime.training.materialize import build_meta_model
    from zplan.runtime.training.step import clear_gradients, loss_scaler, optimizer_step

    def run(ctx) -> None:
        plan = load_plan(Path(out) / "plan.json")
        p = plan.parallel
        model_file = load_model_file(TINY)
        mesh = plan_mesh(plan, ctx.device.type)
        model, weights = build_meta_model(model_file.build_model, seed=0, device=ctx.device)
        model, _ = parallelize(model, weights, mesh, plan, model_file, ctx.device)
        steps = WARMUP_STEPS + STEP_ROUNDS * STEPS_PER_ROUND
        optimizer = plan_optimizer(model, mesh, plan, lr=1e-3, weight_decay=0.1, steps=steps)
        config = make_train_config(plan, steps=steps, lr_schedule=WarmupCosine(max_lr=1e-3, warmup_steps=1,
                                                                          total_steps=steps), grad_clip=1.0)
        scaler = loss_scaler(model, optimizer, config.precision, ctx.device)
        global_batch = p.dp * p.num_micro_batches * p.micro_batch
        run_data = open_run_data(_no_hook(), data=tokens, val_data=None, tokenizer=None, vocab=plan.model.vocab,
                                 seq_len=plan.train.seq_len, global_batch=global_batch,
                                 eval_batches=1)

        def loader():
            return make_data_iter(_no_hook(), vocab=plan.model.vocab, seq_len=plan.train.seq_len,
                                  micro_batch=p.micro_batch, num_micro_batches=p.num_micro_batches,
                                  dp_rank=mesh["dp"].get_local_rank(), dp_size=p.dp, seed=0, data=run_data.train)

        data, loss_fn = plan_data_iter(plan, mesh, loader(), model), plan_loss_fn(plan, model_file)

        def train_steps(count: int) -> float:
            start = time.perf_counter()
            for _ in range(count):
                loss_sum, _ = optimizer_step(model, optimizer, data, loss_fn, p.num_micro_batches, config.grad_clip,
                                             scaler, ctx.device)
                clear_gradients(model, optimizer)
                loss_sum.item()
            return (time.perf_counter() - start) / count

        batches = loader()

        def loader_steps(count: int) -> float:
            start = time.perf_counter()
            for _ in range(count * p.num_micro_batches):
                next(batches)
            return (time.perf_counter() - start) / count

        train_steps(WARMUP_STEPS)
        loader_steps(10)
        step_s, loader_s = [], []
        for r in range(STEP_ROUNDS):
            for fn in ((train_steps, loader_steps) if r % 2 == 0 else (loader_steps, train_steps)):
                if fn is train_steps:
                    step_s.append(train_steps(STEPS_PER_ROUND))
                else:
                    loader_s.append(loader_steps(LOADER_STEPS_PER_ROUND))
        write_result(result, {"step_s": step_s, "loader_step_s": loader_s, "micro_batch": p.micro_batch,
                              "num_micro_batches": p.num_micro_batches, "seq_len": plan.train.seq_len,
                              "threads": torch.get_num_threads()})

    run_distributed(run)


def measure_loader_over_step(tmp: Path) -> dict:
    tokens, out = tmp / "tiny_tokens.bin", tmp / "tiny_plan"
    write_token_file(tokens, TINY_TOKENS, TINY_VOCAB)
    compile_plan_files(TINY, 1, out, global_batch=TINY_GLOBAL_BATCH, zero=0)
    r = run_workers(Path(__file__).resolve(), 1, ["loader", str(out), str(tokens)], timeout_s=900)
    step, loader = statistics.median(r["step_s"]), statistics.median(r["loader_step_s"])
    return {"loader_over_step": step / loader, "train_steps_per_s": 1 / step, "loader_steps_per_s": 1 / loader,
            "micro_batch": r["micro_batch"], "num_micro_batches": r["num_micro_batches"], "seq_len": r["seq_len"]}


# ---- loader_rss_bytes ----------------------------------------------------------------------------


def rss_worker(result: str, tokens: str) -> None:
    """Stream the token file through the loader once, in this process; its memory to `result`."""
    import numpy  # noqa: F401  (imported before the baseline, as train.py has it)
    import torch  # noqa: F401

    from zplan.runtime.training.data import make_data_iter, open_run_data

    baseline = _status()
    _reset_peak()
    start = time.perf_counter()
    run_data = open_run_data(_no_hook(), data=tokens, val_data=None, tokenizer=None, vocab=RSS_VOCAB,
                             seq_len=RSS_SEQ_LEN, global_batch=RSS_MICRO_BATCH, eval_batches=1)
    opened = _status()
    batches = make_data_iter(_no_hook(), vocab=RSS_VOCAB, seq_len=RSS_SEQ_LEN, micro_batch=RSS_MICRO_BATCH,
                             num_micro_batches=1, dp_rank=0, dp_size=1, seed=0, data=run_data.train)
    anon_peak = opened["RssAnon"]
    count = batches.num_sequences // RSS_MICRO_BATCH
    checksum = 0
    for i in range(count):
        checksum += int(next(batches)[0, 0])
        if i % SAMPLE_EVERY == 0:
            anon_peak = max(anon_peak, _status()["RssAnon"])
    end = _status()
    anon_peak = max(anon_peak, end["RssAnon"])
    write_result(result, {"peak_growth": end["VmHWM"] - baseline["VmRSS"],
                          "anon_peak_growth": anon_peak - baseline["RssAnon"],
                          "file_resident_end": end["RssFile"] - baseline["RssFile"],
                          "open_growth": opened["VmHWM"] - baseline["VmRSS"],
                          "micro_batches": count, "sequences": batches.num_sequences,
                          "seconds": time.perf_counter() - start, "checksum": checksum})


def measure_loader_rss(tmp: Path, file_bytes: int) -> dict:
    tokens = tmp / "stream_tokens.bin"
    write_token_file(tokens, file_bytes // 2, RSS_VOCAB)
    result = tmp / "rss.json"
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--rss-worker", str(result), str(tokens)],
                   check=True, env=worker_env())
    r = json.loads(result.read_text())
    tokens.unlink()
    return {"loader_rss_bytes": r["peak_growth"], "loader_anon_growth_bytes": r["anon_peak_growth"],
            "loader_file_resident_bytes": r["file_resident_end"], "loader_open_peak_bytes": r["open_growth"],
            "stream_file_bytes": file_bytes, "stream_micro_batches": r["micro_batches"],
            "stream_s": r["seconds"]}


# ---- prepare_over_tokenizer ----------------------------------------------------------------------


def make_text(path: Path, megabytes: float, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(WORDS)]
    weights = [1.0 / (rank + 1) for rank in range(WORDS)]
    lines, size = [], 0
    while size < megabytes * MB:
        line = " ".join(rng.choices(words, weights, k=rng.randint(20, 200))) + "."
        lines.append(line)
        size += len(line) + 1
    path.write_text("\n".join(lines) + "\n")
    return lines


def make_tokenizer(folder: Path, lines: list[str], vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # optional dependency: tokenizers
    from transformers import PreTrainedTokenizerFast  # optional dependency: transformers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines[:2000], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(folder)


def measure_prepare(tmp: Path, megabytes: float, vocab: int = 8000, repeats: int = 5) -> dict:
    from transformers import AutoTokenizer  # optional dependency: transformers

    from zplan.runtime.data.prepare import prepare

    text = tmp / "corpus.txt"
    lines = make_text(text, megabytes)
    make_tokenizer(tmp / "tok", lines, vocab)
    backend = AutoTokenizer.from_pretrained(str(tmp / "tok"), local_files_only=True).backend_tokenizer
    baseline_s, zplan_s, baseline_cpu_s, zplan_cpu_s, tokens = [], [], [], [], 0
    for r in range(repeats):
        for which in (("baseline", "zplan") if r % 2 == 0 else ("zplan", "baseline")):
            start, start_cpu = time.perf_counter(), time.process_time()
            if which == "baseline":
                ids = [e.ids for e in backend.encode_batch(text.read_text().splitlines(), add_special_tokens=False)]
                baseline_s.append(time.perf_counter() - start)
                baseline_cpu_s.append(time.process_time() - start_cpu)
                tokens = sum(map(len, ids)) + len(ids)  # + one separator per document, as prepare writes
                del ids
            else:
                done = prepare([text], tmp / "tok", tmp / "prepared.bin")
                zplan_s.append(time.perf_counter() - start)
                zplan_cpu_s.append(time.process_time() - start_cpu)
    assert done.tokens == tokens, (done.tokens, tokens)
    base, ours = statistics.median(baseline_s), statistics.median(zplan_s)
    return {"prepare_over_tokenizer": base / ours, "tokenizer_tokens_per_s": tokens / base,
            "prepare_tokens_per_s": tokens / ours, "text_mb": megabytes, "text_tokens": tokens,
            "prepare_over_tokenizer_cpu": statistics.median(baseline_cpu_s) / statistics.median(zplan_cpu_s),
            "tokenizer_runs_s": baseline_s, "prepare_runs_s": zplan_s}


# ---- init_peak_over_slice ------------------------------------------------------------------------


def llama_config(layers: int, hidden: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 27 // 10,
                       num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                       max_position_embeddings=256, attention_dropout=0.0, use_cache=False)


def write_checkpoint(folder: Path, layers: int, hidden: int) -> int:
    """The model's random weights as sharded safetensors with their index, one shard in memory at a time; returns
    the parameters."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    cfg = llama_config(layers, hidden)
    cfg.save_pretrained(folder)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    weight_map, shard, size, files = {}, {}, 0, []

    def flush() -> None:
        nonlocal shard, size
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, folder / name)
        files.append(name)
        weight_map.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    for name, shape in shapes.items():
        shard[name] = torch.randn(shape, generator=generator) * 0.02
        size += shard[name].nbytes
        if size >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sum(s.numel() for s in shapes.values())


def init_worker(result: str, out: str, folder: str) -> None:
    import math

    import torch.distributed as dist

    from zplan.model.model_file import load_model_file
    from zplan.runtime.checkpoint.pretrained import load_pretrained, open_pretrained
    from zplan.runtime.launch.distributed import run_distributed
    from zplan.runtime.plan.apply import parallelize, plan_mesh
    from zplan.runtime.plan.check import load_plan
    from zplan.runtime.training.materialize import build_meta_model

    def run(ctx) -> None:
        plan = load_plan(Path(out) / "plan.json")
        model_file = load_model_file(folder)
        pretrained = open_pretrained(Path(folder), model_file)
        mesh = plan_mesh(plan, ctx.device.type)
        model, weights = build_meta_model(model_file.build_model, seed=0, device=ctx.device)
        before = _status()["VmRSS"]
        _reset_peak()
        model, materialized = parallelize(model, weights, mesh, plan, model_file, ctx.device)
        after_parallelize = _status()
        _reset_peak()
        load_pretrained(pretrained, model, ctx)
        after_load = _status()
        largest = max(e.dtype.itemsize * math.prod(e.shape) for e in pretrained.tensors.values())
        row = {"rank": ctx.rank, "shard_bytes": materialized.shard_bytes, "largest_tensor_bytes": largest,
               "load_peak_growth": after_load["VmHWM"] - after_parallelize["VmRSS"],
               "total_peak_growth": max(after_parallelize["VmHWM"], after_load["VmHWM"]) - before}
        rows = [None] * ctx.world_size
        dist.all_gather_object(rows, row)
        if ctx.is_main:
            write_result(result, {"ranks": rows})

    run_distributed(run)


def measure_init(tmp: Path, layers: int, hidden: int) -> dict:
    from zplan.api import compile_plan, prepare, write_outputs
    from zplan.schemas.spec import Pins

    folder, out = tmp / "llama", tmp / "llama_plan"
    params = write_checkpoint(folder, layers, hidden)
    plan = compile_plan(prepare(str(folder), 2, "cpu-local", 2, 128, "fp32", Pins(zero=3, dp=2, tp=1, pp=1)))
    write_outputs(plan, out, str(folder))
    ranks = run_workers(Path(__file__).resolve(), 2, ["init", str(out), str(folder)], timeout_s=3600)["ranks"]
    for r in ranks:
        base = r["shard_bytes"] + r["largest_tensor_bytes"]
        r["total_over_slice"], r["load_over_slice"] = r["total_peak_growth"] / base, r["load_peak_growth"] / base
    return {"init_peak_over_slice": max(r["total_over_slice"] for r in ranks),
            "init_load_over_slice": max(r["load_over_slice"] for r in ranks), "init_parameters": params,
            "init_ranks": ranks}


# ---- main ----------------------------------------------------------------------------------------


def _holds(key: str, value: float) -> bool:
    op, target = TARGETS[key]
    return value >= target if op == ">=" else value < target


def _print(figures: dict) -> None:
    def target(key: str) -> str:
        op, value = TARGETS[key]
        shown = f"{value / MB:.0f} MB" if key == "loader_rss_bytes" else f"{value:g}"
        return f"target {op} {shown}: {'holds' if figures['holds'][key] else 'MISSED'}"

    print(f"load average {figures['load_average'][0]:.1f} before, {figures['load_average'][1]:.1f} after, "
          f"{figures['cores']} cores; {figures['wall_s']:.0f} s{' (--quick)' if figures['quick'] else ''}")
    if "loader_over_step" in figures:
        print(f"loader_over_step        {figures['loader_over_step']:8.1f}  ({target('loader_over_step')}; loader "
              f"{figures['loader_steps_per_s']:,.0f} steps/s vs training {figures['train_steps_per_s']:.1f} steps/s, "
              f"tiny.py, {figures['num_micro_batches']} x {figures['micro_batch']} x {figures['seq_len']} tokens)")
    if "loader_rss_bytes" in figures:
        print(f"loader_rss_bytes        {figures['loader_rss_bytes'] / MB:8.1f} MB  ({target('loader_rss_bytes')}; "
              f"{figures['stream_file_bytes'] / MB:,.0f} MB file, {figures['stream_micro_batches']:,} micro-batches "
              f"in {figures['stream_s']:.0f} s; peak after the vocabulary scan "
              f"{figures['loader_open_peak_bytes'] / MB:,.0f} MB, "
              f"anonymous growth {figures['loader_anon_growth_bytes'] / MB:.1f} MB, "
              f"file pages resident at the end {figures['loader_file_resident_bytes'] / MB:,.0f} MB)")
    if "prepare_over_tokenizer" in figures:
        print(f"prepare_over_tokenizer  {figures['prepare_over_tokenizer']:8.2f}  "
              f"({target('prepare_over_tokenizer')}; {figures['prepare_tokens_per_s']:,.0f} vs "
              f"{figures['tokenizer_tokens_per_s']:,.0f} tokens/s, {figures['text_mb']:g} MB of text; by CPU time "
              f"{figures['prepare_over_tokenizer_cpu']:.2f})")
    if "init_peak_over_slice" in figures:
        print(f"init_peak_over_slice    {figures['init_peak_over_slice']:8.2f}  ({target('init_peak_over_slice')}; "
              f"{figures['init_parameters'] / 1e6:.0f}M parameters, fp32, ZeRO-3 on 2 processes)")
        print("  rank  shard MiB  largest MiB  load peak MiB  (x shard+largest)  parallelize+load peak MiB  (x)")
        for r in figures["init_ranks"]:
            print(f"  {r['rank']:>4}  {r['shard_bytes'] / MIB:9.0f}  {r['largest_tensor_bytes'] / MIB:11.0f}  "
                  f"{r['load_peak_growth'] / MIB:13.0f}  {r['load_over_slice']:17.2f}  "
                  f"{r['total_peak_growth'] / MIB:25.0f}  {r['total_over_slice']:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.add_argument("--quick", action="store_true", help="small sizes: a 200 MB token file, 2 MB of text, a "
                                                             "45M-parameter model")
    parser.add_argument("--only", nargs="+", choices=KEYS, default=list(KEYS), help="measure these keys only")
    parser.add_argument("--worker", nargs=4, metavar=("RESULT", "KIND", "OUT", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--rss-worker", nargs=2, metavar=("RESULT", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result, kind, out, path = args.worker
        (loader_worker if kind == "loader" else init_worker)(result, out, path)
        return 0
    if args.rss_worker:
        rss_worker(*args.rss_worker)
        return 0
    figures: dict = {"quick": args.quick}
    load_before, start = load_average(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zplan-data-weights-") as tmp:
        tmp = Path(tmp)
        if "loader_over_step" in args.only:
            figures.update(measure_loader_over_step(tmp))
        if "loader_rss_bytes" in args.only:
            figures.update(measure_loader_rss(tmp, 200 * MB if args.quick else 2000 * MB))
        if "prepare_over_tokenizer" in args.only:
            figures.update(measure_prepare(tmp, 2.0 if args.quick else 20.0))
        if "init_peak_over_slice" in args.only:
            figures.update(measure_init(tmp, *((4, 512) if args.quick else (20, 1280))))
    figures.update(load_average=[load_before, load_average()], cores=os.cpu_count(),
                   wall_s=time.perf_counter() - start,
                   targets={k: f"{op} {v:g}" for k, (op, v) in TARGETS.items() if k in figures},
                   holds={k: _holds(k, figures[k]) for k in KEYS if k in figures})
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        _print(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
