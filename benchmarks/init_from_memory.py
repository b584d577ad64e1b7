"""Host memory of train.py --init-from under ZeRO-3: each rank's peak RSS growth while it reads its slices of a
sharded safetensors checkpoint, against its own slice plus the largest tensor.

    .venv/bin/python benchmarks/init_from_memory.py [--layers 20] [--hidden 1280] [--json]

Model: a Llama built on meta from a LlamaConfig (hidden 1280, 20 layers, MLP 3456, 20 heads, vocabulary 32000:
about 480M parameters, fp32), its random weights written tensor by tensor as ~400 MB safetensors shards with their
model.safetensors.index.json in a temporary folder (save_pretrained's layout). The folder is compiled as the model
(`zplan compile FOLDER --gpus 2 --cluster cpu-local --precision fp32 --zero 3 --dp 2`), and 2 processes (gloo) make
train.py's calls: open_pretrained, build_meta_model, parallelize (FSDP2 shards, materialised by the init replay),
then load_pretrained, the step measured. Peak RSS is the kernel's high-water mark (VmHWM, reset through
/proc/self/clear_refs before the step).

Printed per rank: the bytes of its shards, the largest tensor of the file, the peak RSS growth of (a) the load alone
(the shards exist already: what reading adds, slices and mapped file pages) and (b) parallelize plus the load (the
shards allocated and filled, then overwritten), each against shard + largest tensor (target of (b): under 1.5).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._launch import run_workers, write_result  # noqa: E402

MIB = 2**20
SHARD_BYTES = 400 * MIB


def _status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    text = Path("/proc/self/status").read_text()
    return {key: int(re.search(rf"{key}:\s+(\d+)", text).group(1)) * 1024 for key in ("VmRSS", "VmHWM")}


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux 4.0+)


def config(layers: int, hidden: int):
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

    cfg = config(layers, hidden)
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


def worker(result: str, out: str, folder: str) -> None:
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
        largest = max(e.dtype.itemsize * _numel(e.shape) for e in pretrained.tensors.values())
        row = {"rank": ctx.rank, "shard_bytes": materialized.shard_bytes, "largest_tensor_bytes": largest,
               "load_peak_growth": after_load["VmHWM"] - after_parallelize["VmRSS"],
               "total_peak_growth": max(after_parallelize["VmHWM"], after_load["VmHWM"]) - before}
        rows = [None] * ctx.world_size
        dist.all_gather_object(rows, row)
        if ctx.is_main:
            write_result(result, {"ranks": rows})

    run_distributed(run)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=3, metavar=("RESULT", "OUT", "FOLDER"), help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1280)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    from zplan.api import compile_plan, prepare, write_outputs
    from zplan.schemas.spec import Pins

    with tempfile.TemporaryDirectory(prefix="zplan-init-from-") as tmp:
        folder, out = Path(tmp) / "llama", Path(tmp) / "out"
        params = write_checkpoint(folder, args.layers, args.hidden)
        plan = compile_plan(prepare(str(folder), 2, "cpu-local", 2, 128, "fp32", Pins(zero=3, dp=2, tp=1, pp=1)))
        write_outputs(plan, out, str(folder))
        result = run_workers(Path(__file__).resolve(), 2, [str(out), str(folder)], timeout_s=3600)
    result["parameters"] = params
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{params / 1e6:.0f}M parameters, fp32, ZeRO-3 on 2 processes (gloo)")
    print("rank  shard MiB  largest MiB  load peak MiB  (x shard+largest)  parallelize+load peak MiB  (x)")
    for r in result["ranks"]:
        base = r["shard_bytes"] + r["largest_tensor_bytes"]
        print(f"{r['rank']:>4}  {r['shard_bytes'] / MIB:9.0f}  {r['largest_tensor_bytes'] / MIB:11.0f}  "
              f"{r['load_peak_growth'] / MIB:13.0f}  {r['load_peak_growth'] / base:17.2f}  "
              f"{r['total_peak_growth'] / MIB:25.0f}  {r['total_peak_growth'] / base:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
