"""Checkpoints as hostile input (runtime/checkpoint/save.py, runtime/checkpoint/manifest.py, zplan/export.py).

Each case damages or crafts a checkpoint the way a careless copy, a bad disk or an attacker would, then asserts the
exception (or the exit status of `zplan export`), its message, and that nothing outside the checkpoint folder changed:
a listing of the test's folder, with each regular file's SHA-256, before and after. A target outside the checkpoint
is often a FIFO: opening it would block, so a reader that followed the name would hang (the alarm below turns a hang
into a failure) instead of passing. One process, a gloo group of one, a model of a few hundred parameters.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import pickle
import re
import resource
import shutil
import signal
import stat
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import zplan.runtime.checkpoint.save as checkpoint_module
from zplan.cli import app
from zplan.errors import CheckpointError, ZplanError
from zplan.export import export_checkpoint
from zplan.runtime.checkpoint.manifest import (
    MANIFEST_FILE,
    file_entry,
    files_to_hash,
    manifest_cap,
    verify,
    write_manifest,
)
from zplan.runtime.checkpoint.save import (
    CheckpointConfig,
    complete_checkpoints,
    latest_valid_checkpoint,
    load_checkpoint,
    read_train_state,
    save_checkpoint,
)
from zplan.runtime.launch.distributed import close_distributed, init_distributed
from zplan.runtime.training.loop import NonFiniteLossError, TrainConfig, train

HANG_LIMIT_S = 60  # a test that blocks on a FIFO fails after this


class Tiny(nn.Module):
    def __init__(self, extra: bool = False, second: bool = True):
        super().__init__()
        self.first = nn.Linear(4, 8)
        if second:
            self.second = nn.Linear(8, 4)
        if extra:
            self.extra = nn.Linear(4, 4)

    def forward(self, x):
        x = torch.tanh(self.first(x))
        return self.second(x) if hasattr(self, "second") else x


@pytest.fixture(autouse=True)
def no_hang():
    """A read that blocks (a FIFO opened for reading) fails the test instead of hanging the suite."""

    def hung(signum, frame):
        raise AssertionError(f"blocked for {HANG_LIMIT_S} s: something opened a FIFO")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(HANG_LIMIT_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def ctx():
    context = init_distributed()
    yield context
    close_distributed(clean=True)


def _model_and_optimizer(**kwargs) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tiny(**kwargs)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)


def listing(root: Path, leave_out: Path | None = None) -> dict[str, str]:
    """Every entry under `root` (links not followed, FIFOs not opened), but `leave_out` and what is in it: its kind,
    a regular file's SHA-256, a link's target."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            if leave_out is not None and (path == leave_out or leave_out in path.parents):
                continue
            mode = os.lstat(path).st_mode
            if stat.S_ISREG(mode):
                digest = hashlib.sha256()
                with open(path, "rb") as f:
                    while chunk := f.read(16 << 20):
                        digest.update(chunk)
                found[str(path.relative_to(root))] = digest.hexdigest()
            elif stat.S_ISLNK(mode):
                found[str(path.relative_to(root))] = "link to " + os.readlink(path)
            else:
                found[str(path.relative_to(root))] = f"kind {stat.S_IFMT(mode)}"
    return found


def flip_bytes(path: Path, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
    path.write_bytes(bytes(data))


def reseal(folder: Path) -> None:
    """Rewrite MANIFEST.json to match the folder's regular files, as someone who edits a checkpoint can."""
    write_manifest(folder, {name: file_entry(folder / name) for name in files_to_hash(folder)})


def shard(folder: Path) -> Path:
    return next(folder.glob("*.distcp"))


def export_cli(checkpoint: Path, out: Path, *flags: str):
    return CliRunner().invoke(app, ["export", str(checkpoint), "--to", str(out), *flags])


def assert_refused_everywhere(checkpoint: Path, tmp_path: Path, ctx, match: str, *, allow_unverified: bool = False):
    """Resume and export (the function and `zplan export`) refuse `checkpoint` with a message matching `match`,
    nothing in tmp_path changes and no weights file appears."""
    before = listing(tmp_path)
    model, optimizer = _model_and_optimizer()
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(checkpoint, model, optimizer, ctx, allow_unverified=allow_unverified)
    out = tmp_path / "out" / "model.safetensors"
    with pytest.raises(CheckpointError, match=match):
        export_checkpoint(checkpoint, out, allow_unverified=allow_unverified)
    result = export_cli(checkpoint, out, *(["--allow-unverified"] if allow_unverified else []))
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert not out.exists() and listing(tmp_path) == before


# ---- a damaged checkpoint is never loaded silently --------------------------------------------------------------


def test_latest_valid_never_takes_a_checkpoint_without_a_manifest(ctx, tmp_path):
    """The reproduction: MANIFEST.json removed and 64 bytes of the shard flipped; latest-valid took it, unverified."""
    model, optimizer = _model_and_optimizer()
    root = tmp_path / "ckpt"
    older = save_checkpoint(root, 2, model, optimizer, ctx, keep=3)
    newer = save_checkpoint(root, 4, model, optimizer, ctx, keep=3)
    (newer / MANIFEST_FILE).unlink()
    flip_bytes(shard(newer))
    before = listing(tmp_path)
    chosen, skipped = latest_valid_checkpoint(root)
    assert chosen == older
    assert len(skipped) == 1 and skipped[0].startswith("step-000004: ") and "has no MANIFEST.json" in skipped[0]
    assert listing(tmp_path) == before
    (older / MANIFEST_FILE).unlink()  # no verified checkpoint left: none is taken
    assert latest_valid_checkpoint(root)[0] is None


def test_an_unverified_checkpoint_is_resumed_and_exported_only_with_the_flag(ctx, tmp_path, capsys):
    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, ctx, keep=3)
    (checkpoint / MANIFEST_FILE).unlink()
    assert_refused_everywhere(checkpoint, tmp_path, ctx, r"has no MANIFEST\.json.*--allow-unverified")

    loaded = load_checkpoint(checkpoint, *_model_and_optimizer(), ctx, allow_unverified=True)
    assert loaded.step == 1 and loaded.unverified_origin == "step-000001 has no MANIFEST.json"
    assert "loaded without verifying it (--allow-unverified)" in capsys.readouterr().out
    result = export_cli(checkpoint, tmp_path / "m.safetensors", "--allow-unverified")
    assert result.exit_code == 0 and "exported without verifying it" in result.output, result.output
    assert (tmp_path / "m.safetensors").is_file()


@pytest.mark.parametrize("case", ["a file left out", "a file added", "an entry without its file"])
def test_a_manifest_covers_exactly_the_checkpoint_files(case, ctx, tmp_path):
    """A manifest that leaves a (damaged) file out let it through: every file must be listed, every entry present."""
    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, ctx, keep=3)
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    if case == "a file left out":
        flip_bytes(shard(checkpoint))
        del manifest["files"][shard(checkpoint).name]
        match = rf"{shard(checkpoint).name} is not in MANIFEST\.json"
    elif case == "a file added":
        (checkpoint / "notes.txt").write_text("added later\n")
        match = r"notes\.txt is not in MANIFEST\.json"
    else:
        manifest["files"]["__7_0.distcp"] = {"bytes": 10, "xxh3_64": "0" * 16}
        match = r"__7_0\.distcp is missing \(listed in MANIFEST\.json\)"
    (checkpoint / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert_refused_everywhere(checkpoint, tmp_path, ctx, match)
    assert latest_valid_checkpoint(tmp_path / "ckpt")[0] is None


# ---- nothing outside the checkpoint is read, hashed or deleted ------------------------------------------------


@pytest.fixture
def outside(tmp_path) -> dict[str, Path]:
    """Targets outside the checkpoint: a regular file of a known size, and a FIFO that blocks whoever opens it."""
    secret = tmp_path / "secret.distcp"
    secret.write_bytes(b"s" * 12345)
    fifo = tmp_path / "fifo.distcp"
    os.mkfifo(fifo)
    return {"secret": secret, "fifo": fifo}


def _point_metadata_at(checkpoint: Path, relative_path: str) -> None:
    """Rewrite .metadata (a pickle written by DCP, read back here with pickle: this test wrote it) so that every item
    of its first data file is read from `relative_path`; then the manifest, as an attacker would."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())
    first = sorted({info.relative_path for info in metadata.storage_data.values()})[0]
    for index, info in list(metadata.storage_data.items()):
        if info.relative_path == first:
            metadata.storage_data[index] = _StorageInfo(relative_path=relative_path, offset=info.offset,
                                                        length=info.length)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(checkpoint)


@pytest.mark.parametrize("target", ["../secret.distcp", "../fifo.distcp", "absolute secret", "absolute fifo",
                                    "sub/x.distcp", "train_state.json"])
def test_metadata_cannot_point_a_tensor_outside_the_checkpoint(target, ctx, tmp_path, outside):
    """DCP's .metadata names the file of each item (relative_path); resume and export read any path it named."""
    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, ctx, keep=3)
    relative = str(outside[target.split()[1]]) if target.startswith("absolute") else target
    _point_metadata_at(checkpoint, relative)
    assert verify(checkpoint) == []  # resealed: the manifest cannot catch it, the metadata check must
    if target == "train_state.json":
        match = r"\.metadata points tensors at 'train_state\.json', not a DCP data file"
    else:
        match = rf"\.metadata names '{relative}', not a file name of .*refused"
    assert_refused_everywhere(checkpoint, tmp_path, ctx, match)


@pytest.mark.parametrize("with_manifest", [True, False])
def test_a_shard_that_is_a_link_out_of_the_checkpoint_is_not_followed(with_manifest, ctx, tmp_path, outside):
    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, ctx, keep=3)
    data = shard(checkpoint)
    data.unlink()
    data.symlink_to(outside["fifo"])
    if not with_manifest:
        (checkpoint / MANIFEST_FILE).unlink()
    match = rf"{data.name} is a symbolic link, not a regular file"
    assert_refused_everywhere(checkpoint, tmp_path, ctx, match, allow_unverified=not with_manifest)


@pytest.mark.parametrize("name", ["../../secret.distcp", "absolute secret", "absolute fifo", "sub/x", "COMPLETE"])
def test_manifest_entries_outside_the_checkpoint_are_refused_unopened(name, ctx, tmp_path, outside):
    """Entries such as ../../etc/passwd or /etc/shadow were opened and hashed, and the message gave their sizes."""
    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, ctx, keep=3)
    entry = str(outside[name.split()[1]]) if name.startswith("absolute") else name
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    manifest["files"][entry] = {"bytes": 1, "xxh3_64": "0" * 16}
    (checkpoint / MANIFEST_FILE).write_text(json.dumps(manifest))
    match = "which it cannot cover" if name == "COMPLETE" else r"MANIFEST\.json names .*not a file name of .*refused"
    assert_refused_everywhere(checkpoint, tmp_path, ctx, match)
    problems = verify(checkpoint)
    assert len(problems) == 1 and "12345" not in problems[0] and "12,345" not in problems[0]  # no size of it


def test_retention_never_deletes_through_a_link(ctx, tmp_path):
    """A step-N or .tmp folder that is a link to a folder elsewhere: the link may go, what it points to stays."""
    model, optimizer = _model_and_optimizer()
    root = tmp_path / "ckpt"
    elsewhere = tmp_path / "elsewhere"
    save_checkpoint(tmp_path / "source", 1, model, optimizer, ctx, keep=3)
    shutil.copytree(tmp_path / "source" / "step-000001", elsewhere)
    root.mkdir()
    (root / "step-000001").symlink_to(elsewhere)
    (root / ".step-000003.tmp").symlink_to(elsewhere)
    before = listing(tmp_path, leave_out=root)
    save_checkpoint(root, 2, model, optimizer, ctx, keep=1)
    save_checkpoint(root, 3, model, optimizer, ctx, keep=1)
    assert listing(tmp_path, leave_out=root) == before
    assert sorted(p.name for p in root.iterdir()) == ["step-000001", "step-000003"]  # the link kept, never followed


# ---- special files: links to devices, FIFOs, files far over any real size ----------------------------------------


def _special(path: Path, kind: str) -> None:
    path.unlink(missing_ok=True)
    if kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "character device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
        except PermissionError:
            pytest.skip("creating a device node needs CAP_MKNOD")
    else:  # a regular file far over the cap, sparse: reading it to the end would take its whole size in memory
        with open(path, "wb") as f:
            f.truncate(1 << 30)


KIND_MESSAGE = {"link to /dev/zero": "is a symbolic link, not a regular file", "FIFO": "is a FIFO, not a regular file",
                "character device": "is a character device, not a regular file", "1 GiB": "is over [0-9,]+ bytes"}


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


@pytest.mark.parametrize("kind", list(KIND_MESSAGE))
def test_a_special_or_huge_manifest_is_refused_by_kind_without_reading_it(kind, ctx, tmp_path):
    """MANIFEST.json linked to /dev/zero took `zplan export` to 23.7 GB of memory; a FIFO hung it."""
    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, ctx, keep=3)
    _special(checkpoint / MANIFEST_FILE, kind)
    peak = _peak_rss_bytes()
    assert_refused_everywhere(checkpoint, tmp_path, ctx, rf"MANIFEST\.json {KIND_MESSAGE[kind]}")
    # the 1 GiB file: at most the cap was read (a few MiB for this folder), not the file
    assert manifest_cap(checkpoint) <= 5 << 20 and _peak_rss_bytes() - peak < 512 << 20


@pytest.mark.parametrize("kind, name", [
    *((kind, name) for kind in ("link to /dev/zero", "FIFO", "character device")
      for name in ("train_state.json", "rank-00000.pt", "shard")),
    ("1 GiB", "train_state.json"),  # the one file read whole
])
def test_special_files_among_an_unverified_checkpoint_are_refused_by_kind(kind, name, ctx, tmp_path):
    """Without a manifest (--allow-unverified) nothing says what the files should be: each must still be a regular
    file, and train_state.json (read whole) small."""
    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, ctx, keep=3)
    (checkpoint / MANIFEST_FILE).unlink()
    path = shard(checkpoint) if name == "shard" else checkpoint / name
    _special(path, kind)
    peak = _peak_rss_bytes()
    assert_refused_everywhere(checkpoint, tmp_path, ctx, rf"{path.name} {KIND_MESSAGE[kind]}", allow_unverified=True)
    assert _peak_rss_bytes() - peak < 512 << 20


@pytest.mark.parametrize("kind", ["link to /dev/zero", "FIFO"])
def test_the_readers_refuse_special_files_by_themselves(kind, ctx, tmp_path, outside):
    """Past the listing (a file swapped after the check): DCP's reader and the rank-file reader open regular files
    only, a link not followed, a FIFO not waited on."""
    from zplan.runtime.checkpoint.save import SafeFileSystemReader, load_rank_state

    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, ctx, keep=3)
    data, rank_file = shard(checkpoint), checkpoint / "rank-00000.pt"
    _special(data, kind)
    _special(rank_file, kind)
    with pytest.raises(CheckpointError, match=rf"{data.name} {KIND_MESSAGE[kind]}"):
        SafeFileSystemReader(checkpoint).read_metadata()
    with pytest.raises(CheckpointError, match=rf"cannot read {rank_file}.*{KIND_MESSAGE[kind]}"):
        load_rank_state(rank_file)
    _special(checkpoint / ".metadata", kind)
    with pytest.raises(CheckpointError, match=rf"\.metadata {KIND_MESSAGE[kind]}"):
        SafeFileSystemReader(checkpoint).read_metadata()


def test_an_unverified_checkpoint_without_its_metadata_is_one_message(ctx, tmp_path):
    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, ctx, keep=3)
    (checkpoint / MANIFEST_FILE).unlink()
    (checkpoint / ".metadata").unlink()
    assert_refused_everywhere(checkpoint, tmp_path, ctx, r"cannot read .*\.metadata \(FileNotFoundError",
                              allow_unverified=True)


def test_a_fifo_in_place_of_a_shard_is_refused_with_a_manifest_too(ctx, tmp_path):
    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, ctx, keep=3)
    data = shard(checkpoint)
    _special(data, "FIFO")
    assert_refused_everywhere(checkpoint, tmp_path, ctx, rf"{data.name} is a FIFO, not a regular file")
    assert latest_valid_checkpoint(tmp_path / "ckpt")[0] is None


# ---- the model's tensors, exactly; a plausible train state ------------------------------------------------------


@pytest.mark.parametrize("other", ["more tensors", "fewer tensors"])
def test_a_checkpoint_of_another_model_lists_missing_and_unexpected_tensors(other, ctx, tmp_path):
    """A checkpoint with tensors the model lacks loaded without a word (DCP ignores them)."""
    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, ctx, keep=3)
    if other == "more tensors":
        other_model, other_optimizer = _model_and_optimizer(extra=True)
        match = r"missing 2 of the model's tensors \(extra\.bias, extra\.weight\)"
    else:
        other_model, other_optimizer = _model_and_optimizer(second=False)
        match = r"2 unexpected \(second\.bias, second\.weight\)"
    before = listing(tmp_path)
    weights = {k: v.clone() for k, v in other_model.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"does not hold this model's tensors: {match}.*another model"):
        load_checkpoint(checkpoint, other_model, other_optimizer, ctx)
    assert all(torch.equal(v, weights[k]) for k, v in other_model.state_dict().items())  # nothing loaded
    assert listing(tmp_path) == before


@pytest.mark.parametrize("state, why", [
    ({"step": -1}, "no integer 'step' >= 0"), ({"step": "1"}, "no integer 'step'"), ({"step": True}, "no integer"),
    ({"step": 7}, "step 7 in the folder of step 1"), ({"world_size": 0}, r"no integer .* \(step 1, world_size 0\)"),
    ({"loss": "NaN"}, "it holds NaN"), ({"loss": "Infinity"}, "it holds Infinity"),
    ({"loss": "1e999"}, "1e999 is out of range"), ({"fused_layouts": []}, "'fused_layouts' is"),
    ({"unverified_origin": 3}, "'unverified_origin' is 3"),
])
def test_an_implausible_train_state_is_refused_before_loading(state, why, ctx, tmp_path):
    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, optimizer, ctx, keep=3)
    text = json.dumps({**read_train_state(checkpoint), **state})
    for literal in ("NaN", "Infinity", "1e999"):  # JSON's spelling of what json.dumps would quote
        text = text.replace(f'"{literal}"', literal)
    (checkpoint / "train_state.json").write_text(text)
    reseal(checkpoint)  # as written: the manifest is fine, the values are not
    assert_refused_everywhere(checkpoint, tmp_path, ctx, rf"cannot read .*train_state\.json \({why}")


def test_a_checkpoint_past_the_run_is_refused_before_loading(ctx, tmp_path):
    model, optimizer = _model_and_optimizer()
    checkpoint = save_checkpoint(tmp_path / "ckpt", 5, model, optimizer, ctx, keep=3)
    other, other_optimizer = _model_and_optimizer()
    with torch.no_grad():
        other.first.weight.add_(1)
    weights = other.first.weight.clone()
    with pytest.raises(CheckpointError, match=r"is at step 5, beyond --steps 4"):
        load_checkpoint(checkpoint, other, other_optimizer, ctx, total_steps=4)
    assert torch.equal(other.first.weight, weights)


# ---- a NaN loss stops the run; retention keeps the newest verified checkpoint ------------------------------------


def _data():
    """Batches of 4 samples, the same for each index in every run (a resumed run replays them)."""
    index = 0
    while True:
        yield torch.randn(4, 4, generator=torch.Generator().manual_seed(index))
        index += 1


def _train(ctx, root: Path, steps: int, *, every: int = 1, keep: int = 3, resume=None, allow_unverified=False,
           allow_nonfinite_loss=False, nan_at_step: int | None = None) -> list[float]:
    """train() on Tiny for `steps` steps, checkpoints in `root`; the loss is NaN at step `nan_at_step` (1-based)."""
    model, optimizer = _model_and_optimizer()
    calls = []

    def loss_fn(output, batch):
        calls.append(1)
        loss = (output - batch).pow(2).mean()
        return loss * math.nan if len(calls) == nan_at_step else loss

    config = TrainConfig(steps=steps, micro_batch=4, num_micro_batches=1, seq_len=1, data_parallel_size=1,
                         grad_clip=1.0, lr_schedule=lambda step: 1e-2, allow_nonfinite_loss=allow_nonfinite_loss,
                         checkpoint=CheckpointConfig(directory=root, every=every, keep=keep, resume=resume,
                                                     allow_unverified=allow_unverified))
    return train(model, optimizer, _data(), loss_fn, config, ctx)


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != ".zplan-run.lock")


def test_a_nan_loss_stops_the_run_and_keeps_the_last_checkpoint(ctx, tmp_path):
    root = tmp_path / "ckpt"
    with pytest.raises(NonFiniteLossError, match=rf"the loss of step 3 is nan .*training stopped before saving that "
                                                 rf"state; the last checkpoint, {root / 'step-000002'}, was not "
                                                 r"overwritten.*--allow-nonfinite-loss") as raised:
        _train(ctx, root, 5, nan_at_step=3)
    assert isinstance(raised.value, ZplanError)  # train.py: one message, exit status 2
    assert _names(root) == ["step-000001", "step-000002"]  # no .tmp, no step-000003
    assert all(math.isfinite(read_train_state(path)["loss"]) for _, path in complete_checkpoints(root))


def test_allow_nonfinite_loss_goes_on_but_never_saves_a_nan_state(ctx, tmp_path, capsys):
    root = tmp_path / "ckpt"
    losses = _train(ctx, root, 4, nan_at_step=3, allow_nonfinite_loss=True, keep=5)
    assert all(math.isfinite(loss) for loss in losses[:2]) and not any(math.isfinite(loss) for loss in losses[2:])
    assert _names(root) == ["step-000001", "step-000002"]  # steps 3 and 4: NaN weights, not saved
    assert "the loss of step 3 is nan (--allow-nonfinite-loss: going on)" in capsys.readouterr().out


def test_retention_keeps_the_newest_verified_checkpoint_after_an_unverified_resume(ctx, tmp_path):
    """The reproduction's end: the states of an unverified checkpoint saved under fresh manifests, and --keep 2
    pruned the last good checkpoint. A run resumed with --allow-unverified marks its checkpoints, and retention keeps
    the newest verified one however many of those come after it."""
    root = tmp_path / "ckpt"
    _train(ctx, root, 4, every=2)
    (root / "step-000004" / MANIFEST_FILE).unlink()
    good = (root / "step-000002" / MANIFEST_FILE).read_bytes()

    _train(ctx, root, 10, every=2, keep=2, resume=root / "step-000004", allow_unverified=True)
    assert _names(root) == ["step-000002", "step-000008", "step-000010"]
    assert (root / "step-000002" / MANIFEST_FILE).read_bytes() == good and verify(root / "step-000002") == []
    assert read_train_state(root / "step-000010")["unverified_origin"] == "step-000004 has no MANIFEST.json"

    # latest-valid passes over the unverified step 4 to step 2 on a fresh folder of the same checkpoints
    fresh = tmp_path / "fresh"
    _train(ctx, fresh, 4, every=2)
    (fresh / "step-000004" / MANIFEST_FILE).unlink()
    flip_bytes(shard(fresh / "step-000004"))
    losses = _train(ctx, fresh, 6, every=2, keep=2, resume="latest-valid")
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)  # from step 2: steps 3 to 6
    assert _names(fresh) == ["step-000004", "step-000006"] and verify(fresh / "step-000004") == []
    assert read_train_state(fresh / "step-000006")["unverified_origin"] is None


# ---- a full disk ----------------------------------------------------------------------------------------------


def _full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _bytes(size: str) -> float:
    """'157 KiB' -> 160768.0"""
    number, unit = size.split()
    return float(number) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    tensors = list(model.state_dict().values()) + [v for s in optimizer.state.values() for v in s.values()
                                                   if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("stage", ["shards", "manifest", "COMPLETE"])
def test_a_full_disk_is_one_message_with_the_numbers_and_leaves_nothing_behind(stage, ctx, tmp_path, monkeypatch):
    """A full disk at MANIFEST.json was a traceback and a .tmp folder left holding the disk; the size it needed read
    "0.00 GiB"."""
    model, optimizer = _model_and_optimizer()
    root = tmp_path / "ckpt"
    previous = save_checkpoint(root, 1, model, optimizer, ctx, keep=3)
    before = listing(tmp_path)
    if stage == "shards":
        monkeypatch.setattr(checkpoint_module.dcp, "save", _full_disk)
    elif stage == "manifest":
        monkeypatch.setattr(checkpoint_module, "write_manifest", _full_disk)
    else:
        real = checkpoint_module._write_text
        monkeypatch.setattr(checkpoint_module, "_write_text",
                            lambda path, text: _full_disk() if path.name == "COMPLETE" else real(path, text))
    with pytest.raises(CheckpointError) as raised:
        save_checkpoint(root, 2, model, optimizer, ctx, keep=3)
    message = str(raised.value)
    assert message.startswith(f"cannot write checkpoint step-000002 into {root} (rank 0: ")
    numbers = re.search(rf"{root / 'step-000002'}: the disk is full \(([0-9.]+ [KMG]iB) free, ([0-9.]+ [KMG]iB) "
                        r"needed\); the previous checkpoints are kept and the partial one removed", message)
    assert numbers, message
    free, needed = (_bytes(number) for number in numbers.groups())
    assert needed >= 0.99 * _state_bytes(model, optimizer) > 0 and not re.search(r"(?<![0-9.])0\.00 [KMG]iB", message)
    assert abs(free - shutil.disk_usage(root).free) < 1 << 30  # this disk's free bytes (others write on it too)
    assert listing(tmp_path) == before  # the .tmp folder removed, step-000001 as it was
    assert _names(root) == [previous.name]


def test_a_rank_file_write_that_fails_as_torch_reports_it_is_one_message(ctx, tmp_path, monkeypatch):
    """torch.save reports a failed write (a full disk among them) as a RuntimeError, which went uncaught."""
    model, optimizer = _model_and_optimizer()
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, model, optimizer, ctx, keep=3)
    before = listing(tmp_path)

    real_save = torch.save

    def failing_save(obj, path, *args, **kwargs):  # the rank file's write fails; DCP's (into memory) do not
        if isinstance(path, Path) and path.name == "rank-00000.pt":
            raise RuntimeError("[enforce fail at inline_container.cc] . PytorchStreamWriter failed writing file data/0")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_module.torch, "save", failing_save)
    with pytest.raises(CheckpointError, match=rf"cannot write checkpoint step-000002 into {root} \(rank 0: "
                                              r"RuntimeError: .*PytorchStreamWriter failed writing file data/0\)$"):
        save_checkpoint(root, 2, model, optimizer, ctx, keep=3)
    assert listing(tmp_path) == before


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (root only; skipped elsewhere): a disk that really fills."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield disk
    subprocess.run(["umount", str(disk)], check=False, capture_output=True, timeout=30)


def test_a_disk_that_really_fills_keeps_the_previous_checkpoint(ctx, small_disk):
    model, optimizer = _model_and_optimizer()
    root = small_disk / "ckpt"
    previous = save_checkpoint(root, 1, model, optimizer, ctx, keep=3)
    room = 4 << 10  # one page: less than a checkpoint
    (small_disk / "filler").write_bytes(b"f" * (shutil.disk_usage(small_disk).free - room))
    before = listing(small_disk)
    with pytest.raises(CheckpointError, match=r"step-000002: the disk is full \([0-9]+ KiB free, [0-9]+ KiB needed\); "
                                              r"the previous checkpoints are kept"):
        save_checkpoint(root, 2, model, optimizer, ctx, keep=3)
    assert listing(small_disk) == before and _names(root) == [previous.name]
    (small_disk / "filler").unlink()  # room again: the next save works
    assert save_checkpoint(root, 2, model, optimizer, ctx, keep=3).name == "step-000002"
