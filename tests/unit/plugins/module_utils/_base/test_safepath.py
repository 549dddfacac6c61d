"""_base/safepath.py: paths walked from /, never through a symlink another user than root can change.

The links that matter are made by a real unprivileged user (nobody, in a directory it owns), as a
job's user would plant them; the directories live under a 0755 folder in /tmp so that nobody can
reach them (pytest's tmp_path is 0700).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base import safepath

NOBODY = 65534


def as_nobody(*argv: str) -> None:
    """Run a command as nobody (a real unprivileged process, not a chown after the fact)."""
    subprocess.run(argv, check=True, user=NOBODY, group=NOBODY, extra_groups=[], timeout=30)


@pytest.fixture(name="site")
def site_fixture() -> Iterator[Path]:
    """/tmp/gpuops-safepath-*/ (0755, root's) with home/ (nobody's) and rootonly/ (root's, 0700, a secret)."""
    base = Path(tempfile.mkdtemp(prefix="gpuops-safepath-", dir="/tmp"))
    try:
        base.chmod(0o755)
        (base / "home").mkdir()
        os.chown(base / "home", NOBODY, NOBODY)
        (base / "rootonly").mkdir(mode=0o700)
        (base / "rootonly" / "secret").write_text("root's secret\n")
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_link_planted_by_another_user_is_refused_and_named(site: Path) -> None:
    as_nobody("ln", "-s", str(site / "rootonly"), str(site / "home" / "logs"))
    with pytest.raises(safepath.UnsafePath) as caught:
        safepath.walk(str(site / "home" / "logs"))
    assert str(caught.value).startswith(f"{site}/home/logs is a symbolic link that a user other than root can change")
    with pytest.raises(OSError, match="home/logs is a symbolic link"):
        safepath.open_regular(str(site / "home" / "logs" / "secret"), os.O_RDONLY)
    assert not safepath.regular_file_exists(str(site / "home" / "logs" / "secret"))
    assert not safepath.lexists(str(site / "home" / "logs" / "secret"))


def test_a_link_only_root_can_change_is_followed(site: Path) -> None:
    # The administrator's link (/var/run -> /run, a workspace on another disk): root's, in a
    # directory only root may write.
    (site / "workspace").symlink_to(site / "rootonly")
    with safepath.walk(str(site / "workspace")) as walked:
        assert os.path.samestat(os.fstat(walked.fd), os.stat(site / "rootonly"))
    # The same link in a directory others may write (no sticky bit) is not root's alone.
    shared = site / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "workspace").symlink_to(site / "rootonly")
    with pytest.raises(safepath.UnsafePath, match="shared/workspace is a symbolic link"):
        safepath.walk(str(shared / "workspace"))
    # With the sticky bit (like /tmp) only an entry's owner may replace it: root's link holds.
    shared.chmod(0o1777)
    safepath.walk(str(shared / "workspace")).close()


def test_relative_and_absolute_targets_and_loops(site: Path) -> None:
    (site / "rootonly" / "inner").mkdir()
    (site / "rel").symlink_to("rootonly/inner/..")
    with safepath.walk(str(site / "rel")) as walked:
        assert os.path.samestat(os.fstat(walked.fd), os.stat(site / "rootonly"))
    (site / "loop").symlink_to(site / "loop")
    with pytest.raises(safepath.UnsafePath, match="more than 40 symbolic links"):
        safepath.walk(str(site / "loop"))


def test_missing_directories_are_created_with_exactly_the_mode(site: Path) -> None:
    old = os.umask(0o077)
    try:
        with safepath.walk(str(site / "a" / "b"), create_mode=0o755):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(site / "a" / "b").st_mode) == 0o755
    with safepath.walk(str(site / "c" / "d"), stop_at_missing=True) as found:
        assert found.reached == str(site) and found.missing == ["c", "d"]
    assert not (site / "c").exists()
    (site / "file").write_text("")
    with pytest.raises(safepath.UnsafePath, match="file is not a directory"):
        safepath.walk(str(site / "file" / "x"), stop_at_missing=True)


def test_files_are_regular_of_one_link_never_a_link_or_fifo(site: Path) -> None:
    directory = site / "rootonly"
    (directory / "log").write_text("x")
    os.link(directory / "secret", directory / "linked")
    os.mkfifo(directory / "fifo")
    (directory / "symlink").symlink_to(directory / "log")
    with safepath.walk(str(directory)) as walked:
        os.close(safepath.open_regular_at(walked.fd, "log", os.O_RDONLY))
        with pytest.raises(safepath.NotRegularFile, match="other hard links"):
            safepath.open_regular_at(walked.fd, "linked", os.O_WRONLY | os.O_APPEND)
        with pytest.raises(safepath.NotRegularFile, match="not a regular file"):
            safepath.open_regular_at(walked.fd, "fifo", os.O_RDONLY)  # O_NONBLOCK: no wait for a writer
        with pytest.raises(OSError):
            safepath.open_regular_at(walked.fd, "symlink", os.O_RDONLY)
    assert (directory / "secret").read_text() == "root's secret\n"


def test_write_atomic_replaces_and_leaves_no_temporary(site: Path) -> None:
    path = site / "rootonly" / "record.json"
    safepath.write_atomic(str(path), b"one")
    safepath.write_atomic(str(path), b"two", 0o600)
    assert path.read_bytes() == b"two" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(os.listdir(site / "rootonly")) == ["record.json", "secret"]


def test_a_tree_is_removed_without_following_the_links_in_it(site: Path) -> None:
    cache = site / "home" / "cache"
    as_nobody("mkdir", "-p", str(cache / "sub" / "deeper"))
    as_nobody("ln", "-s", str(site / "rootonly"), str(cache / "sub" / "escape"))
    as_nobody("ln", "-s", str(site / "rootonly" / "secret"), str(cache / "deeper-link"))
    as_nobody("touch", str(cache / "sub" / "deeper" / "kernel.so"))
    with safepath.walk(str(site / "home")) as walked:
        assert safepath.remove_at(walked.fd, "cache") is True
        assert safepath.remove_at(walked.fd, "cache") is False
    assert not cache.exists()
    assert (site / "rootonly" / "secret").read_text() == "root's secret\n"


def test_a_deep_tree_is_removed_without_recursion(site: Path) -> None:
    deep = site / "rootonly" / "deep"
    deep.mkdir()
    fd = os.open(deep, os.O_RDONLY | os.O_DIRECTORY)
    for _depth in range(1200):  # deeper than Python's default recursion limit (and than os.makedirs goes)
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)
    with safepath.walk(str(site / "rootonly")) as walked:
        assert safepath.remove_at(walked.fd, "deep") is True
    assert not deep.exists()


def test_why_not_writable_names_a_read_only_file_system(tmp_path: Path) -> None:
    with safepath.walk(str(tmp_path)) as walked:
        assert safepath.why_not_writable(walked.fd) is None
    with safepath.walk("/proc/self") as walked:  # procfs: not writable, even for root
        assert safepath.why_not_writable(walked.fd) is not None


def test_relative_paths_are_refused() -> None:
    with pytest.raises(safepath.UnsafePath, match="not an absolute path"):
        safepath.walk("relative/dir")
    with pytest.raises(safepath.UnsafePath, match="is not a file"):
        safepath.split("/")
