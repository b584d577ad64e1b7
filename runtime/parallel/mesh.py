"""The one device grid every process group comes from (docs/design.md decision 4).

Ranks are laid out row-major over (pp, dp, cp, tp): tp is innermost, so a tensor-parallel group is
consecutive ranks (one node's NVLink domain when tp <= GPUs per node), then context parallel (its ranks
all-gather keys and values every layer: runtime/parallel/context_parallel.py), then data parallel, and pipeline
stages are outermost (they exchange the least data: one activation per micro-batch). This is Megatron-LM's
rank order tp-cp-dp-pp (megatron/core/parallel_state.py, order="tp-cp-ep-dp-pp").

Expert parallel (ep > 1) is carved out of the data-parallel ranks: dp = edp x ep, ep consecutive dp ranks sharing
their experts (each holds E / ep of every MoE block's; runtime/parallel/expert_dispatch.py) and the edp ranks that
hold the same experts averaging their gradients. The mesh is then (pp, edp, ep, cp, tp), with (edp, ep) flattened
into "dp", so that mesh["dp"] is the data-parallel dim as without experts (Megatron-Core's expert data parallel).

Context-parallel ranks hold the same parameters and see other tokens of the same sequences, so parameters
are sharded (ZeRO) and gradients averaged over dp and cp together: the flattened ("dp", "cp") dim "dp_cp"
(data_parallel_mesh), made when cp > 1 (torchtitan's "dp_shard_cp" likewise).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIM_NAMES = ("pp", "dp", "cp", "tp")
DATA_PARALLEL_CP = "dp_cp"  # the flattened (dp, cp) dim
EXPERT_MESH_DIM_NAMES = ("pp", "edp", "ep", "cp", "tp")  # ep > 1: dp = edp x ep


def build_mesh(pp: int, dp: int, tp: int, device_type: str, cp: int = 1, ep: int = 1) -> DeviceMesh:
    """A 4-D DeviceMesh of shape (pp, dp, cp, tp) named ("pp", "dp", "cp", "tp"); slice it as mesh["dp"].

    Dims of size 1 are kept so that the emitted script reads the same for every plan. With cp > 1 the
    (dp, cp) dims are also flattened into mesh["dp_cp"] (data_parallel_mesh). With ep > 1 the mesh is (pp, edp, ep,
    cp, tp), mesh["dp"] their flattened (edp, ep) (module docstring).
    """
    for name, size in zip(MESH_DIM_NAMES, (pp, dp, cp, tp), strict=True):
        if size < 1:
            raise ValueError(f"mesh dim {name} must be >= 1, got {size}")
    if ep > 1:
        if dp % ep or cp > 1:
            raise ValueError(f"expert parallel over ep={ep} needs ep to divide dp={dp} and cp=1 (cp={cp})")
        mesh = init_device_mesh(device_type, (pp, dp // ep, ep, cp, tp), mesh_dim_names=EXPERT_MESH_DIM_NAMES)
        mesh["edp", "ep"]._flatten("dp")
        return mesh
    mesh = init_device_mesh(device_type, (pp, dp, cp, tp), mesh_dim_names=MESH_DIM_NAMES)
    if cp > 1:
        mesh["dp", "cp"]._flatten(DATA_PARALLEL_CP)
    return mesh


def data_parallel_mesh(mesh: DeviceMesh, cp: int) -> DeviceMesh:
    """The 1-D mesh that shards parameters (ZeRO) and averages gradients: mesh["dp"], or with context parallel
    (cp > 1) the flattened "dp_cp" (dp * cp ranks that hold the same parameters)."""
    if cp > 1:  # build_mesh's flattened dim, as torch keeps it (slicing it from the root is deprecated)
        return mesh["dp", "cp"]._flatten(DATA_PARALLEL_CP)
    return mesh["dp"]
