"""`zplan export` (zplan.export.export_checkpoint) on checkpoints written by one process.

The reference is the model's own state_dict(), read back with the safetensors library (an independent
reader of the file format). The distributed case, a ZeRO-3 checkpoint of 2 processes, is in
tests/distributed/test_checkpoint.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import zplan.export as export_module
from zplan.errors import CheckpointError, ZplanError
from zplan.export import export_checkpoint
from zplan.runtime.checkpoint.save import complete_checkpoints, latest_checkpoint, load_checkpoint, save_checkpoint
from zplan.runtime.launch.distributed import close_distributed, init_distributed


class Small(nn.Module):
    """Tied weights, a bf16 parameter, integer and bool buffers, and one tensor bigger than the rest."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.scale = nn.Parameter(torch.randn(4).to(torch.bfloat16))
        self.big = nn.Linear(64, 64)  # (64, 64) fp32: 16 KiB
        self.register_buffer("counts", torch.arange(6).reshape(2, 3))
        self.register_buffer("mask", torch.tensor([True, False, True]))


@pytest.fixture
def ctx():
    """A process group of one (in-memory store: no port), as train.py has without torchrun."""
    context = init_distributed()
    yield context
    close_distributed(clean=True)


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Small()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)


def _expected(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_equal(exported: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(exported) == set(expected)
    for name, tensor in expected.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name


def test_export_writes_the_full_state_dict(ctx, tmp_path):
    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, ctx, keep=3)
    out = export_checkpoint(checkpoint, tmp_path / "out" / "model.safetensors")
    assert out == tmp_path / "out" / "model.safetensors"
    _assert_equal(load_file(out), _expected(model))  # head.weight (tied to emb.weight) included
    assert [p.name for p in out.parent.iterdir()] == ["model.safetensors"]  # no temporary file left


def test_export_holds_one_chunk_of_tensors_at_a_time(ctx, tmp_path, monkeypatch):
    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, ctx, keep=3)
    loaded_bytes_per_read: list[tuple[int, int]] = []  # (bytes read at once, largest tensor among them)
    real_load_chunk = export_module._load_chunk

    def spying_load_chunk(*args):
        chunk = real_load_chunk(*args)
        sizes = [t.numel() * t.element_size() for t in chunk.values()]
        loaded_bytes_per_read.append((sum(sizes), max(sizes)))
        return chunk

    monkeypatch.setattr(export_module, "_load_chunk", spying_load_chunk)
    limit = 256
    out = export_checkpoint(checkpoint, tmp_path / "model.safetensors", max_chunk_bytes=limit)
    _assert_equal(load_file(out), _expected(model))
    assert len(loaded_bytes_per_read) > 2
    # A read holds at most `limit` bytes of tensors, or one tensor alone when it is bigger (big.weight).
    assert all(total <= limit or total == largest for total, largest in loaded_bytes_per_read)
    assert max(total for total, _ in loaded_bytes_per_read) == 64 * 64 * 4


def test_export_of_a_folder_takes_its_newest_complete_checkpoint(ctx, tmp_path):
    model, optimizer = _model_and_optimizer()
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, model, optimizer, ctx, keep=3)
    step_1 = _expected(model)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1)
    save_checkpoint(root, 2, model, optimizer, ctx, keep=3)
    # Left by killed runs: a renamed folder without its marker, and a temporary one.
    shutil.copytree(root / "step-000002", root / "step-000005")
    (root / "step-000005" / "COMPLETE").unlink()
    shutil.copytree(root / "step-000002", root / ".step-000006.tmp")

    assert latest_checkpoint(root) == root / "step-000002"
    _assert_equal(load_file(export_checkpoint(root, tmp_path / "newest.safetensors")), _expected(model))
    _assert_equal(load_file(export_checkpoint(root / "step-000001", tmp_path / "first.safetensors")), step_1)


def test_only_the_last_k_checkpoints_are_kept(ctx, tmp_path):
    model, optimizer = _model_and_optimizer()
    for step in range(1, 5):
        save_checkpoint(tmp_path / "ckpt", step, model, optimizer, ctx, keep=2)
    assert [step for step, _ in complete_checkpoints(tmp_path / "ckpt")] == [3, 4]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-000003", "step-000004"]


@pytest.mark.parametrize(
    "case", ["missing", "empty folder", "incomplete", "temporary", "a file", "output folder", "lost shard"]
)
def test_bad_paths_are_zplan_errors(case, ctx, tmp_path):
    model, optimizer = _model_and_optimizer()
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, model, optimizer, ctx, keep=3)
    out = tmp_path / "model.safetensors"
    if case == "missing":
        ckpt, match = tmp_path / "nowhere", "does not exist"
    elif case == "empty folder":
        ckpt, match = tmp_path / "empty", "no complete checkpoint"
        ckpt.mkdir()
    elif case == "incomplete":
        (root / "step-000001" / "COMPLETE").unlink()
        ckpt, match = root / "step-000001", "incomplete"
    elif case == "temporary":
        ckpt, match = root / "step-000001", "incomplete"
        ckpt = ckpt.rename(root / ".step-000001.tmp")
    elif case == "a file":
        ckpt, match = root / "step-000001" / "train_state.json", "is a file"
    elif case == "lost shard":
        for shard in (root / "step-000001").glob("*.distcp"):
            shard.unlink()
        ckpt, match = root, r"__0_0\.distcp is missing"  # named by the manifest before DCP reads anything
    else:
        ckpt, match = root, "is a folder"
        out.mkdir()
    with pytest.raises(ZplanError, match=match):
        export_checkpoint(ckpt, out)
    assert not (out.exists() and out.is_file())
    assert not (tmp_path / ".model.safetensors.tmp").exists()


def test_unwritable_output_is_a_zplan_error(ctx, tmp_path):
    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, ctx, keep=3)
    (tmp_path / "not-a-folder").write_text("")
    with pytest.raises(ZplanError, match="cannot write"):
        export_checkpoint(checkpoint, tmp_path / "not-a-folder" / "model.safetensors")


def test_export_needs_no_process_group(ctx, tmp_path):
    """`zplan export` runs in a plain process: no torch.distributed group."""
    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, ctx, keep=3)
    close_distributed(clean=True)
    _assert_equal(load_file(export_checkpoint(Path(checkpoint), tmp_path / "m.safetensors")), _expected(model))


def test_a_checkpoint_of_another_model_does_not_load(ctx, tmp_path):
    """Not export, but the same rule: a checkpoint that does not fit is a ZplanError naming what is missing."""
    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, ctx, keep=3)
    other = Small()
    other.extra = nn.Linear(2, 2)
    with pytest.raises(ZplanError, match="extra.weight"):
        load_checkpoint(checkpoint, other, torch.optim.AdamW(other.parameters()), ctx)


class _RunsCode:
    """Unpickled, creates the file `path` (what a crafted checkpoint would do instead)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@pytest.mark.parametrize("target", [".metadata", "rank-00000.pt"])
def test_a_crafted_checkpoint_runs_nothing_on_resume_or_export(ctx, tmp_path, target):
    """DCP's metadata and the rank files are pickles; a checkpoint carrying an object that runs code when
    unpickled is refused, naming the file, and the code does not run (neither on --resume nor on zplan export)."""
    import pickle

    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, ctx, keep=3)
    payload = tmp_path / "PWNED"
    crafted = checkpoint / target
    if target == ".metadata":
        crafted.write_bytes(pickle.dumps(_RunsCode(payload)))
    else:
        torch.save({"rng": _RunsCode(payload)}, crafted)
    with pytest.raises(ZplanError, match=target.replace(".", r"\.")):
        load_checkpoint(checkpoint, model, optimizer, ctx)
    if target == ".metadata":
        with pytest.raises(ZplanError, match=r"\.metadata"):
            export_checkpoint(checkpoint, tmp_path / "model.safetensors")
    assert not payload.exists()


def _flip_bytes(path: Path, count: int = 64) -> None:
    """Flip `count` bytes in the middle of `path`, its size unchanged (a bad sector, a bit rot)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    path.write_bytes(bytes(data))


def test_a_damaged_checkpoint_is_refused_by_resume_and_export_naming_the_file(ctx, tmp_path):
    """64 flipped bytes in a shard (before the manifest they resumed with NaN losses and exported 1.6e37)."""
    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, ctx, keep=3)
    assert (checkpoint / "MANIFEST.json").is_file()
    shard = next(checkpoint.glob("*.distcp"))
    _flip_bytes(shard)
    with pytest.raises(CheckpointError, match=rf"{shard.name} does not match its checksum.*--resume latest-valid"):
        load_checkpoint(checkpoint, model, optimizer, ctx)
    with pytest.raises(CheckpointError, match=rf"{shard.name} does not match its checksum"):
        export_checkpoint(checkpoint, tmp_path / "model.safetensors")
    assert not (tmp_path / "model.safetensors").exists()


def test_latest_valid_passes_over_a_damaged_checkpoint_and_says_why(ctx, tmp_path):
    from zplan.runtime.checkpoint.save import latest_valid_checkpoint

    model, optimizer = _model_and_optimizer()
    root = tmp_path / "ckpt"
    older = save_checkpoint(root, 1, model, optimizer, ctx, keep=3)
    newer = save_checkpoint(root, 2, model, optimizer, ctx, keep=3)
    assert latest_valid_checkpoint(root) == (newer, [])
    (newer / "rank-00000.pt").write_bytes(b"cut")
    chosen, skipped = latest_valid_checkpoint(root)
    assert chosen == older and len(skipped) == 1 and "step-000002" in skipped[0] and "rank-00000.pt has 3 bytes" \
        in skipped[0]


def test_a_full_disk_keeps_the_previous_checkpoint_and_says_how_much_is_needed(ctx, tmp_path, monkeypatch):
    import errno

    import zplan.runtime.checkpoint.save as checkpoint_module

    model, optimizer = _model_and_optimizer()
    root = tmp_path / "ckpt"
    previous = save_checkpoint(root, 1, model, optimizer, ctx, keep=3)
    before = {p.name: p.read_bytes() for p in previous.iterdir()}

    def full_disk(obj, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint_module.torch, "save", full_disk)
    # the sizes in the unit that shows them (this checkpoint: KiB, not "0.00 GiB")
    with pytest.raises(CheckpointError, match=r"step-000002.*: the disk is full \([0-9.]+ [KMG]iB free, [0-9]+ KiB "
                                              r"needed\); the previous checkpoints are kept"):
        save_checkpoint(root, 2, model, optimizer, ctx, keep=3)
    monkeypatch.undo()
    assert sorted(p.name for p in root.iterdir()) == ["step-000001"]  # the partial .tmp folder removed
    assert {p.name: p.read_bytes() for p in previous.iterdir()} == before


@pytest.mark.parametrize("damage", ["rank file missing", "rank file cut", "train_state.json not JSON",
                                    "train_state.json without step"])
def test_a_damaged_checkpoint_without_a_manifest_is_one_message_naming_the_file(damage, ctx, tmp_path):
    """A checkpoint without a manifest is loaded only when asked (allow_unverified); what a resume reads from it
    still fails cleanly."""
    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, ctx, keep=3)
    (checkpoint / "MANIFEST.json").unlink()
    rank_file, state_file = checkpoint / "rank-00000.pt", checkpoint / "train_state.json"
    if damage == "rank file missing":
        rank_file.unlink()
    elif damage == "rank file cut":
        rank_file.write_bytes(rank_file.read_bytes()[:20])
    elif damage == "train_state.json not JSON":
        state_file.write_text("{not json")
    else:
        state_file.write_text('{"world_size": 1}')
    target = rank_file if damage.startswith("rank") else state_file
    with pytest.raises(CheckpointError, match=r"has no MANIFEST\.json.*--allow-unverified"):
        load_checkpoint(checkpoint, model, optimizer, ctx)
    with pytest.raises(CheckpointError, match=rf"cannot read {target}.*latest-valid"):
        load_checkpoint(checkpoint, model, optimizer, ctx, allow_unverified=True)
