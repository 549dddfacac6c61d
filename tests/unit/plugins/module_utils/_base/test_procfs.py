"""The /proc parser and snapshot on fixture trees (the real-process tests are in tests/integration)."""

from __future__ import annotations

import os
import re
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ansible_collections.gpuops.relaunch.plugins.module_utils._base import procfs
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.procfs import (
    ProcessTable,
    ProcfsError,
    compile_patterns,
    parse_stat,
    read_process,
    shown_text,
)
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.terminal import escape_controls
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.signal_gate import (
    Identity,
    ProcessControl,
    format_pids,
)
from tests.harness.fakeproc import FakeProc


def stat_line(pid: int, comm: str, state: str = "S", ppid: int = 1, threads: int = 1, starttime: int = 1000) -> bytes:
    return FakeProc.stat(pid, comm, state, ppid, None, threads, starttime, 0)


def test_parse_stat_splits_after_the_last_paren():
    fields = parse_stat(stat_line(42, "evil) S 1 (x", state="Z", ppid=7, threads=3, starttime=99))
    assert fields is not None
    assert fields.comm == "evil) S 1 (x"
    assert (fields.state, fields.ppid, fields.threads, fields.starttime) == ("Z", 7, 3, 99)


def test_parse_stat_with_spaces_in_comm():
    fields = parse_stat(stat_line(5, "tmux: server", ppid=1))
    assert fields is not None and fields.comm == "tmux: server" and fields.ppid == 1


def test_what_a_process_names_itself_is_kept_escaped(tmp_path):
    # comm and arguments are the process's own bytes: ESC, BEL, C1 CSI and undecodable bytes.
    fields = parse_stat(stat_line(7, "\x1b]0;t\x07\x9b"))
    assert fields is not None and fields.comm == "\\x1b]0;t\\x07\\x9b"
    proc = FakeProc(tmp_path)
    proc.add(1, "init")
    proc.add(100, "python3", cmdline=["python3", "\x1b[2Jtrain.py", "--tag=\x9b31m"])
    table = ProcessTable.scan(str(tmp_path))
    assert table.processes[100].cmdline == "python3 \\x1b[2Jtrain.py --tag=\\x9b31m"
    assert table.argv(100) == ["python3", "\\x1b[2Jtrain.py", "--tag=\\x9b31m"]


@pytest.mark.parametrize("raw", [b"", b"12 (x", b"12 (x) S 1", b"garbage"])
def test_parse_stat_rejects_truncated_lines(raw):
    assert parse_stat(raw) is None


def test_snapshot_reads_processes_cmdline_and_kernel_threads(tmp_path):
    proc = FakeProc(tmp_path)
    proc.add(1, "init", cmdline=["/sbin/init"])
    proc.add(2, "kthreadd", ppid=0, flags=0x00200000)
    proc.add(30, "kworker/0:1", ppid=2, flags=0x00200000)
    proc.add(100, "python3", cmdline=["python3", "/work/train.py", "--lr", "3e-4"])
    table = ProcessTable.scan(str(tmp_path))
    assert sorted(table.processes) == [1, 2, 30, 100]
    assert table.processes[100].cmdline == "python3 /work/train.py --lr 3e-4"
    assert table.processes[30].is_kernel_thread and table.processes[30].cmdline == ""
    assert not table.processes[100].is_kernel_thread


def test_zombie_leader_has_empty_cmdline_and_threads_from_task_dir(tmp_path):
    proc = FakeProc(tmp_path)
    proc.add(1, "init")
    proc.add(50, "python3", state="Z", threads=2, cmdline=[])
    proc.add_thread(50, 50, "python3", state="Z")
    proc.add_thread(50, 51, "pt_main_thread", state="D", wchan="uvm_va_space_destroy")
    table = ProcessTable.scan(str(tmp_path))
    leader = table.processes[50]
    assert leader.cmdline == "" and leader.is_zombie
    threads = table.load_threads(50)
    assert [(t.tid, t.state, t.wchan) for t in threads] == [(50, "Z", ""), (51, "D", "uvm_va_space_destroy")]
    assert [t.tid for t in leader.live_threads] == [51]


def char_node(path, major, minor):
    """A real character device node: what counts is the kernel's major:minor of the opened file."""
    if os.geteuid() != 0:
        pytest.skip("a stand-in device node (mknod of a character device) needs root")
    os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(major, minor))
    return path


def test_device_holders_read_task_fds_of_zombie_leaders(tmp_path):
    device = char_node(tmp_path / "nvidia0", 195, 0)
    proc = FakeProc(tmp_path / "proc")
    proc.add(1, "init")
    proc.add(50, "python3", state="Z", threads=2)
    proc.add_thread(50, 50, "python3", state="Z")
    proc.add_thread(50, 51, "worker", state="S")
    proc.add_fd(50, "7", str(device), tid=51)
    proc.add(60, "python3", cmdline=["python3", "x.py"])
    proc.add_fd(60, "3", str(device))
    proc.add_fd(60, "4", "/dev/null")
    table = ProcessTable.scan(str(tmp_path / "proc"))
    holders = table.device_holders(str(tmp_path / "nvidia*"))
    assert [(h.pid, h.tid, h.comm, h.device.path, h.device.number) for h in holders] == [
        (50, 51, "worker", str(device), "195:0"),
        (60, 60, "python3", str(device), "195:0"),
    ]


def test_device_holders_tell_the_device_by_its_numbers_not_its_name(tmp_path):
    """Only character devices count, each with the kernel's numbers; only 195:0-247 is a GPU's own."""
    nodes = {name: char_node(tmp_path / name, major, minor) for name, (major, minor) in {
        "nvidia0": (195, 0), "nvidia247": (195, 247), "nvidia-modeset": (195, 254), "nvidiactl": (195, 255),
        "nvidia-uvm": (511, 0), "nvidia-lookalike": (1, 3)}.items()}  # 1:3 is /dev/null's numbers
    (tmp_path / "nvidia-regular").write_text("", encoding="ascii")
    os.mkfifo(tmp_path / "nvidia-fifo")
    proc = FakeProc(tmp_path / "proc")
    proc.add(60, "python3")
    paths = [*nodes.values(), tmp_path / "nvidia-regular", tmp_path / "nvidia-fifo"]
    for fd, path in enumerate(paths, start=3):
        proc.add_fd(60, str(fd), str(path))
    table = ProcessTable.scan(str(tmp_path / "proc"))
    held = {h.device.path: (h.device.number, h.device.is_gpu) for h in table.device_holders(str(tmp_path / "nvidia*"))}
    assert held == {str(nodes["nvidia0"]): ("195:0", True), str(nodes["nvidia247"]): ("195:247", True),
                    str(nodes["nvidia-modeset"]): ("195:254", False), str(nodes["nvidiactl"]): ("195:255", False),
                    str(nodes["nvidia-uvm"]): ("511:0", False), str(nodes["nvidia-lookalike"]): ("1:3", False)}


def test_device_walk_skipped_when_no_device_exists(tmp_path):
    proc = FakeProc(tmp_path / "proc")
    proc.add(60, "python3")
    proc.add_fd(60, "3", str(tmp_path / "nvidia0"))  # target does not exist on this machine
    table = ProcessTable.scan(str(tmp_path / "proc"))
    assert table.device_holders(str(tmp_path / "nvidia*")) == []


def test_vanished_and_half_written_processes_are_skipped(tmp_path):
    proc = FakeProc(tmp_path)
    proc.add(1, "init")
    (tmp_path / "77").mkdir()  # the process went away between listdir and reading stat
    (tmp_path / "78").mkdir()
    (tmp_path / "78" / "stat").write_bytes(b"78 (trunc")
    table = ProcessTable.scan(str(tmp_path))
    assert sorted(table.processes) == [1]


def test_missing_proc_root_is_a_clear_error(tmp_path):
    with pytest.raises(ProcfsError, match="cannot list"):
        ProcessTable.scan(str(tmp_path / "nope"))


def test_structure_descendants_and_ancestors(tmp_path):
    proc = FakeProc(tmp_path)
    proc.add(1, "init")
    proc.add(10, "a", ppid=1)
    proc.add(11, "b", ppid=10)
    proc.add(12, "c", ppid=11)
    proc.add(13, "d", ppid=10)
    table = ProcessTable.scan(str(tmp_path))
    assert sorted(table.descendants(10)) == [11, 12, 13]
    assert table.ancestors(12) == [11, 10, 1]


def test_identity_sees_a_recycled_pid(tmp_path):
    proc = FakeProc(tmp_path)
    proc.add(1, "init")
    proc.add(10, "old", starttime=500)
    control = ProcessControl(str(tmp_path))
    seen = Identity.of(ProcessTable.scan(str(tmp_path)).processes[10])
    proc.add(10, "new", starttime=900)  # same pid, a different process
    assert control.current(seen) is None and control.look(10).comm == "new"
    proc.add(10, "old", starttime=500)
    now = control.current(seen)
    assert now is not None and now.comm == "old"
    assert control.current(Identity(11, 500)) is None


def test_environ_value_belongs_to_the_identity(tmp_path):
    proc = FakeProc(tmp_path)
    proc.add(10, "job", starttime=500)
    (tmp_path / "10" / "environ").write_bytes(b"A=1\0MARK=run:1\0")
    control = ProcessControl(str(tmp_path))
    assert control.environ_value(Identity(10, 500), "MARK") == "run:1"
    assert control.environ_value(Identity(10, 500), "OTHER") is None
    assert control.environ_value(Identity(10, 501), "MARK") is None  # the pid now names another process


def test_format_pids_sorts():
    assert format_pids({12, 3, 7}) == "3, 7, 12"
    assert format_pids([]) == ""


def test_compile_patterns_names_option_and_every_bad_pattern():
    with pytest.raises(BadOption, match=r"match: '\(' is not a valid regular expression") as caught:
        compile_patterns(["ok", "(", "[z-a]"], "match")
    assert caught.value.option == "match" and "'[z-a]' is not a valid regular expression" in caught.value.reason


def test_scan_of_real_proc_finds_itself():
    table = ProcessTable.scan("/proc")
    me = table.processes[os.getpid()]
    assert me.starttime > 0
    # Its own command line, as /proc has it (a pytest-xdist worker runs "python -c ...", not pytest).
    assert me.cmdline.split() == open("/proc/self/cmdline", "rb").read().decode().rstrip("\0").replace("\0", " ").split()
    assert table.processes[os.getppid()].pid == me.ppid
    assert 1 in table.processes


def test_pid_2_inside_a_namespace_is_an_ordinary_process(tmp_path):
    # Only PF_KTHREAD marks a kernel thread: in a PID namespace pid 2 is often the job itself.
    proc = FakeProc(tmp_path)
    proc.add(1, "sleep", cmdline=["sleep", "infinity"])
    proc.add(2, "python3", cmdline=["python3", "train.py"])
    proc.add(3, "python3", ppid=2, cmdline=["python3", "-c", "worker"])
    table = ProcessTable.scan(str(tmp_path))
    assert not table.processes[2].is_kernel_thread and not table.processes[3].is_kernel_thread
    assert table.processes[2].cmdline == "python3 train.py"


# --- what a process writes about itself is escaped when asked for, and always -------------------

_UNSHOWABLE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\ud800-\udfff]")  # what escape_controls escapes


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_shown_text_is_the_escaped_decoding_of_any_bytes(raw):
    # The plain-ASCII shortcut and the cache of escaped texts change nothing shown.
    assert shown_text(raw) == escape_controls(raw.decode("utf-8", "replace"))
    assert _UNSHOWABLE.search(shown_text(raw)) is None


@pytest.mark.parametrize("raw", [b"python3 train.py --cfg {{ lookup('pipe', 'id') }}", b"#jinja2:x {%"])
def test_a_plain_ascii_command_line_that_jinja_would_read_is_escaped(raw):
    # The plain-ASCII shortcut must not pass what opens a template (a command line reaches set_stats).
    assert shown_text(raw) == escape_controls(raw.decode("ascii"))
    assert "{{" not in shown_text(raw) and "{%" not in shown_text(raw) and "#jinja2:" not in shown_text(raw)


def test_a_scan_escapes_nothing_and_what_is_read_of_it_comes_back_escaped(tmp_path, monkeypatch):
    escaped: list[str] = []
    real = procfs.escape_controls
    monkeypatch.setattr(procfs, "escape_controls", lambda text: escaped.append(text) or real(text))
    proc = FakeProc(tmp_path)
    proc.add(1, "init")
    title = "\x1b]0;pwned\x07"
    for pid in (100, 101, 102):  # the workers of one job: one command line with control characters
        proc.add(pid, title, cmdline=["python3", "\x1b[2Jtrain.py", f"--rank=\x9b3{pid}m"])
    proc.add(103, "python3", cmdline=["python3", "serve.py"])
    table = ProcessTable.scan(str(tmp_path))
    assert escaped == []  # nothing is escaped that nothing asked for
    assert table.matching([re.compile("\x1b")]) == []  # a pattern sees only shown text
    assert table.matching([re.compile(r"\\x1b\[2Jtrain")]) == [100, 101, 102]
    worker = table.processes[101]
    assert worker.comm == "\\x1b]0;pwned\\x07"
    assert worker.cmdline == "python3 \\x1b[2Jtrain.py --rank=\\x9b3101m"
    assert Identity.of(worker).comm == worker.comm
    assert table.argv(101) == ["python3", "\\x1b[2Jtrain.py", "--rank=\\x9b3101m"]
    for process in table.processes.values():
        shown = [process.comm, process.cmdline, repr(process), *table.argv(process.pid)]
        assert all(_UNSHOWABLE.search(text) is None for text in shown), shown


def test_a_process_read_again_for_its_identity_shows_only_escaped_text(tmp_path):
    proc = FakeProc(tmp_path)
    proc.add(7, "\x9b2J", cmdline=["\x1b[2J"], starttime=77)
    quick = read_process(str(tmp_path), 7, with_cmdline=False)
    full = read_process(str(tmp_path), 7)
    assert quick is not None and full is not None
    assert Identity(7, 77).matches(quick) and Identity(7, 77).matches(full)
    assert (full.comm, full.cmdline) == ("\\x9b2J", "\\x1b[2J")
    assert (quick.comm, quick.cmdline) == ("\\x9b2J", "\\x1b[2J")  # its stat alone, its cmdline when asked
    full.comm = "set by a caller"
    assert full.comm == "set by a caller"


def test_a_cmdline_read_when_first_asked_is_the_scanned_process_s_or_none(tmp_path, monkeypatch):
    proc = FakeProc(tmp_path)
    proc.add(1, "init")
    proc.add(10, "python3", cmdline=["python3", "train.py"], starttime=500)
    proc.add(11, "python3", cmdline=["python3", "\x1b[2Jeval.py"], starttime=600)
    proc.add(12, "python3", cmdline=["python3", "serve.py"], starttime=700)
    reads: list[str] = []
    real = procfs.read_small
    monkeypatch.setattr(procfs, "read_small", lambda path: reads.append(path) or real(path))
    table = ProcessTable.scan(str(tmp_path), cmdlines=False)
    assert not [path for path in reads if path.endswith("/cmdline")]
    proc.add(10, "bash", cmdline=["bash", "-c", "a forged job"], starttime=501)  # its pid taken by another since
    assert table.processes[10].cmdline == ""  # gone: not the later process's words
    assert table.processes[11].cmdline == "python3 \\x1b[2Jeval.py"
    assert table.matching([re.compile("forged")]) == []
    assert table.matching([re.compile(r"serve\.py")]) == [12]
    assert sum(path.endswith("/11/cmdline") for path in reads) == 1  # read once
