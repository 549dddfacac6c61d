"""The private directory walk on a real file system: symlinks, FIFOs, other users' directories and
modes, made where it matters with real chown/chmod (another user is uid 65534, nobody)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.private_dir import (
    NO_WRITE_FOR_OTHERS,
    check_private_dir,
    open_private_dir,
    resolve_dir,
)

OTHER_UID = 65534


def another_users(path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("handing a directory to another user needs root")
    os.chown(path, OTHER_UID, OTHER_UID)


def test_missing_directories_are_made_0700_and_the_fd_is_on_the_directory(tmp_path):
    target = tmp_path / "a" / "b" / "c"

    fd = open_private_dir("some_dir", str(target))
    try:
        assert os.path.samestat(os.fstat(fd), target.stat())
    finally:
        os.close(fd)
    for made in (tmp_path / "a", tmp_path / "a" / "b", target):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700


def test_an_existing_private_directory_is_accepted_and_nothing_is_created_without_create(tmp_path):
    check_private_dir("some_dir", str(tmp_path))
    with pytest.raises(BadOption, match="some_dir: .*/missing does not exist"):
        check_private_dir("some_dir", str(tmp_path / "missing"), create=False)
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("where", ["leaf", "parent"])
def test_a_symlink_another_user_can_change_is_refused_anywhere_on_the_path(tmp_path, where):
    (tmp_path / "real" / "d").mkdir(parents=True, mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real")
    if os.geteuid() == 0:
        os.lchown(link, OTHER_UID, OTHER_UID)  # planted by another user (root's own link would be trusted)
    path = link / "d" if where == "parent" else link

    with pytest.raises(BadOption, match=r"some_dir: .*/link is a symbolic link that a user other than root can change") as refused:
        check_private_dir("some_dir", resolve_dir("some_dir", str(path)))

    assert refused.value.option == "some_dir"


def test_a_symlink_only_root_can_change_is_resolved_and_the_walk_then_takes_no_symlink(tmp_path):
    """/home -> /srv/home made by the administrator: followed by resolve_dir, whose answer has no link
    left; open_private_dir itself never follows one."""
    if os.geteuid() != 0:
        pytest.skip("a link only root can change needs root")
    (tmp_path / "srv" / "home").mkdir(parents=True, mode=0o755)
    (tmp_path / "home").symlink_to(tmp_path / "srv" / "home")

    resolved = resolve_dir("some_dir", str(tmp_path / "home" / "me" / "cp"))

    assert resolved == str(tmp_path / "srv" / "home" / "me" / "cp")
    check_private_dir("some_dir", resolved)
    assert stat.S_IMODE((tmp_path / "srv" / "home" / "me" / "cp").stat().st_mode) == 0o700
    with pytest.raises(BadOption, match=r"some_dir: .*/home is a symbolic link \(every directory"):
        check_private_dir("some_dir", str(tmp_path / "home" / "me" / "cp"))


@pytest.mark.parametrize("make", ["file", "fifo"])
def test_a_component_that_is_not_a_directory_is_refused(tmp_path, make):
    odd = tmp_path / "odd"
    if make == "file":
        odd.write_text("", encoding="utf-8")
    else:
        os.mkfifo(odd)

    for check in (lambda: resolve_dir("some_dir", str(odd / "below")), lambda: check_private_dir("some_dir", str(odd / "below"))):
        with pytest.raises(BadOption, match=r"some_dir: .*/odd is not a directory"):
            check()


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_parent_others_may_write_to_without_the_sticky_bit_is_refused(tmp_path, mode):
    parent = tmp_path / "p"
    (parent / "d").mkdir(parents=True, mode=0o700)
    parent.chmod(mode)

    with pytest.raises(BadOption, match=rf"/p \(on its path\) is writable by other users without the sticky bit \(mode 0{mode:o}\)"):
        check_private_dir("some_dir", str(parent / "d"))


def test_a_sticky_parent_is_accepted(tmp_path):
    parent = tmp_path / "p"
    parent.mkdir()
    parent.chmod(0o1777)

    check_private_dir("some_dir", str(parent / "d"))


def test_a_parent_of_another_user_is_refused_even_with_a_safe_mode(tmp_path):
    parent = tmp_path / "p"
    (parent / "d").mkdir(parents=True, mode=0o700)
    parent.chmod(0o755)
    another_users(parent)

    with pytest.raises(BadOption, match=rf"/p \(on its path\) belongs to uid {OTHER_UID}"):
        check_private_dir("some_dir", str(parent / "d"))


def test_a_missing_directory_someone_else_created_first_is_refused(tmp_path):
    """What a racer who creates the directory between our look and our mkdir gets: refused."""
    theirs = tmp_path / "d"
    theirs.mkdir(mode=0o700)
    another_users(theirs)

    with pytest.raises(BadOption, match=rf"must belong to this user \(uid {os.geteuid()}\) .*it has uid {OTHER_UID}"):
        check_private_dir("some_dir", str(theirs))


def test_the_leaf_mode_the_caller_forbids(tmp_path):
    leaf = tmp_path / "d"
    leaf.mkdir(mode=0o755)
    leaf.chmod(0o755)

    with pytest.raises(BadOption, match="with mode 0700 or stricter .*mode 0755"):
        check_private_dir("some_dir", str(leaf))
    check_private_dir("some_dir", str(leaf), NO_WRITE_FOR_OTHERS)  # readable by others is fine for it
    leaf.chmod(0o775)
    with pytest.raises(BadOption, match="with mode 0755 or stricter .*mode 0775"):
        check_private_dir("some_dir", str(leaf), NO_WRITE_FOR_OTHERS)


@pytest.mark.parametrize("path", ["relative/dir", "/tmp/../tmp/x"])
def test_a_path_that_is_not_absolute_and_normalised_is_refused_by_the_walk(path):
    with pytest.raises(BadOption, match="some_dir: "):
        check_private_dir("some_dir", path)


def test_resolve_dir_expands_the_home_and_normalises():
    assert resolve_dir("some_dir", "~/gpuops-missing-x/../gpuops-missing-y") == os.path.join(
        os.path.realpath(os.path.expanduser("~")), "gpuops-missing-y")
