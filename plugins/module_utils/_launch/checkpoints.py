# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""The newest complete checkpoint in a job's checkpoint directory, by each framework's own word.

A crash or a ``kill -9`` during a save leaves a torn checkpoint, and the newest name is then the worst
choice. Each framework marks a complete one its own way, and that mark is what is read here:

* ``dcp`` (torch.distributed.checkpoint): a step directory is complete when its ``.metadata`` is there
  (the coordinator writes it last, to a temporary name renamed into place).
* ``torch_save`` (Lightning, plain ``torch.save``): a file is a zip whose central directory is written
  last; it is complete when its end-of-central-directory record is there and points at a central
  directory that ends where that record begins (two bounded reads, never the whole file).
* ``deepspeed``: ``latest`` names the tag after the commit; tags newer than it are torn, and the
  tag's ``*.pt`` files must be whole zips (a power loss has left ``latest`` missing and 0-byte files).
* ``megatron``: ``latest_checkpointed_iteration.txt`` names the iteration (not written atomically:
  unreadable, it is ignored and the ``iter_N`` directories are judged by their files alone).
* ``hf_trainer``: ``checkpoint-N`` needs ``trainer_state.json`` and its weights (transformers #35580),
  safetensors judged by their header, ``.bin`` files as zips.
* ``nemo``: NeMo writes ``NAME-unfinished`` before a save and removes it after.
* ``marker``: a custom layout: a numbered directory is complete when it holds the marker file.
* ``auto``: the layout is recognised by those marks.

Safe to read as root: the directory belongs to the job's user. It is reached as every path is
(_base/safepath.walk, a symlink followed only where only root can change it); inside it, nothing is
followed: an entry that is a symlink is never a checkpoint, files are opened with ``O_NOFOLLOW |
O_NONBLOCK`` and must be regular (no FIFO, no file with other hard links), every read is bounded and
every listing too. The job gets the path as text. Names that are not plain printable text are skipped.

Standard library only: the live file's monitor runs from a private copy (see supervisor.private_copies).
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
import time

if not __package__:
    import safepath  # pylint: disable=import-error
else:
    from ansible_collections.gpuops.relaunch.plugins.module_utils._base import safepath

FORMATS = ("auto", "dcp", "torch_save", "deepspeed", "megatron", "hf_trainer", "nemo", "marker")
MISSING_CHOICES = ("fresh", "refuse")
# Bounds: the entries of one directory looked at, the newest complete checkpoints reported (the ranks'
# joint decision intersects them), a marker file's size, a safetensors header's size.
MAX_ENTRIES = 20000
MAX_COMPLETE_LISTED = 32
MARKER_READ_LIMIT = 4096
JSON_READ_LIMIT = 16 * 1024 * 1024
ZIP_TAIL = 22 + 65535 + 20
TORN_SUFFIX = ".torn"
DEEPSPEED_LATEST = "latest"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
NEMO_UNFINISHED = "-unfinished"
DCP_METADATA = ".metadata"
SAVE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".tar")
HF_STATE = "trainer_state.json"
HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json",
              "adapter_model.safetensors", "adapter_model.bin")
_STEP_WORD = re.compile(r"(?:^|[^a-z])(?:global_)?step[=_-]?(\d+)", re.IGNORECASE)
_LAST_NUMBER = re.compile(r"(\d+)(?!.*\d)")
_PLACEHOLDER = re.compile(r"\{checkpoint\}|\{step\}")
_PLAIN_NAME = re.compile(r"^[\x20-\x7e]{1,255}$")


class CheckpointProblem(OSError):
    """The checkpoint directory cannot be judged (unreachable, unsafe, too large); str() says why."""

    def __str__(self) -> str:
        return str(self.strerror)


class Found:
    """One checkpoint: its name in the directory, its step, and whether it is complete (else why not)."""

    def __init__(self, name: str, step: int, complete: bool, why: str = "") -> None:
        self.name = name
        self.step = step
        self.complete = complete
        self.why = why

    def as_dict(self, directory: str) -> dict:
        entry = {"path": os.path.join(directory, self.name), "step": self.step}
        if not self.complete:
            entry["why"] = self.why
        return entry


class Resolution:
    """What the resolver found: the format, the chosen checkpoint, the torn ones newer than it."""

    def __init__(self, directory: str, fmt: str, chosen: Found | None, torn: list, complete_steps: list,
                 notes: list, seconds: float) -> None:
        self.directory = directory
        self.format = fmt
        self.chosen = chosen
        self.torn = torn
        self.complete_steps = complete_steps
        self.notes = notes
        self.seconds = seconds
        self.renamed: list = []

    @property
    def path(self) -> str | None:
        return os.path.join(self.directory, self.chosen.name) if self.chosen is not None else None

    @property
    def step(self) -> int | None:
        return self.chosen.step if self.chosen is not None else None

    def as_dict(self) -> dict:
        return {"dir": self.directory, "format": self.format, "path": self.path, "step": self.step,
                "torn_skipped": len(self.torn),
                "torn": [found.as_dict(self.directory) for found in self.torn[:MAX_COMPLETE_LISTED]],
                "renamed": list(self.renamed), "complete_steps": list(self.complete_steps), "notes": list(self.notes),
                "seconds": round(self.seconds, 4)}


def step_of(name: str) -> int | None:
    """The step a checkpoint's name carries: ``step=N``, ``step_N``, ``global_stepN``, else its last number."""
    match = _STEP_WORD.search(name) or _LAST_NUMBER.search(name)
    return int(match.group(1)) if match else None


# --- bounded reads inside the directory ---------------------------------------------------------


def _open_file(dir_fd: int, name: str) -> int:
    return safepath.open_regular_at(dir_fd, name, os.O_RDONLY)


def _read_small(dir_fd: int, name: str, limit: int = MARKER_READ_LIMIT) -> bytes | None:
    """A small file's bytes (at most `limit`), or None if it is not a readable regular file of its own."""
    try:
        fd = _open_file(dir_fd, name)
    except OSError:
        return None
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


def _regular_size(dir_fd: int, name: str) -> int | None:
    """The size of a regular file `name` (never a link), or None."""
    info = safepath.lstat_at(dir_fd, name)
    return info.st_size if info is not None and stat.S_ISREG(info.st_mode) else None


def zip_whole(fd: int, size: int) -> str:
    """'' if the file behind `fd` is a whole zip (torch.save's format), else why not.

    The end-of-central-directory record is the last thing a zip writer writes: it is looked for in
    the file's last 64 KiB, and the central directory it points at must end where it (or the zip64
    record) begins and start with a central directory header. Reads are bounded.
    """
    if size < 22:
        return "shorter than a zip's end record (%d bytes)" % size
    tail_start = max(0, size - ZIP_TAIL)
    tail = os.pread(fd, size - tail_start, tail_start)
    if os.pread(fd, 4, 0) != b"PK\x03\x04":
        return "not a zip (torch.save writes zips since PyTorch 1.6)"
    at = tail.rfind(b"PK\x05\x06")
    while at >= 0:
        if at + 22 <= len(tail) and at + 22 + struct.unpack_from("<H", tail, at + 20)[0] == len(tail):
            break
        at = tail.rfind(b"PK\x05\x06", 0, at)
    if at < 0:
        return "no zip end record: the save did not finish"
    cd_size, cd_offset = struct.unpack_from("<II", tail, at + 12)
    end = tail_start + at
    locator = at - 20
    zip64 = locator >= 0 and tail[locator:locator + 4] == b"PK\x06\x07"
    if cd_offset == 0xFFFFFFFF or cd_size == 0xFFFFFFFF or zip64:
        # PyTorch's writer always adds the zip64 record (and its locator) between the central directory and the end record.
        if not zip64:
            return "a zip64 end record without its locator"
        end = struct.unpack_from("<Q", tail, locator + 8)[0]
        record = os.pread(fd, 56, end)
        if len(record) < 56 or record[:4] != b"PK\x06\x06":
            return "a zip64 end record that is not there"
        cd_size, cd_offset = struct.unpack_from("<QQ", record, 40)
    if cd_offset + cd_size != end:
        return "the zip's central directory does not end where its end record begins"
    if cd_size and os.pread(fd, 4, cd_offset) != b"PK\x01\x02":
        return "no central directory where the zip's end record says"
    return ""


def _zip_file_whole(dir_fd: int, name: str) -> str:
    try:
        fd = _open_file(dir_fd, name)
    except OSError as exc:
        return "%s: %s" % (name, exc.strerror or exc)
    try:
        why = zip_whole(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return "%s: %s" % (name, why) if why else ""


def _safetensors_whole(dir_fd: int, name: str) -> str:
    """'' if a safetensors file holds its whole header and every tensor the header places."""
    try:
        fd = _open_file(dir_fd, name)
    except OSError as exc:
        return "%s: %s" % (name, exc.strerror or exc)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            return "%s: shorter than its header length" % name
        length = struct.unpack("<Q", head)[0]
        if 8 + length > size:
            return "%s: shorter than its header" % name
        if length > JSON_READ_LIMIT:
            return ""  # a header this large is not read; its length fits the file
        try:
            header = json.loads(os.pread(fd, length, 8))
            ends = [int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "%s: its header is not whole" % name
        if 8 + length + max(ends, default=0) > size:
            return "%s: shorter than the tensors its header places" % name
        return ""
    finally:
        os.close(fd)


class _Directory:
    """One directory below the checkpoint directory, opened without following a link, listed boundedly."""

    def __init__(self, parent_fd: int, name: str | None) -> None:
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        self.fd = parent_fd if name is None else os.open(name, flags, dir_fd=parent_fd)
        self.owned = name is not None

    def close(self) -> None:
        if self.owned:
            os.close(self.fd)

    def __enter__(self) -> _Directory:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def entries(self) -> list:
        """(name, kind) for each entry: 'dir', 'file' or 'other' (links, FIFOs, devices: never followed)."""
        listed = []
        with os.scandir(self.fd) as found:
            for entry in found:
                if len(listed) >= MAX_ENTRIES:
                    raise CheckpointProblem(0, "more than %d entries in one directory: the walk is bounded" % MAX_ENTRIES)
                if entry.is_symlink():
                    kind = "link"
                elif entry.is_dir(follow_symlinks=False):
                    kind = "dir"
                elif entry.is_file(follow_symlinks=False):
                    kind = "file"
                else:
                    kind = "other"
                listed.append((entry.name, kind))
        return listed


# --- the formats ---------------------------------------------------------------------------------


def _dcp(dir_fd: int, name: str) -> str:
    size = _regular_size_in(dir_fd, name, DCP_METADATA)
    if size is None:
        return "no .metadata (torch.distributed.checkpoint writes it last)"
    return "" if size > 0 else ".metadata is empty"


def _regular_size_in(dir_fd: int, name: str, inner: str) -> int | None:
    try:
        with _Directory(dir_fd, name) as sub:
            return _regular_size(sub.fd, inner)
    except OSError:
        return None


def _pt_files_whole(dir_fd: int, name: str, required_suffix: str = "") -> str:
    """'' if the directory (and its subdirectories, one level: Megatron's mp_rank_NN) holds .pt files, one
    ending `required_suffix` if given, and each is a whole zip."""
    seen: list = []
    try:
        with _Directory(dir_fd, name) as sub:
            for entry, kind in sorted(sub.entries()):
                if kind == "dir":
                    with _Directory(sub.fd, entry) as inner:
                        for file_name, file_kind in sorted(inner.entries()):
                            if file_kind == "file" and file_name.endswith(".pt"):
                                why = _zip_file_whole(inner.fd, file_name)
                                if why:
                                    return "%s/%s" % (entry, why)
                                seen.append(file_name)
                elif kind == "file" and entry.endswith(".pt"):
                    why = _zip_file_whole(sub.fd, entry)
                    if why:
                        return why
                    seen.append(entry)
    except OSError as exc:
        return "cannot be read: %s" % (exc.strerror or exc)
    if not seen:
        return "no .pt files"
    if required_suffix and not any(file_name.endswith(required_suffix) for file_name in seen):
        return "no file ending %s" % required_suffix
    return ""


def _hf(dir_fd: int, name: str) -> str:
    try:
        with _Directory(dir_fd, name) as sub:
            state = _read_small(sub.fd, HF_STATE, JSON_READ_LIMIT)
            if not state:
                return "no trainer_state.json"
            try:
                json.loads(state)
            except ValueError:
                return "trainer_state.json is not whole"
            for weights in HF_WEIGHTS:
                if _regular_size(sub.fd, weights) is None:
                    continue
                if weights.endswith(".index.json"):
                    return _hf_shards(sub.fd, weights)
                if weights.endswith(".safetensors"):
                    return _safetensors_whole(sub.fd, weights)
                return _zip_file_whole(sub.fd, weights)
            return "no weights (%s)" % ", ".join(HF_WEIGHTS[:2])
    except OSError as exc:
        return "cannot be read: %s" % (exc.strerror or exc)


def _hf_shards(dir_fd: int, index: str) -> str:
    raw = _read_small(dir_fd, index, JSON_READ_LIMIT)
    try:
        shards = sorted(set(json.loads(raw or b"")["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        return "%s is not whole" % index
    for shard in shards:
        if not isinstance(shard, str) or "/" in shard:
            return "%s names an odd shard" % index
        why = _safetensors_whole(dir_fd, shard) if shard.endswith(".safetensors") else _zip_file_whole(dir_fd, shard)
        if why:
            return why
    return ""


def _nemo(dir_fd: int, name: str, kind: str, names: set) -> str:
    if name + NEMO_UNFINISHED in names:
        return "its %s marker is there: NeMo had not finished the save" % NEMO_UNFINISHED
    if kind == "file":
        return _zip_file_whole(dir_fd, name) if name.endswith(SAVE_SUFFIXES) else ""
    try:
        with _Directory(dir_fd, name) as sub:
            return "" if sub.entries() else "empty"
    except OSError as exc:
        return "cannot be read: %s" % (exc.strerror or exc)


def _tracker(dir_fd: int, name: str, notes: list) -> int | None:
    """The step a tracker file (DeepSpeed's latest, Megatron's latest_checkpointed_iteration.txt) names."""
    raw = _read_small(dir_fd, name)
    if raw is None:
        notes.append("no readable %s: the checkpoints are judged by their files alone" % name)
        return None
    text = raw.decode("ascii", "replace").strip()
    step = step_of(text) if text else None
    if step is None:
        notes.append("%s does not name a step: the checkpoints are judged by their files alone" % name)
    return step


def detect(entries: list) -> str | None:
    """The format the entries of a checkpoint directory are laid out in, or None."""
    names = {name for name, _kind in entries}
    if MEGATRON_TRACKER in names or any(name.startswith("iter_") for name, kind in entries if kind == "dir"):
        return "megatron"
    if DEEPSPEED_LATEST in names or any(name.startswith("global_step") for name, kind in entries if kind == "dir"):
        return "deepspeed"
    if any(name.endswith(NEMO_UNFINISHED) for name in names):
        return "nemo"
    if any(name.startswith("checkpoint-") for name, kind in entries if kind == "dir"):
        return "hf_trainer"
    if any(kind == "dir" and step_of(name) is not None for name, kind in entries):
        return "dcp"
    if any(kind == "file" and name.endswith(SAVE_SUFFIXES) and step_of(name) is not None for name, kind in entries):
        return "torch_save"
    return None


def _candidates(fmt: str, entries: list) -> list:
    """(step, name, kind) of the entries that are checkpoints of `fmt`, newest first."""
    found = []
    for name, kind in entries:
        if not _PLAIN_NAME.match(name) or name.endswith(TORN_SUFFIX) or name.startswith("."):
            continue
        if fmt == "torch_save":
            wanted = kind == "file" and name.endswith(SAVE_SUFFIXES)
        elif fmt == "nemo":
            wanted = kind in ("file", "dir") and not name.endswith(NEMO_UNFINISHED) and "step=" in name
        elif fmt == "hf_trainer":
            wanted = kind == "dir" and name.startswith("checkpoint-")
        elif fmt == "megatron":
            wanted = kind == "dir" and name.startswith("iter_")
        else:
            wanted = kind == "dir"
        step = step_of(name) if wanted else None
        if step is not None:
            found.append((step, name, kind))
    found.sort(key=lambda item: (item[0], item[1]), reverse=True)
    return found


def _judge(fmt: str, dir_fd: int, name: str, kind: str, names: set, marker: str, tracked: int | None,
           step: int) -> str:
    """'' if the checkpoint `name` is complete by its format's mark, else why not."""
    if fmt == "dcp":
        return _dcp(dir_fd, name)
    if fmt == "torch_save":
        return _zip_file_whole(dir_fd, name)
    if fmt == "hf_trainer":
        return _hf(dir_fd, name)
    if fmt == "nemo":
        return _nemo(dir_fd, name, kind, names)
    if fmt == "marker":
        return "" if _regular_size_in(dir_fd, name, marker) is not None else "no %s marker" % marker
    if tracked is not None and step > tracked:
        tracker = DEEPSPEED_LATEST if fmt == "deepspeed" else MEGATRON_TRACKER
        return "newer than the step %s names (%d): not committed" % (tracker, tracked)
    if fmt == "megatron" and _regular_size_in(dir_fd, name, DCP_METADATA):
        return ""  # Megatron's torch_dist format: torch.distributed.checkpoint's .metadata
    return _pt_files_whole(dir_fd, name, "model_states.pt" if fmt == "deepspeed" else "")


def resolve(directory: str, fmt: str = "auto", marker: str = "COMPLETE", wanted_step: int | None = None,
            enough: int = MAX_COMPLETE_LISTED, clock=time.monotonic) -> Resolution:
    """The newest complete checkpoint in `directory` (or the one of `wanted_step`, the ranks' joint choice).

    Judged newest first: the torn ones met before it are reported (never deleted), and the newest
    `enough` complete steps (at most MAX_COMPLETE_LISTED) are listed for the ranks' joint decision; the live
    file asks for one. The torn ones reported are at most that many too (torn_skipped counts them all). CheckpointProblem when
    the directory cannot be reached safely or is too large to walk.
    """
    begun = clock()
    notes: list = []
    try:
        walked = safepath.walk(directory, listable=True)
    except FileNotFoundError:
        return Resolution(directory, fmt, None, [], [], ["%s does not exist (yet)" % directory], clock() - begun)
    except OSError as exc:
        raise CheckpointProblem(getattr(exc, "errno", 0) or 0, "%s cannot be reached safely: %s"
                                % (directory, exc.strerror or exc)) from None
    with walked:
        top = _Directory(walked.fd, None)
        try:
            entries = top.entries()
        except CheckpointProblem:
            raise
        except OSError as exc:
            raise CheckpointProblem(exc.errno or 0, "%s cannot be listed: %s" % (directory, exc.strerror or exc)) from None
        used = fmt
        if fmt == "auto":
            used = detect(entries) or "auto"
            if used == "auto":
                notes.append("no checkpoint layout recognised")
                return Resolution(directory, used, None, [], [], notes, clock() - begun)
        names = {name for name, _kind in entries}
        tracked = None
        if used in ("deepspeed", "megatron"):
            tracked = _tracker(walked.fd, DEEPSPEED_LATEST if used == "deepspeed" else MEGATRON_TRACKER, notes)
        chosen = None
        torn: list = []
        complete: list = []
        for step, name, kind in _candidates(used, entries):
            if len(complete) >= min(enough, MAX_COMPLETE_LISTED) and chosen is not None:
                break
            why = _judge(used, walked.fd, name, kind, names, marker, tracked, step)
            if why:
                if chosen is None:
                    torn.append(Found(name, step, False, why))
                continue
            if not complete or complete[-1] != step:
                complete.append(step)
            if chosen is None and (wanted_step is None or step == wanted_step):
                chosen = Found(name, step, True)
            elif chosen is None and wanted_step is not None and step < wanted_step:
                break
        if wanted_step is not None and chosen is None:
            notes.append("the step the ranks agreed on (%d) is not complete here" % wanted_step)
        return Resolution(directory, used, chosen, torn, complete, notes, clock() - begun)


def rename_torn(resolution: Resolution) -> list:
    """Rename each torn checkpoint newer than the chosen one aside (NAME.torn, or NAME.torn.N), never
    following a link; returns the new paths. Nothing is deleted."""
    renamed = []
    with safepath.walk(resolution.directory) as walked:
        for found in resolution.torn:
            for number in range(100):
                target = found.name + TORN_SUFFIX + ("" if number == 0 else ".%d" % number)
                if safepath.lstat_at(walked.fd, target) is None:
                    break
            else:
                continue
            try:
                os.rename(found.name, target, src_dir_fd=walked.fd, dst_dir_fd=walked.fd)
            except OSError:
                continue
            renamed.append(os.path.join(resolution.directory, target))
    resolution.renamed = renamed
    return renamed


def resume_arguments(resume_args: tuple, resolution: Resolution | None) -> tuple:
    """resume_args with ``{checkpoint}`` and ``{step}`` replaced by the chosen checkpoint's path and step
    (a plain replacement: no other brace is touched, nothing is evaluated)."""
    if resolution is None or resolution.chosen is None:
        return tuple(resume_args)
    values = {"{checkpoint}": resolution.path or "", "{step}": str(resolution.step)}
    # One pass: a path that itself holds "{step}" is handed over as it is.
    return tuple(_PLACEHOLDER.sub(lambda match: values[match.group(0)], arg) for arg in resume_args)


def has_placeholder(resume_args: tuple) -> bool:
    return any(_PLACEHOLDER.search(arg) for arg in resume_args)
