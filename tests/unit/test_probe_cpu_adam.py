"""zplan probe's CPU Adam throughput and host-device link: measured by the functions the probe calls, written
into the profile `zplan probe` saves, and read back by --cluster. No timing is asserted: only that a
measurement is a positive finite number and lands where the planner reads it."""

import math

import pytest
import torch
from typer.testing import CliRunner

from zplan import probe
from zplan.cli import app
from zplan.planner.clusters import load_cluster
from zplan.schemas.cluster import CollectiveCost, CollectiveCosts


def test_cpu_adam_throughput_is_a_positive_finite_rate_of_the_kernel():
    rate, backend = probe.cpu_adam_params_per_s(2**20, seconds=0.05)
    assert math.isfinite(rate) and rate > 0
    assert backend == "reference" or backend.startswith("cpp-")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the link is measured (gpu tests)")
def test_without_a_gpu_the_host_device_link_is_not_measured():
    assert probe.host_device_bandwidths_Bps(2**20, seconds=0.01) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_with_a_gpu_both_directions_of_the_link_are_measured():
    h2d, d2h = probe.host_device_bandwidths_Bps(2**24, seconds=0.05)
    assert math.isfinite(h2d) and h2d > 0 and math.isfinite(d2h) and d2h > 0


def _fast_probe(monkeypatch, link):
    """Replace the slow measurements (two gloo processes, one-core GEMM curves, disk) by fixed numbers; the CPU
    Adam measurement stays real, on 1M parameters. Returns the list the measured rates are appended to."""
    cost = CollectiveCost(latency_s=1e-4, bandwidth_Bps=1e9)
    one_core = dict(fp32=1e10, half_flops=1e6, bf16=1e9, fp16=1e9, process_copy_Bps=5e9, memory_bound=0.9,
                    activation_ops=0.5, op_s=1e-5, selective_recompute_s=1e-3, full_recompute_s=1e-3)
    monkeypatch.setattr(probe, "copy_bandwidth_Bps", lambda *args, **kwargs: 1e10)
    monkeypatch.setattr(probe, "_one_core_numbers", lambda *args: one_core)
    monkeypatch.setattr(probe, "gloo_two_processes",
                        lambda seconds: (CollectiveCosts(all_reduce=cost, all_gather=cost, reduce_scatter=cost),
                                         5e-3, 2**30))
    monkeypatch.setattr(probe, "disk_bandwidths_Bps", lambda directory: (1e9, 2e9))
    monkeypatch.setattr(probe, "host_device_bandwidths_Bps", lambda num_bytes, seconds: link)
    monkeypatch.setattr(probe, "CPU_ADAM_PARAMS", 2**20)
    measured, real = [], probe.cpu_adam_params_per_s

    def recorded(num_params, seconds):
        rate, backend = real(num_params, seconds)
        measured.append(rate)
        return rate, backend

    monkeypatch.setattr(probe, "cpu_adam_params_per_s", recorded)
    return measured


def test_the_written_profile_carries_the_cpu_adam_rate_and_keeps_the_copy_rate_without_a_gpu(tmp_path, monkeypatch):
    measured = _fast_probe(monkeypatch, link=None)
    out = tmp_path / "cluster.yaml"
    result = CliRunner().invoke(app, ["probe", "--seconds", "0.3", "-o", str(out)])
    assert result.exit_code == 0, result.output
    spec = load_cluster(str(out))
    assert len(measured) == 1 and spec.cpu_adam_params_per_s == measured[0] > 0
    assert "CPU Adam: " in spec.source
    # no GPU: host-device stays the process's copy rate, and there is no separate downward rate
    assert spec.host_to_device_bandwidth_Bps == 5e9 and spec.device_to_host_bandwidth_Bps is None
    assert spec.device_to_host_Bps() == 5e9


def test_a_measured_gpu_link_replaces_the_copy_rate_in_both_directions(tmp_path, monkeypatch):
    _fast_probe(monkeypatch, link=(2.5e10, 2.0e10))
    spec = probe.probe_this_machine(0.3, str(tmp_path))
    assert (spec.host_to_device_bandwidth_Bps, spec.device_to_host_bandwidth_Bps) == (2.5e10, 2.0e10)
    assert "pinned copies to GPU 0" in spec.source
