"""Expert parallelism (runtime/parallel/expert_dispatch.py) over 2 gloo ranks against one process.

Each rank builds the model as a run does (on meta, experts sharded, then its weights made by replaying the
initialisation: runtime/training/materialize.py), holds E/2 experts (Shard(0) DTensors) and feeds its own batch; the
reference is the whole model, running its own experts forward (transformers' eager loop, examples/moe.py's loop), on
the two batches concatenated. The loss is the summed cross-entropy of every predicted token divided by the tokens of
both batches together: each rank's loss is its share of the reference's mean, so that the reference's gradient is
the sum of the ranks'. Then:
- each rank's weights are the reference's (its experts: their rows), bit for bit;
- the concatenated logits of the ranks equal the reference's (1e-5);
- each rank's expert-gradient shard equals its rows of the reference gradient, with no reduction (the exchange's
  backward brings every rank's tokens' gradients to the experts' holder);
- the other gradients, summed over the ranks (what data parallelism's all-reduce does), equal the reference's.
This file is also the worker script: `python test_expert_parallel.py worker` under 2 ranks.
"""

from __future__ import annotations

import functools
import json
import sys

import torch
import torch.nn.functional as F

from tests.distributed.harness import Ranks

MODELS = ("mixtral", "qwen3_moe", "example")
VOCAB = 64


def _build(name: str):
    """(model, is a Hugging Face model) with the unit tests' tiny configs, from the RNG as it is."""
    from tests.unit.test_experts_runtime import example_model, hf_model

    return (example_model(), False) if name == "example" else (hf_model(name), True)


def _model(name: str):
    return _build(name)[0]


def _loss_and_logits(model, tokens: torch.Tensor, hf: bool, predicted_tokens: int):
    logits = model(input_ids=tokens).logits if hf else model(tokens)  # (B, T, V)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
    return loss / predicted_tokens, logits


def _worker() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from zplan.runtime.parallel.experts import apply_experts
    from zplan.runtime.training.materialize import build_meta_model, materialize_weights

    dist.init_process_group("gloo")
    rank, ep = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",))
    batches = [torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(10 + r)) for r in range(ep)]
    predicted = sum(b[:, 1:].numel() for b in batches)  # tokens whose successor is predicted, both ranks
    for name in MODELS:
        torch.manual_seed(0)
        reference, hf = _build(name)
        whole = torch.cat(batches)  # (ep * 2, 9)
        loss, reference_logits = _loss_and_logits(reference, whole, hf, predicted)
        loss.backward()
        model, weights = build_meta_model(functools.partial(_model, name), seed=0)  # as a run builds it: on meta,
        layers = apply_experts(model, mesh)  # sharded, then each rank's rows made by replaying the init
        report = materialize_weights(model, weights, "cpu")
        loss, logits = _loss_and_logits(model, batches[rank], hf, predicted)
        loss.backward()
        gathered = [torch.empty_like(logits) for _ in range(ep)]
        dist.all_gather(gathered, logits.detach().contiguous())
        expert_diff, other_diff, sharded, weight_diff = 0.0, 0.0, [], 0.0
        reference_params = dict(reference.named_parameters())
        for param_name, param in model.named_parameters():
            full = reference_params[param_name].grad
            if isinstance(param, DTensor):  # an expert shard: this rank's rows, as they are
                rows = full.shape[0] // ep
                local = param.grad.to_local()
                own_rows = reference_params[param_name].detach()[rank * rows:(rank + 1) * rows]
                weight_diff = max(weight_diff, (param.to_local() - own_rows).abs().max().item())
                sharded.append([param_name, list(param.to_local().shape), list(param.shape)])
                expert_diff = max(expert_diff, (local - full[rank * rows:(rank + 1) * rows]).abs().max().item())
            else:
                own = reference_params[param_name].detach()
                weight_diff = max(weight_diff, (param.detach() - own).abs().max().item())
                grad = param.grad.clone()
                dist.all_reduce(grad)
                other_diff = max(other_diff, (grad - full).abs().max().item())
        record = {"model": name, "rank": rank, "layers": len(layers), "sharded": sharded,
                  "replayed": report.fallback_reason is None, "weight_diff": weight_diff,
                  "logit_diff": (torch.cat(gathered) - reference_logits.detach()).abs().max().item(),
                  "expert_grad_diff": expert_diff, "other_grad_diff": other_diff}
        print("RESULT " + json.dumps(record), flush=True)
    dist.destroy_process_group()


def test_expert_parallel_matches_one_process(tmp_path):
    output = Ranks([__file__, "worker"], 2, tmp_path).wait_ok()
    records = [json.loads(line[len("RESULT "):]) for line in output.splitlines() if line.startswith("RESULT ")]
    assert sorted((r["model"], r["rank"]) for r in records) == sorted((m, r) for m in MODELS for r in range(2))
    for record in records:
        print(record)
        assert record["layers"] == 2
        assert record["replayed"] and record["weight_diff"] == 0.0  # each rank's experts: the reference's rows
        assert len(record["sharded"]) == 2 * record["layers"]  # gate_up and down of every layer
        for _, local, full in record["sharded"]:
            assert local == [full[0] // 2, *full[1:]]
        assert record["logit_diff"] <= 1e-5, record
        assert record["expert_grad_diff"] <= 1e-5 and record["other_grad_diff"] <= 1e-5, record


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))  # `tests` for the builders
    _worker()
