"""fp8 training of the blocks' Linears (plan.train.precision 'fp8'): torchao's float8 training, tensorwise dynamic
scaling (torchao.float8.convert_to_float8_training with its default Float8LinearConfig).

    model = convert_blocks_to_float8(model, plan.model.block_prefix, device)   # first step of parallelize

What changes: every nn.Linear under `block_prefix` whose in and out features are multiples of 16 (the fp8 GEMM's
requirement, torchao's own auto filter) becomes a torchao Float8Linear, the same Parameter objects (names, init
replay and state dicts unchanged): its forward casts the input and the weight to float8_e4m3fn with one scale per
tensor (448 / amax: e4m3's largest value over the tensor's), its backward the output gradient to float8_e5m2, and
the three GEMMs (output, input gradient, weight gradient) run as torch._scaled_mm. Everything else is bf16 mixed
precision (schemas.spec.compute_dtype): parameters, gradients, fp32 master weights, attention, norms, the embedding
and the head (torchtitan filters the output layer out too), which stay outside `block_prefix`.

Memory: torchao's matmul_with_hp_or_float8_args saves the high-precision (bf16) input and weight for backward
(torchao/float8/float8_linear.py, ctx.save_for_backward(input_hp, weight_hp_t)) and casts them to fp8 again in
backward, so what backward keeps is bf16's; the casts' fp32 temporaries and fp8 copies are transient, one Linear's
at a time (planner.cost.memory.FP8_CAST_TEMPORARY_BYTES_PER_ELEMENT: 7.5 bytes per (b, s, ffn) element, measured by
the dry run, which runs this code on fake tensors).

Order (torchao's README: convert before FSDP2's fully_shard and before tensor parallel): this runs first, on the
meta model, before tensor parallel, recompute, the pipeline split and DDP / ZeRO-1 / FSDP2. The device decides how
the GEMMs run: a CUDA device of compute capability 8.9 or more (Ada, Hopper, Blackwell: fp8 tensor cores) runs
torch._scaled_mm on them; the CPU runs the same code path through torch 2.13's CPU _scaled_mm kernel (tests; the dry
run's fake tensors through its meta kernel), so what CPU tests and the dry run check is what a GPU runs; an older
GPU is refused. torchao's emulation (emulate=True: each GEMM on the dequantized tensors) is there for the tests that
compare it with _scaled_mm.

Tensor parallel (tp > 1): a Linear converts when its dims on each rank are multiples of 16 (a colwise split divides
its out features by tp, a rowwise split its in features: the GEMMs run on the shards), and
runtime.parallel.tensor_parallel
gives each Float8Linear torchao's Float8ColwiseParallel / Float8RowwiseParallel (float8_parallel_styles; a Linear
left in bf16 keeps the plain style; fused projections, model/fused_layout.py, split and reorder as in bf16). Every
cast is tensorwise over the whole tensor: the amax of a sharded weight, input or gradient is all-reduced (MAX, one
scalar, DTensor's reduction), so each rank casts with the scale one process would use. What crosses the tp ranks is
what bf16 tensor parallel sends, in bf16 (all-reduces, or under sequence parallel all-gathers and reduce-scatters
of (b, s, h)), the casts running after each gather: torchao's styles (and torchtitan) all-gather in fp8 instead,
which halves the gathered bytes but which gloo cannot send (no float8 all-gather: the CPU tests). On top come the
amax all-reduces, one scalar each: per block and micro-batch, forward one per split weight and per rowwise input,
backward one per split weight (recast) and per colwise output gradient (planner.cost.step.fp8_amax_reduces prices
them). With tp > 1 a Float8Linear saves its input for backward as the fp8 tensor the style cast (1 byte an element),
not bf16 (the memory model counts bf16: an over-count).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from zplan.errors import PlanMismatchError
from zplan.schemas.capability import FP8_DIM_MULTIPLE
from zplan.schemas.spec import Precision

FP8_MIN_CAPABILITY = (8, 9)  # sm_89 (Ada) and later have fp8 tensor cores


def on_fake_tensors() -> bool:
    """True inside a FakeTensorMode (the dry run: runtime.dryrun.fake_world)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def float8_emulated(device: torch.device) -> bool:
    """Whether torchao emulates the fp8 GEMMs (emulate=True: a GEMM on the dequantized tensors) rather than running
    torch._scaled_mm. False on a CUDA device of capability 8.9 or more (fp8 tensor cores) and on the CPU, where
    torch 2.13 has a _scaled_mm kernel (correct, no faster than bf16): the CPU then runs the GPU's code path (the
    same casts, scales and saved tensors; on fake tensors, the dry run, its meta kernel). An older GPU or another
    device raises PlanMismatchError (compile refuses fp8 for a cluster without fp8 tensor cores)."""
    on_tensor_cores(device, "fp8", "fp8", FP8_MIN_CAPABILITY, "8.9 or more: L40S, H100, H200, B200", "bf16")
    return False


def on_tensor_cores(device: torch.device | str, precision: Precision, cores: str, min_capability: tuple[int, int],
                    which: str, fallback: str) -> bool:
    """True on a CUDA device of `min_capability` or more (its `cores` tensor cores run `precision`), False on the CPU;
    another device, or an older GPU, raises PlanMismatchError naming the GPUs that have them (`which`) and the
    `fallback` precision to recompile with."""
    device = torch.device(device)
    if device.type == "cpu":
        return False
    if device.type != "cuda":
        raise PlanMismatchError(f"the plan trains in {precision}, which runs on CUDA GPUs (or the CPU), not on "
                                f"{device.type}: recompile with --precision bf16")
    capability = torch.cuda.get_device_capability(device)
    if capability < min_capability:
        raise PlanMismatchError(
            f"the plan trains in {precision}, but {torch.cuda.get_device_name(device)} (compute capability "
            f"{capability[0]}.{capability[1]}) has no {cores} tensor cores ({which}): recompile for this cluster "
            f"with --precision {fallback}")
    return True


def local_features(module: nn.Linear, style: str | None, tp: int) -> tuple[int, int]:
    """(in, out) features of the GEMMs `module` runs on one tp rank: a colwise split divides out by tp, a rowwise
    split in; unsplit (style None, or tp 1) the module's own."""
    inner, outer = module.in_features, module.out_features
    if tp > 1 and style == "colwise":
        outer //= tp
    elif tp > 1 and style == "rowwise":
        inner //= tp
    return inner, outer


def fp8_convertible(module: nn.Module, style: str | None = None, tp: int = 1) -> bool:
    """An nn.Linear whose (in, out) features are both multiples of 16 on each tp rank (local_features: `style`, the
    plan's split of it, 'colwise' or 'rowwise', None when not split)."""
    return isinstance(module, nn.Linear) and all(
        features % FP8_DIM_MULTIPLE == 0 for features in local_features(module, style, tp))


def _quiet_torchao_import(load):
    """`load()` (an import of torchao's float8 modules) without the warnings torchao's import logs on a machine
    without CUDA (its CUDA kernel libraries do not load there; float8 training does not use them). transformers
    imports torchao itself when it is installed (its quantizers), before this runs for a Hugging Face model: the
    filters `import zplan` installs (zplan.import_warnings) drop exactly those lines then."""
    import logging

    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        return load()
    except ImportError as error:
        raise PlanMismatchError(f"the plan trains in fp8, which needs torchao ({error}): pip install 'zplan[fp8]' "
                                "(torchao 0.18.0), or recompile with --precision bf16") from error
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)


def _torchao_float8():
    """torchao's float8 entry points, imported lazily (only fp8 runs import torchao)."""
    def load():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        return Float8LinearConfig, convert_to_float8_training

    return _quiet_torchao_import(load)


@functools.cache
def float8_parallel_styles() -> tuple[type, type]:
    """(colwise, rowwise): the ParallelStyles runtime.parallel.tensor_parallel gives a Float8Linear, torchao's
    Float8ColwiseParallel and Float8RowwiseParallel (the sharding of ColwiseParallel / RowwiseParallel; the input
    cast to fp8 as a DTensor, the output gradient cast in backward) with the sequence-parallel collectives moved to
    the bf16 side of the casts (module docstring):

        colwise, input sharded on the sequence: all-gather the bf16 input, then cast (torchao: cast, then gather fp8)
        rowwise, output reduce-scattered: the gradient all-gathered in bf16, then cast (torchao: cast, gather fp8)

    Both casts are tensorwise with the amax of the whole tensor (DTensor reduces it over the ranks), so the fp8
    values are torchao's; only the bytes gathered double (1 -> 2 an element), which is what planner.cost.step
    prices, and gloo (the CPU tests) has no float8 all-gather at all."""
    def load():
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        return Float8ColwiseParallel, Float8RowwiseParallel

    colwise, rowwise = _quiet_torchao_import(load)

    class Float8Colwise(colwise):
        @staticmethod
        def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
            from torch.distributed.tensor import DTensor

            tensor = inputs[0]
            if not isinstance(tensor, DTensor):
                tensor = DTensor.from_local(tensor, device_mesh, input_layouts, run_check=False)
            if tensor.placements != tuple(desired_input_layouts):
                tensor = tensor.redistribute(placements=desired_input_layouts)  # bf16 all-gather
            return colwise._prepare_input_fn(desired_input_layouts, desired_input_layouts, mod, (tensor,),
                                             device_mesh)  # the cast, on the gathered input

    class Float8Rowwise(rowwise):
        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            from torchao.float8.float8_scaling_utils import NoopFwToFloat8BwDynamic

            # backward: the cast runs after the redistribute's own backward (the bf16 all-gather under sequence
            # parallel), on the gathered gradient
            outputs = NoopFwToFloat8BwDynamic.apply(outputs, mod.linear_mm_config,
                                                    mod.config.cast_config_grad_output.target_dtype)
            if outputs.placements != tuple(output_layouts):
                outputs = outputs.redistribute(placements=output_layouts)  # all-reduce or reduce-scatter, bf16
            return outputs.to_local() if use_local_output else outputs

    return Float8Colwise, Float8Rowwise


def convert_blocks_to_float8(model: nn.Module, block_prefix: str, device: torch.device | str,
                             say=print, emulate: bool | None = None, tp: int = 1,
                             tp_plan: dict[str, str] | None = None) -> list[str]:
    """Swap the fp8-convertible Linears under `block_prefix` (e.g. 'model.layers', 'blocks') for torchao
    Float8Linears, in place; returns their module paths. Linears with a dim not a multiple of 16 (with tensor
    parallel: a dim of the rank's share, `tp_plan` giving each split Linear's style by its path inside a block) stay
    bf16 (named in one line through `say`); a model none of whose block Linears converts is refused (the plan priced
    its block GEMMs at the fp8 peak). Linears outside the blocks (the head) are never converted. `emulate` None: as
    the device runs them (float8_emulated); True: torchao's emulation (tests compare the two)."""
    emulate = float8_emulated(device) if emulate is None else emulate
    Float8LinearConfig, convert_to_float8_training = _torchao_float8()
    tp_plan = tp_plan or {}

    blocks = model.get_submodule(block_prefix)
    converted, skipped = [], []

    def keep(module: nn.Module, fqn: str) -> bool:  # torchao's module_filter_fn: (module, path in `blocks`)
        if not isinstance(module, nn.Linear) or type(module).__name__ == "Float8Linear":
            return False
        style = tp_plan.get(fqn.partition(".")[2])  # fqn: '<block index>.<path inside the block>'
        path, convert = f"{block_prefix}.{fqn}", fp8_convertible(module, style, tp)
        if convert:
            converted.append(path)
        else:
            inner, outer = local_features(module, style, tp)
            share = f", {inner} -> {outer} on each of tp={tp} ranks" if (inner, outer) != (
                module.in_features, module.out_features) else ""
            skipped.append(f"{path} ({module.in_features} -> {module.out_features}{share})")
        return convert

    convert_to_float8_training(blocks, module_filter_fn=keep, config=Float8LinearConfig(emulate=emulate))
    if not converted:
        raise PlanMismatchError(
            f"the plan trains in fp8 but no Linear under {block_prefix} has in and out features that are multiples of "
            f"{FP8_DIM_MULTIPLE}" + (f" on each of tp={tp} ranks" if tp > 1 else "")
            + " (fp8 GEMMs need them): recompile with --precision bf16" + (" or a smaller --tp" if tp > 1 else ""))
    how = ("emulated: fp8 casts, GEMMs on the dequantized tensors" if emulate
           else "torch._scaled_mm on fp8 tensor cores" if torch.device(device).type == "cuda"
           else "torch._scaled_mm's CPU kernel: the GPU's code path, correct but no faster than bf16")
    say(f"zplan: fp8 GEMMs in {len(converted)} block Linears (torchao Float8Linear, tensorwise dynamic scaling; "
        f"{how}); bf16 elsewhere")
    if skipped:
        say(f"zplan: kept in bf16 (a dim not a multiple of {FP8_DIM_MULTIPLE}{' on a tp rank' if tp > 1 else ''}): "
            f"{', '.join(skipped[:4])}"
            + (f" and {len(skipped) - 4} more" if len(skipped) > 4 else ""))
    return converted
