"""checkpoints.py: each format's directory laid out by its documented rules, each with a torn variant."""

from __future__ import annotations

import json
import os
import struct
import zipfile
from pathlib import Path

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._launch import checkpoints
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.checkpoints import (
    CheckpointProblem,
    resolve,
    resume_arguments,
    step_of,
)


def saved(path: Path, payload: bytes = b"x" * 2000, large: bool = False) -> Path:
    """A zip as torch.save writes it (a data entry, a central directory last)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", allowZip64=True) as archive:
        archive.writestr("archive/data.pkl", payload)
        if large:
            archive.comment = b"c" * 100
    return path


def torn(path: Path, keep: float = 0.6) -> Path:
    """`path` cut short, as a kill during the save leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def safetensors(path: Path, tensor_bytes: int = 64) -> Path:
    header = json.dumps({"w": {"dtype": "F32", "shape": [tensor_bytes // 4], "data_offsets": [0, tensor_bytes]}}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * tensor_bytes)
    return path


def names(resolution: checkpoints.Resolution) -> list[str]:
    return [os.path.basename(entry["path"]) for entry in resolution.as_dict()["torn"]]


def test_step_of_reads_the_frameworks_names() -> None:
    assert step_of("epoch=3-step=400.ckpt") == 400
    assert step_of("global_step120") == 120
    assert step_of("checkpoint-500") == 500
    assert step_of("iter_0000100") == 100
    assert step_of("step_7") == 7
    assert step_of("last.ckpt") is None


def test_zip_checks_a_whole_and_a_torn_save(tmp_path: Path) -> None:
    for large in (False, True):
        whole = saved(tmp_path / f"w{large}.pt", large=large)
        with open(whole, "rb") as handle:
            assert checkpoints.zip_whole(handle.fileno(), whole.stat().st_size) == ""
    cut = torn(saved(tmp_path / "t.pt"), 0.95)
    with open(cut, "rb") as handle:
        assert "no zip end record" in checkpoints.zip_whole(handle.fileno(), cut.stat().st_size)
    (tmp_path / "empty.pt").write_bytes(b"")
    with open(tmp_path / "empty.pt", "rb") as handle:
        assert "shorter" in checkpoints.zip_whole(handle.fileno(), 0)


def test_torch_save_falls_back_past_torn_files(tmp_path: Path) -> None:
    for step in (100, 200, 300):
        saved(tmp_path / f"epoch=0-step={step}.ckpt")
    torn(tmp_path / "epoch=0-step=300.ckpt")
    (tmp_path / "last.ckpt").write_bytes(b"no step in the name: never chosen")
    found = resolve(str(tmp_path))
    assert found.format == "torch_save" and found.step == 200 and found.path == str(tmp_path / "epoch=0-step=200.ckpt")
    assert names(found) == ["epoch=0-step=300.ckpt"] and found.complete_steps == [200, 100]


def test_dcp_needs_its_metadata(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        directory = tmp_path / f"step_{step}"
        directory.mkdir()
        (directory / "__0_0.distcp").write_bytes(b"d" * 10)
        if step != 30:
            (directory / ".metadata").write_bytes(b"m")
    found = resolve(str(tmp_path), "dcp")
    assert (found.step, names(found)) == (20, ["step_30"])
    assert resolve(str(tmp_path)).format == "dcp"


def test_deepspeed_trusts_latest_and_the_files(tmp_path: Path) -> None:
    for step in (100, 200, 300):
        saved(tmp_path / f"global_step{step}" / "mp_rank_00_model_states.pt")
        saved(tmp_path / f"global_step{step}" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (tmp_path / "latest").write_text("global_step200")
    found = resolve(str(tmp_path))
    assert found.format == "deepspeed" and found.step == 200 and names(found) == ["global_step300"]
    # A power loss: no latest, and 0-byte files in the newest tag (diffusion-pipe #159).
    (tmp_path / "latest").unlink()
    (tmp_path / "global_step300" / "mp_rank_00_model_states.pt").write_bytes(b"")
    found = resolve(str(tmp_path), "deepspeed")
    assert found.step == 200 and any("latest" in note for note in found.notes)


def test_megatron_tracker_and_iteration_directories(tmp_path: Path) -> None:
    for step in (1000, 2000):
        saved(tmp_path / f"iter_{step:07d}" / "mp_rank_00" / "model_optim_rng.pt")
    saved(tmp_path / "iter_0003000" / "mp_rank_00" / "model_optim_rng.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2000")
    found = resolve(str(tmp_path))
    assert found.format == "megatron" and found.step == 2000 and names(found) == ["iter_0003000"]
    # The tracker written half (it is not atomic): the files decide; a torn newest falls back.
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("")
    torn(tmp_path / "iter_0003000" / "mp_rank_00" / "model_optim_rng.pt")
    found = resolve(str(tmp_path), "megatron")
    assert found.step == 2000 and names(found) == ["iter_0003000"]


def test_hf_trainer_needs_state_and_weights(tmp_path: Path) -> None:
    for step in (500, 1000, 1500, 2000):
        directory = tmp_path / f"checkpoint-{step}"
        directory.mkdir()
        (directory / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        safetensors(directory / "model.safetensors")
    (tmp_path / "checkpoint-2000" / "trainer_state.json").unlink()  # transformers #35782
    torn(tmp_path / "checkpoint-1500" / "model.safetensors", 0.9)
    (tmp_path / "checkpoint-1000" / "model.safetensors").unlink()
    saved(tmp_path / "checkpoint-1000" / "pytorch_model.bin")
    found = resolve(str(tmp_path))
    assert found.format == "hf_trainer" and found.step == 1000
    assert names(found) == ["checkpoint-2000", "checkpoint-1500"]


def test_nemo_unfinished_marker(tmp_path: Path) -> None:
    for step in (10, 20):
        directory = tmp_path / f"megatron_gpt--val_loss=1.0-step={step}-consumed_samples=80.0"
        directory.mkdir()
        (directory / "common.pt").write_bytes(b"c")
    (tmp_path / "megatron_gpt--val_loss=1.0-step=20-consumed_samples=80.0-unfinished").write_text("")
    found = resolve(str(tmp_path))
    assert found.format == "nemo" and found.step == 10 and len(found.torn) == 1


def test_marker_rule_for_a_custom_layout(tmp_path: Path) -> None:
    for step in (1, 2):
        (tmp_path / f"run-{step}").mkdir()
    (tmp_path / "run-1" / "DONE").write_text("")
    found = resolve(str(tmp_path), "marker", marker="DONE")
    assert found.step == 1 and names(found) == ["run-2"]


def test_the_ranks_step_and_nothing_complete(tmp_path: Path) -> None:
    for step in (100, 200):
        saved(tmp_path / f"model_{step}.pt")
    assert resolve(str(tmp_path), wanted_step=100).step == 100
    missing = resolve(str(tmp_path), wanted_step=150)
    assert missing.chosen is None and "150" in missing.notes[0]
    torn(tmp_path / "model_100.pt")
    torn(tmp_path / "model_200.pt")
    assert resolve(str(tmp_path)).chosen is None
    assert resolve(str(tmp_path / "nowhere")).chosen is None


def test_nothing_is_followed_and_fifos_are_never_opened(tmp_path: Path) -> None:
    elsewhere = tmp_path / "root_only"
    saved(elsewhere / "model_900.pt")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    saved(ckpt / "model_100.pt")
    os.symlink(elsewhere / "model_900.pt", ckpt / "model_900.pt")  # a link to a file the user cannot read
    os.symlink(elsewhere, ckpt / "step_800")
    os.mkfifo(ckpt / "model_700.pt")
    found = resolve(str(ckpt), "torch_save")
    assert found.step == 100
    dcp = tmp_path / "dcp"
    (dcp / "step_1").mkdir(parents=True)
    os.mkfifo(dcp / "step_1" / ".metadata")
    assert resolve(str(dcp), "dcp").chosen is None
    # A checkpoint_dir reached through a link the user could change is refused (safepath's rule).
    user_dir = tmp_path / "user"
    user_dir.mkdir(mode=0o777)
    os.chmod(user_dir, 0o777)
    os.symlink(ckpt, user_dir / "link")
    os.lchown(user_dir / "link", 65534, 65534)
    with pytest.raises(CheckpointProblem, match="symbolic link"):
        resolve(str(user_dir / "link"))


def test_torn_ones_are_renamed_aside_never_deleted(tmp_path: Path) -> None:
    saved(tmp_path / "model_1.pt")
    torn(saved(tmp_path / "model_2.pt"))
    (tmp_path / "model_2.pt.torn").write_text("an earlier one")
    found = resolve(str(tmp_path))
    assert checkpoints.rename_torn(found) == [str(tmp_path / "model_2.pt.torn.1")]
    assert (tmp_path / "model_2.pt.torn").read_text() == "an earlier one"
    assert resolve(str(tmp_path)).torn == []


def test_placeholders_are_replaced_plainly(tmp_path: Path) -> None:
    saved(tmp_path / "model_{step}_7.pt")
    found = resolve(str(tmp_path))
    assert resume_arguments(("--resume={checkpoint}", "--step", "{step}", "{other}"), found) == (
        f"--resume={tmp_path}/model_{{step}}_7.pt", "--step", "7", "{other}")
    assert resume_arguments(("{checkpoint}",), None) == ("{checkpoint}",)


def test_a_directory_too_large_to_walk_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoints, "MAX_ENTRIES", 3)
    for step in range(5):
        saved(tmp_path / f"model_{step}.pt")
    with pytest.raises(CheckpointProblem, match="bounded"):
        resolve(str(tmp_path))


def test_a_real_torch_save_whole_and_cut_at_every_tenth(tmp_path: Path) -> None:
    """PyTorch's own zip writer (a zip64 record and its locator before the end record, always)."""
    torch = pytest.importorskip("torch")
    path = tmp_path / "model_1.pt"
    torch.save({"w": torch.zeros(4096), "step": 1}, path)
    whole = path.read_bytes()
    assert resolve(str(tmp_path)).step == 1
    for tenth in range(1, 10):
        path.write_bytes(whole[: len(whole) * tenth // 10])
        assert resolve(str(tmp_path)).chosen is None, tenth
    path.write_bytes(whole[:-1])
    assert resolve(str(tmp_path)).chosen is None
