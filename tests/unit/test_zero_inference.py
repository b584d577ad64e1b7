"""ZeRO-Inference weight streaming (runtime/inference/zero_inference.py) on the CPU: both tiers give back exactly the
tensors they were given (every dtype, bit for bit) over several passes, never hold more than prefetch_layers + 1
layers in device buffers, remove their files at close, detect a corrupted file at the layer that reads it; and the
inference engine generates the same greedy tokens (and logits, bit for bit) with streamed as with resident weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zplan.errors import SpecError, SwapError, ZplanError
from zplan.runtime.inference.zero_inference import StreamedWeights
from zplan.runtime.offload import nvme

CPU = torch.device("cpu")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8).clone()


def make_layers(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """n layers of mixed dtypes and shapes; layer sizes differ (the last one is larger)."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for i in range(n):
        rows = 12 if i == n - 1 else 5
        layers.append({
            "attn.weight": torch.randn(rows, 33, generator=gen),
            "mlp.qweight": torch.randint(-128, 128, (rows, 64), generator=gen, dtype=torch.int8),
            "mlp.packed": torch.randint(0, 256, (rows, 31), generator=gen, dtype=torch.uint8),
            "mlp.scales": torch.rand(rows, 2, generator=gen),
            "norm.weight": torch.randn(7, generator=gen).to(torch.bfloat16),
            "half": torch.randn(3, 3, generator=gen).to(torch.float16),
            "double": torch.randn(2, generator=gen, dtype=torch.float64),
            "ids": torch.randint(-(2**40), 2**40, (5,), generator=gen),
            "mask": torch.rand(9, generator=gen) > 0.5,
            "scalar": torch.tensor(float(i) + 0.25),
            "empty": torch.empty(0, 4),
            "transposed": torch.randn(6, 4, generator=gen).t(),  # not contiguous
            "special": torch.tensor([float("nan"), float("inf"), -0.0]),
        })
    return layers


def _inside(t: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    """t's bytes lie inside one of the device buffers (a view of a slot, not a copy elsewhere)."""
    if t.numel() == 0:
        return True
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    return any(b.data_ptr() <= lo and hi <= b.data_ptr() + b.numel() for b in buffers)


def run_passes(weights: StreamedWeights, layers: list[dict[str, torch.Tensor]], passes: int) -> None:
    bound = weights.prefetch_layers + 1
    buffers = weights.device_buffers()
    assert len(buffers) == min(bound, len(layers))
    for _ in range(passes):
        for i, expected in enumerate(layers):
            got = weights.layer(i)
            assert list(got) == list(expected)
            for name, t in expected.items():
                assert got[name].dtype == t.dtype and got[name].shape == t.shape, (i, name)
                assert got[name].device.type == weights.device.type
                assert torch.equal(_bits(got[name]), _bits(t)), (i, name)
                assert _inside(got[name], buffers), (i, name)
            resident = weights.resident_layers()
            assert i in resident and len(resident) <= bound and len(set(resident)) == len(resident)
            weights.done(i)
    assert weights.peak_resident <= bound


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("num_layers,prefetch", [(5, 1), (5, 0), (5, 2), (3, 2), (2, 4), (1, 1)])
def test_streams_back_exactly_what_it_was_given(tmp_path, tier, num_layers, prefetch):
    layers = make_layers(num_layers, seed=num_layers * 10 + prefetch)
    originals = [{k: v.clone() for k, v in layer.items()} for layer in layers]
    weights = StreamedWeights(layers, CPU, tier, str(tmp_path) if tier == "nvme" else None, prefetch)
    del layers  # the caller may drop its copies
    run_passes(weights, originals, passes=3)
    assert weights.nbytes() == sum(t.numel() * t.element_size() for layer in originals for t in layer.values())
    weights.close()


def test_nvme_files_exist_while_open_and_are_removed_at_close(tmp_path):
    layers = make_layers(3)
    with StreamedWeights(layers, CPU, "nvme", str(tmp_path), 1) as weights:
        folder = Path(weights.run_folder)
        assert folder.parent == tmp_path and folder.is_dir()
        files = [Path(weights.file_of(i)) for i in range(3)]
        assert all(f.is_file() and f.parent == folder for f in files)
        run_passes(weights, layers, passes=1)
    assert not folder.exists()
    assert list(tmp_path.iterdir()) == []
    weights.close()  # idempotent


def test_corrupted_file_is_detected_at_the_layer_that_reads_it(tmp_path):
    layers = make_layers(4)
    weights = StreamedWeights(layers, CPU, "nvme", str(tmp_path), 1)
    path = weights.file_of(2)
    data_start = weights._swap.records()[Path(path).name.split("-")[0]].header_bytes  # after the file's header
    with open(path, "r+b") as f:  # flip one bit of the first tensor's data
        f.seek(data_start + 3)
        byte = f.read(1)
        f.seek(data_start + 3)
        f.write(bytes([byte[0] ^ 0x10]))
    for i in range(2):
        assert torch.equal(weights.layer(i)["attn.weight"], layers[i]["attn.weight"])
        weights.done(i)
    with pytest.raises(SwapError, match="corrupted") as info:
        weights.layer(2)
    assert str(path) in str(info.value) and isinstance(info.value, ZplanError)
    weights.close()
    assert list(tmp_path.iterdir()) == []


def test_too_little_disk_space_is_a_clear_error(tmp_path, monkeypatch):
    layers = make_layers(2)
    real = nvme.shutil.disk_usage

    def tiny(path):
        usage = real(path)
        return type(usage)(usage.total, usage.used, 1000)

    monkeypatch.setattr(nvme.shutil, "disk_usage", tiny)
    with pytest.raises(SwapError, match="nvme_dir") as info:
        StreamedWeights(layers, CPU, "nvme", str(tmp_path), 1)
    assert "1000 bytes" in str(info.value)
    assert list(tmp_path.iterdir()) == []  # nothing was written


def test_bad_arguments_are_user_errors(tmp_path):
    layers = make_layers(2)
    with pytest.raises(SpecError, match="nvme_dir"):
        StreamedWeights(layers, CPU, "nvme", None)
    with pytest.raises(SpecError, match="tier"):
        StreamedWeights(layers, CPU, "disk", str(tmp_path))
    with pytest.raises(SpecError, match="prefetch"):
        StreamedWeights(layers, CPU, "cpu", None, prefetch_layers=-1)


def test_protocol_misuse_is_reported():
    layers = make_layers(3)
    weights = StreamedWeights(layers, CPU, "cpu", None, 1)
    with pytest.raises(RuntimeError, match="done"):
        weights.done(0)
    weights.layer(0)
    with pytest.raises(RuntimeError, match="not done"):
        weights.layer(2)  # not prefetched while layer 0 is held
    weights.done(0)
    # a jump once nothing is held restarts streaming there
    assert torch.equal(weights.layer(2)["ids"], layers[2]["ids"])
    weights.done(2)
    assert torch.equal(weights.layer(0)["ids"], layers[0]["ids"])
    weights.close()
    with pytest.raises(RuntimeError, match="closed"):
        weights.layer(0)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_pass_abandoned_midway_restarts_cleanly_at_layer_0(tmp_path, tier, prefetch):
    """An error in the engine between layer(i) and done(i) leaves layer i held; the next pass starts with layer(0)."""
    layers = make_layers(4)
    weights = StreamedWeights(layers, CPU, tier, str(tmp_path), prefetch)
    weights.layer(0)
    weights.done(0)
    weights.layer(1)  # ... and the engine raised here
    run_passes(weights, layers, passes=2)
    weights.close()


# ---- with the inference engine ----------------------------------------------------------------------------------


def _engine_pair(tier: str, tmp_path, monkeypatch, precision: str):
    from zplan.examples import gpt
    from zplan.model_input import trace_module
    from zplan.runtime.inference.engine import InferenceEngine

    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)  # the same F.linear path for both
    kwargs = dict(num_layers=2, hidden=64, heads=4, vocab_size=256, max_seq_len=64)
    with torch.device("meta"):
        meta_model = gpt.build_model(**kwargs)
    summary = trace_module(meta_model, torch.zeros(1, 8, dtype=torch.long, device="meta"), 8, "fp32")[1]
    torch.manual_seed(0)
    model = gpt.build_model(**kwargs).eval()
    common = dict(max_seq_len=64, weight_precision=precision, group_size=32)
    resident = InferenceEngine.from_model(model, summary, weight_tier="gpu", **common)
    streamed = InferenceEngine.from_model(model, summary, weight_tier=tier, nvme_dir=str(tmp_path),
                                          prefetch_layers=1, **common)
    return resident, streamed


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_engine_generates_the_same_tokens_with_streamed_weights(tier, precision, tmp_path, monkeypatch):
    resident, streamed = _engine_pair(tier, tmp_path, monkeypatch, precision)
    assert isinstance(streamed.store, StreamedWeights)
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11], [42]]
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10]])
    assert torch.equal(streamed.forward_logits(tokens), resident.forward_logits(tokens))
    expected = resident.generate(prompts, max_new_tokens=8)
    assert streamed.generate(prompts, max_new_tokens=8) == expected
    assert streamed.generate(prompts, max_new_tokens=8) == expected  # again: later passes reuse the slots
    assert streamed.weight_bytes() == resident.weight_bytes()
    assert streamed.store.peak_resident <= 2
    streamed.close()
    resident.close()
    assert list(tmp_path.iterdir()) == []
