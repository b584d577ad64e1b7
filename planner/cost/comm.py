"""Collective and point-to-point times, vectorised over candidates.

Ring collectives over n ranks on a link of bandwidth B (bytes/s per GPU per direction), message S
bytes (Thakur et al. 2005; Megatron-LM SC'21 Sec. 3):
    all-reduce              2 (n-1)/n * S / B + 2 (n-1) * latency
    reduce-scatter, gather    (n-1)/n * S / B +   (n-1) * latency
Groups that span nodes run hierarchically (NCCL's tree/ring across nodes): the intra-node part on
NVLink, the inter-node part with each of the g local ranks carrying 1/g of the data on its own NIC.
Inside a node each collective uses the profile's measured (B, latency) of its own type when the profile
has them (ClusterSpec.collectives: gloo's types differ), else the one link bandwidth and latency.
All-to-all (the compressed all-reduce's first phase, planner.cost.compression) sends directly, with no
hierarchy: each rank sends S/n to every other rank, so the (n - g)/n of S bound for other nodes leaves on
its own inter-node link, g times what the hierarchical pass above carries there.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from zplan.schemas.cluster import ClusterSpec

Collective = Literal["all_reduce", "all_gather", "reduce_scatter"]


def _links(cluster: ClusterSpec) -> tuple[float, float]:
    eff = cluster.efficiency
    return (cluster.intra_node_bandwidth_Bps * eff.intra_node_link,
            cluster.inter_node_bandwidth_Bps * eff.inter_node_link)


def intra_node_link(cluster: ClusterSpec, kind: Collective) -> tuple[float, float]:
    """(bandwidth B/s, latency s per ring step) of one collective type inside a node."""
    if cluster.collectives is not None:
        cost = getattr(cluster.collectives, kind)
        return cost.bandwidth_Bps, cost.latency_s
    return _links(cluster)[0], cluster.intra_node_latency_s


def group_shape(size: np.ndarray, stride: np.ndarray, gpus_per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """Ranks of a group per node (g) and nodes spanned (k) for a group of `size` ranks placed
    `stride` apart (tp is innermost, so a dp group has stride tp, a pp group stride tp*dp). A "node" here is the
    cluster's link domain (ClusterSpec.link_domain: an NVL72 rack)."""
    span = size * stride  # ranks from the group's first to past its last
    per_node = np.maximum(1, np.minimum(size, gpus_per_node // np.maximum(stride, 1)))
    nodes = np.where(span <= gpus_per_node, 1, np.ceil(size / per_node)).astype(np.int64)
    return per_node, nodes


def _one_pass_s(bytes_: np.ndarray, size: np.ndarray, stride: np.ndarray, cluster: ClusterSpec,
                kind: Collective) -> np.ndarray:
    """One reduce-scatter- or all-gather-shaped pass of `bytes_` over a group; 0 when size == 1."""
    intra_bw, latency_s = intra_node_link(cluster, kind)
    inter_bw = _links(cluster)[1]
    g, k = group_shape(size, stride, cluster.link_domain())
    intra = (g - 1) / g * bytes_ / intra_bw + (g - 1) * latency_s
    # Across nodes each local rank owns 1/g of the message and uses its own NIC.
    inter = (k - 1) / k * (bytes_ / g) / inter_bw + (k - 1) * cluster.inter_node_latency_s
    return np.where(size > 1, intra + inter, 0.0)


def reduce_scatter_s(
    bytes_: np.ndarray, size: np.ndarray, stride: np.ndarray, cluster: ClusterSpec
) -> np.ndarray:
    """Time of one reduce-scatter of `bytes_` (the full tensor) over a group; 0 when size == 1."""
    return _one_pass_s(bytes_, size, stride, cluster, "reduce_scatter")


def all_gather_s(bytes_: np.ndarray, size: np.ndarray, stride: np.ndarray, cluster: ClusterSpec) -> np.ndarray:
    """Time of one all-gather into `bytes_` (the full tensor) over a group; 0 when size == 1."""
    return _one_pass_s(bytes_, size, stride, cluster, "all_gather")


def all_reduce_s(bytes_: np.ndarray, size: np.ndarray, stride: np.ndarray, cluster: ClusterSpec) -> np.ndarray:
    """All-reduce = reduce-scatter + all-gather (two passes at the all-reduce's own cost)."""
    return 2.0 * _one_pass_s(bytes_, size, stride, cluster, "all_reduce")


def all_to_all_s(bytes_: np.ndarray, size: np.ndarray, stride: np.ndarray, cluster: ClusterSpec) -> np.ndarray:
    """Time of one all-to-all in which every rank sends `bytes_` (the whole tensor it holds) split in `size`
    equal parts, one to each rank, directly (module docstring): (g-1)/n of it over the intra-node link (at the
    all-gather's measured cost where the profile has one), (n-g)/n over this rank's inter-node link; 0 when
    size == 1."""
    intra_bw, latency_s = intra_node_link(cluster, "all_gather")
    inter_bw = _links(cluster)[1]
    g, k = group_shape(size, stride, cluster.link_domain())
    n = np.maximum(size, 1)
    intra = (g - 1) / n * bytes_ / intra_bw + (g - 1) * latency_s
    inter = (n - g) / n * bytes_ / inter_bw + (k - 1) * cluster.inter_node_latency_s
    return np.where(size > 1, intra + inter, 0.0)


def per_node_all_to_all_s(bytes_: np.ndarray, size: np.ndarray, stride: np.ndarray, inter_bytes: np.ndarray,
                          cluster: ClusterSpec) -> np.ndarray:
    """An all-to-all dispatched per node (DeepEP's and HybridEP's hierarchical kernels): of the `bytes_` this rank
    sends in `size` equal parts, each of the (n-1)/n bound elsewhere crosses NVLink once (inside this node, or
    forwarded inside the node it reaches), and this rank's inter-node link carries `inter_bytes` (one copy of a token
    per other node it visits: planner.cost.step.remote_nodes_visited); 0 when size == 1."""
    intra_bw, latency_s = intra_node_link(cluster, "all_gather")
    inter_bw = _links(cluster)[1]
    g, k = group_shape(size, stride, cluster.link_domain())
    n = np.maximum(size, 1)
    intra = (n - 1) / n * bytes_ / intra_bw + (g - 1) * latency_s
    inter = inter_bytes / inter_bw + (k - 1) * cluster.inter_node_latency_s
    return np.where(size > 1, intra + inter, 0.0)


def p2p_s(bytes_: np.ndarray, crosses_node: np.ndarray, cluster: ClusterSpec) -> np.ndarray:
    """One point-to-point send of `bytes_` between neighbouring pipeline stages."""
    intra_bw, inter_bw = _links(cluster)
    return np.where(
        crosses_node,
        bytes_ / inter_bw + cluster.inter_node_latency_s,
        bytes_ / intra_bw + cluster.intra_node_latency_s,
    )
