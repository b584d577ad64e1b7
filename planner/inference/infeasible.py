"""When no serving configuration fits: name the closest one, how far over memory it is, and the smallest change
that would fit (each checked by re-running the numpy scoring with one request relaxed)."""

from __future__ import annotations

from dataclasses import replace
from typing import NoReturn

import numpy as np

from zplan.errors import InfeasibleError
from zplan.planner.inference.cost import InferenceModel, Workload
from zplan.planner.inference.search import GiB, SearchSpace, describe, legal_tps, quantized_for, score
from zplan.schemas.cluster import ClusterSpec


def fits(model: InferenceModel, cluster: ClusterSpec, work: Workload, space: SearchSpace) -> bool:
    return bool(space.tps) and bool(np.any(score(model, cluster, work, space).est.fits))


def fewest_gpus(model: InferenceModel, cluster: ClusterSpec, work: Workload, space: SearchSpace,
                pinned_tp: int | None) -> int | None:
    """The fewest GPUs, more than now and at most one node, on which some tensor-parallel degree (the pinned one,
    if any) fits; a replica is tensor parallel inside a node, so GPUs beyond one node do not shrink it."""
    for n in range(work.gpus + 1, cluster.gpus_per_node + 1):
        tps = [t for t in legal_tps(model, n, cluster) if pinned_tp in (None, t)]
        if fits(model, cluster, replace(work, gpus=n), replace(space, tps=tuple(tps))):
            return n
    return None


def relaxations(space: SearchSpace, cluster: ClusterSpec) -> dict[str, SearchSpace]:
    """Option -> the search space with that one request relaxed (only requests the space excludes; fp8 only where
    the cluster runs it)."""
    out = {f"--precision {p}": replace(space, precisions=(p,)) for p in quantized_for(cluster)
           if p not in space.precisions}
    out.update({f"--offload {t}": replace(space, tiers=(t,)) for t in ("cpu", "nvme") if t not in space.tiers})
    return out


def largest_batch_that_fits(model: InferenceModel, cluster: ClusterSpec, work: Workload, space: SearchSpace
                            ) -> int | None:
    """Halve a pinned batch until something fits; None if the batch is not pinned or batch 1 does not fit."""
    if len(space.batches) != 1:
        return None
    batch = space.batches[0] // 2
    while batch >= 1:
        if fits(model, cluster, work, replace(space, batches=(batch,))):
            return batch
        batch //= 2
    return None


def raise_infeasible(model: InferenceModel, cluster: ClusterSpec, work: Workload, space: SearchSpace,
                     model_name: str, pinned_tp: int | None) -> NoReturn:
    scored = score(model, cluster, work, space)
    est = scored.est
    closest = int(np.argmin(est.total))
    capacity = cluster.gpu.hbm_bytes
    over = est.total[closest] - capacity
    if over > 0:
        where = (f"needs {est.total[closest] / GiB:.1f} GiB per GPU against {capacity / GiB:.1f} GiB "
                 f"({over / GiB:+.1f} GiB: weights {est.weights[closest] / GiB:.1f}, KV cache "
                 f"{est.kv_cache[closest] / GiB:.1f})")
    else:
        where = (f"fits the GPU but not the node's host memory or NVMe ({est.cpu_bytes_per_node[closest] / GiB:.0f} "
                 f"GiB host, {est.nvme_bytes_per_node[closest] / GiB:.0f} GiB NVMe per node)")
    found = [flag for flag, wider in relaxations(space, cluster).items() if fits(model, cluster, work, wider)]
    batch = largest_batch_that_fits(model, cluster, work, space)
    if batch is not None:
        found.append(f"--batch {batch}")
    for prompt, gen in ((work.prompt_len // 2, work.gen_len), (work.prompt_len, max(1, work.gen_len // 2))):
        shorter = replace(work, prompt_len=max(1, prompt), gen_len=gen)
        if (prompt, gen) != (work.prompt_len, work.gen_len) and fits(model, cluster, shorter, space):
            found.append(f"--prompt-len {shorter.prompt_len} --gen-len {shorter.gen_len}")
            break
    more = fewest_gpus(model, cluster, work, space, pinned_tp)
    if more is not None:
        found.append(f"--gpus {more} (the fewest that fit)")
    hint = ("; would fit: " + ", ".join(found)) if found else (
        "; nothing tried would fit (more GPUs, int8/int4 weights, host or NVMe offload, a smaller batch, shorter "
        "sequences): use GPUs with more memory")
    raise InfeasibleError(
        f"no inference plan for {model_name} fits {work.gpus}x {cluster.gpu.name}. Closest: "
        f"{describe(scored, closest, with_batch=True)}, which {where}{hint}.")
