"""What tracing and running both need to know of a model's modules: its stack of blocks, norms and GPT-2's Conv1D,
module paths, which parameters a tensor-parallel split leaves whole, and the generation cache training turns off."""

from __future__ import annotations

from typing import Literal

from torch import nn


def is_norm(module: nn.Module) -> bool:
    """LayerNorm, RMSNorm and model files' own *Norm classes (e.g. LlamaRMSNorm)."""
    return type(module).__name__.endswith("Norm")


def is_conv1d(module: nn.Module | None) -> bool:
    """transformers.pytorch_utils.Conv1D (GPT-2): a Linear with its weight transposed, (in, out), out = nf."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None


def parent_path(path: str) -> str:
    """'attn.q' -> 'attn'; 'qkv' -> '' (the block itself)."""
    return path.rpartition(".")[0]


def unsplit_parameter_owners(block: nn.Module, split: set[str]
                             ) -> list[tuple[str, nn.Module, Literal["beside", "head_norm", "norm", "other"]]]:
    """The modules of `block` that own parameters and are not among the `split` Linears (paths in the block),
    each with its role under tensor parallel: 'head_norm' (inside a module holding split Linears, a norm whose
    weights are head_dim long, that module's: it normalises each head, and a rank holds whole heads, as Qwen3's
    q_norm and k_norm), 'beside' (any other inside such a module: it would see one rank's features or heads),
    'norm' (elsewhere, a norm: sequence parallel runs it on this rank's tokens) or 'other' (elsewhere: replicated,
    but under sequence parallel it would see one rank's tokens). The runtime's check_block_split and the tracer's
    traits both judge by this."""
    holders = sorted({parent_path(path) for path in split} - {""}, key=len, reverse=True)  # innermost first
    owners = []
    for name, module in block.named_modules():
        if name in split or not any(p is not None for p in module._parameters.values()):
            continue
        holder = next((h for h in holders if name == h or name.startswith(h + ".")), None)
        if holder is not None and name != holder and _normalises_each_head(module, block.get_submodule(holder)):
            owners.append((name, module, "head_norm"))
        elif holder is not None:
            owners.append((name, module, "beside"))
        else:
            owners.append((name, module, "norm" if name and is_norm(module) else "other"))
    return owners


def _normalises_each_head(module: nn.Module, holder: nn.Module) -> bool:
    """A norm whose every parameter is one vector of the holder's head_dim: it runs over each head's features."""
    head_dim = getattr(holder, "head_dim", None)
    params = [p for p in module._parameters.values() if p is not None]
    return is_norm(module) and isinstance(head_dim, int) and all(p.dim() == 1 and p.numel() == head_dim
                                                                 for p in params)


def transformer_blocks(model: nn.Module, block_prefix: str) -> list[nn.Module]:
    """The repeated blocks in execution order, from the container at `block_prefix` (e.g. 'blocks')."""
    container = model.get_submodule(block_prefix)
    if isinstance(container, nn.ModuleDict):
        return list(container.values())
    if isinstance(container, (nn.ModuleList, nn.Sequential)):
        return list(container)
    kind = type(container).__name__
    raise ValueError(f"{block_prefix} is a {kind}, not a ModuleList, Sequential or ModuleDict of blocks")


def disable_generation_cache(model: nn.Module) -> nn.Module:
    """Training keeps no generation cache: a Hugging Face model's forward fills a KV cache (config.use_cache, on by
    default) that a recomputed block would fill again in backward, with keys twice as long (activation recompute
    then fails: torch's checkpoint finds other ops than the forward ran), and that holds every layer's keys and
    values besides what backward saves. HF's own gradient checkpointing turns it off the same way."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False):
            config.use_cache = False
    return model
