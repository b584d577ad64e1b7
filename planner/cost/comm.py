"""Collective and point-to-point times, vectorised over candidates.

Ring collectives over n ranks on a link of bandwidth B (bytes/s per GPU per direction), message S
bytes (Thakur et al. 2005; Megatron-LM SC'21 Sec. 3):
    all-reduce              2 (n-1)/n * S / B + 2 (n-1) * latency
    reduce-scatter, gather    (n-1)/n * S / B +   (n-1) * latency
Groups that span nodes run hierarchically (NCCL's tree/ring across nodes): the intra-node part on
NVLink, the inter-node part with each of the g local ranks carrying 1/g of the data on its own NIC.
"""

from __future__ import annotations

import numpy as np

from zplan.schemas.cluster import ClusterSpec


def _links(cluster: ClusterSpec) -> tuple[float, float]:
    eff = cluster.efficiency
    return (cluster.intra_node_bandwidth_Bps * eff.intra_node_link,
            cluster.inter_node_bandwidth_Bps * eff.inter_node_link)


def group_shape(size: np.ndarray, stride: np.ndarray, gpus_per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """Ranks of a group per node (g) and nodes spanned (k) for a group of `size` ranks placed
    `stride` apart (tp is innermost, so a dp group has stride tp, a pp group stride tp*dp)."""
    span = size * stride  # ranks from the group's first to past its last
    per_node = np.maximum(1, np.minimum(size, gpus_per_node // np.maximum(stride, 1)))
    nodes = np.where(span <= gpus_per_node, 1, np.ceil(size / per_node)).astype(np.int64)
    return per_node, nodes


def reduce_scatter_s(
    bytes_: np.ndarray, size: np.ndarray, stride: np.ndarray, cluster: ClusterSpec
) -> np.ndarray:
    """Time of one reduce-scatter (= one all-gather) of `bytes_` over a group; 0 when size == 1."""
    intra_bw, inter_bw = _links(cluster)
    g, k = group_shape(size, stride, cluster.gpus_per_node)
    intra = (g - 1) / g * bytes_ / intra_bw + (g - 1) * cluster.intra_node_latency_s
    # Across nodes each local rank owns 1/g of the message and uses its own NIC.
    inter = (k - 1) / k * (bytes_ / g) / inter_bw + (k - 1) * cluster.inter_node_latency_s
    return np.where(size > 1, intra + inter, 0.0)


def all_reduce_s(bytes_: np.ndarray, size: np.ndarray, stride: np.ndarray, cluster: ClusterSpec) -> np.ndarray:
    """All-reduce = reduce-scatter + all-gather."""
    return 2.0 * reduce_scatter_s(bytes_, size, stride, cluster)


def p2p_s(bytes_: np.ndarray, crosses_node: np.ndarray, cluster: ClusterSpec) -> np.ndarray:
    """One point-to-point send of `bytes_` between neighbouring pipeline stages."""
    intra_bw, inter_bw = _links(cluster)
    return np.where(
        crosses_node,
        bytes_ / inter_bw + cluster.inter_node_latency_s,
        bytes_ / intra_bw + cluster.intra_node_latency_s,
    )
