"""The one device grid every process group comes from (DESIGN.md decision 4).

Ranks are laid out row-major over (pp, dp, tp): tp is innermost, so a tensor-parallel group is
consecutive ranks (one node's NVLink domain when tp <= GPUs per node), then data parallel, and pipeline
stages are outermost (they exchange the least data: one activation per micro-batch).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIM_NAMES = ("pp", "dp", "tp")


def build_mesh(pp: int, dp: int, tp: int, device_type: str) -> DeviceMesh:
    """A 3-D DeviceMesh of shape (pp, dp, tp) named ("pp", "dp", "tp"); slice it as mesh["dp"].

    Dims of size 1 are kept so that the emitted script reads the same for every plan.
    """
    for name, size in zip(MESH_DIM_NAMES, (pp, dp, tp), strict=True):
        if size < 1:
            raise ValueError(f"mesh dim {name} must be >= 1, got {size}")
    return init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=MESH_DIM_NAMES)
