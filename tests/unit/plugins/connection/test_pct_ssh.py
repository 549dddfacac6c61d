"""gpuops.relaunch.pct_ssh without a network: the ssh command line it builds, the command the node's
shell receives, what it logs, the control directory it accepts, and how it reads a child's output.

The plugin is loaded by Ansible's plugin loader from its directory (so its DOCUMENTATION defines its
options, as when Ansible loads it by FQCN; by directory, because other tests import the collection's
packages plainly before Ansible's collection finder could be installed). The end-to-end tests (real
sshd, real container) are in tests/integration/test_pct_ssh_connection.py.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from ansible.errors import AnsibleConnectionFailure, AnsibleError
from ansible.playbook.play_context import PlayContext
from ansible.plugins.loader import connection_loader, init_plugin_loader
from ansible.utils.collection_loader._collection_finder import _AnsibleCollectionFinder

REPO = Path(__file__).resolve().parents[4]
PLUGIN_DIR = REPO / "plugins" / "connection"


@pytest.fixture(scope="module", autouse=True)
def _plugin_loader() -> Iterator[None]:
    init_plugin_loader([])
    connection_loader.add_directory(str(PLUGIN_DIR))
    yield
    # The collection finder init_plugin_loader installed answers every later ``ansible_collections``
    # import in this process and knows nothing of the checkout imported through sys.path: the unit
    # tests after this module could not import gpuops.relaunch's modules ("collection metadata was
    # not loaded"). Take it out again.
    _AnsibleCollectionFinder._remove()  # pylint: disable=protected-access


def load():
    conn = connection_loader.get("pct_ssh", PlayContext(), None)
    assert conn is not None, f"pct_ssh did not load from {PLUGIN_DIR}"
    return conn


# Control socket directories short enough for a socket path (pytest's tmp_path is too long).
SHORT_DIRS: list[Path] = []


@pytest.fixture(autouse=True)
def remove_short_dirs() -> Iterator[None]:
    yield
    while SHORT_DIRS:
        shutil.rmtree(SHORT_DIRS.pop(), ignore_errors=True)


def short_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="pct-ut-")) / "cp"
    SHORT_DIRS.append(path.parent)
    return path


def connection(tmp_path: Path, **options):
    del tmp_path  # the control directory must be short: see short_dir
    conn = load()
    conn.set_options(direct={"vmid": 200, "remote_addr": "pve1.example.org",
                             "control_path_dir": str(short_dir()), **options})
    return conn


def test_a_control_directory_too_long_for_a_socket_is_refused_naming_the_limit(tmp_path):
    conn = load()
    conn.set_options(direct={"vmid": 200, "remote_addr": "pve1", "control_path_dir": str(tmp_path / ("d" * 60))})

    with pytest.raises(AnsibleError, match="control_path_dir: .* is too long for a control socket .at most 49 bytes"):
        conn._ssh_argv()  # pylint: disable=protected-access


def option_values(argv: list[str]) -> dict[str, str]:
    return dict(argv[i + 1].split("=", 1) for i, arg in enumerate(argv) if arg == "-o")


def test_the_ssh_command_line_shares_one_checked_connection_per_node(tmp_path):
    conn = connection(tmp_path, port=2222, remote_user="root", private_key_file="/keys/pve")

    argv = conn._ssh_argv()  # pylint: disable=protected-access

    assert argv[0] == "ssh" and argv[-2:] == ["--", "pve1.example.org"]
    assert option_values(argv) == {
        "BatchMode": "yes",
        "StrictHostKeyChecking": "yes",
        "ConnectTimeout": "10",
        "ControlMaster": "auto",
        "ControlPersist": "60s",
        "ControlPath": str(SHORT_DIRS[-1] / "cp" / "%C"),
        "IdentityFile": "/keys/pve",
        "IdentitiesOnly": "yes",
    }
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-l") + 1] == "root"
    assert (SHORT_DIRS[-1] / "cp").stat().st_mode & 0o777 == 0o700


def test_options_change_the_command_line(tmp_path):
    conn = connection(tmp_path, host_key_checking=False, persist=0, known_hosts_file="/etc/pve/known",
                      ssh_extra_args="-o ServerAliveInterval=15 -J 'jump host'", ssh_executable="/opt/ssh")

    argv = conn._ssh_argv()  # pylint: disable=protected-access

    assert argv[0] == "/opt/ssh"
    values = option_values(argv)
    assert values["StrictHostKeyChecking"] == "no" and values["ControlMaster"] == "no"
    assert values["ControlPath"] == "none" and "ControlPersist" not in values  # not even ssh_config's
    assert values["UserKnownHostsFile"] == "/etc/pve/known" and values["ServerAliveInterval"] == "15"
    assert argv[argv.index("-J") + 1] == "jump host"
    # ssh keeps the first value of an option: the user's extra arguments come before the plugin's.
    assert argv.index("ServerAliveInterval=15") < argv.index("BatchMode=yes")
    assert "-p" not in argv and "IdentityFile" not in values
    assert not (tmp_path / "cp").exists()  # no sharing, no control directory


def test_the_whole_command_runs_in_the_container_and_none_on_the_node(tmp_path):
    """The node's login shell gets one line; what reaches pct is exactly exec, vmid, --, /bin/sh, -c,
    and the command, whatever quotes, pipes or semicolons it holds."""
    fake_pct = tmp_path / "pct"
    fake_pct.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n", encoding="utf-8")
    fake_pct.chmod(0o755)
    conn = connection(tmp_path, pct_path=str(fake_pct), vmid=201)
    command = """/bin/sh -c 'echo "it'"'"'s" | cat; touch /tmp/x && echo $HOME' ; echo node"""

    line = conn._pct_exec(command)  # pylint: disable=protected-access
    seen = subprocess.run(["/bin/sh", "-c", line], capture_output=True, text=True, check=True).stdout

    assert json.loads(seen) == ["exec", "201", "--", "/bin/sh", "-c", command]


def test_the_private_key_file_is_never_shown(tmp_path):
    conn = connection(tmp_path, private_key_file="~/.ssh/pve_ed25519")
    expanded = os.path.expanduser("~/.ssh/pve_ed25519")

    shown = conn._shown(conn._ssh_argv())  # pylint: disable=protected-access

    assert expanded not in shown and "pve_ed25519" not in shown
    assert "IdentityFile=<private key file>" in shown


def test_exit_255_is_unreachable_with_the_reason_and_without_the_key(tmp_path):
    conn = connection(tmp_path, private_key_file="/keys/pve", remote_user="root", port=22)

    with pytest.raises(AnsibleConnectionFailure) as failure:
        conn._check_reached(255, b"Load key \"/keys/pve\": bad permissions\n")  # pylint: disable=protected-access

    message = str(failure.value)
    assert "could not run pct exec in container 200 through root@pve1.example.org:22 (exit 255)" in message
    assert "bad permissions" in message and "/keys/pve" not in message
    conn._check_reached(1, b"")  # pylint: disable=protected-access  # any other status is the command's own


@pytest.mark.parametrize("mode", [0o755, 0o770, 0o701])
def test_a_control_directory_others_can_use_is_refused(tmp_path, mode):
    shared = short_dir()
    shared.mkdir()
    shared.chmod(mode)
    conn = connection(tmp_path, control_path_dir=str(shared))

    with pytest.raises(AnsibleError, match="must belong to this user .* with mode 0700"):
        conn._ssh_argv()  # pylint: disable=protected-access


def test_a_missing_vmid_is_named(tmp_path):
    conn = load()

    with pytest.raises(AnsibleError, match="Required config 'vmid'"):
        conn.set_options(direct={"remote_addr": "pve1", "control_path_dir": str(tmp_path / "cp")})


def test_output_is_read_until_the_child_exits_not_until_its_descendants_close_the_pipes():
    """What a shared connection's master could do: keep a copy of stderr after the ssh that started
    it has exited. The read ends with the child; the descendant ends when this test closes its input."""
    _collect = sys.modules[type(load()).__module__]._collect  # pylint: disable=protected-access

    hold_read, hold_write = os.pipe()
    try:
        child = subprocess.Popen(  # pylint: disable=consider-using-with
            ["/bin/sh", "-c", f"cat /dev/fd/{hold_read} >/dev/null & echo out; echo err >&2; exit 3"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(hold_read,),
        )
        os.close(hold_read)
        hold_read = -1

        out, err = _collect(child)

        assert (child.returncode, out, err) == (3, b"out\n", b"err\n")
    finally:
        if hold_read >= 0:
            os.close(hold_read)
        os.close(hold_write)  # the descendant (cat) reads end of file and exits


def test_a_no_log_task_s_command_is_not_shown(tmp_path):
    conn = connection(tmp_path)
    argv = conn._ssh_argv() + [conn._pct_exec("echo s3cret")]  # pylint: disable=protected-access

    assert "s3cret" in conn._shown(argv, command=True)  # pylint: disable=protected-access
    conn._play_context.no_log = True  # pylint: disable=protected-access
    shown = conn._shown(argv, command=True)  # pylint: disable=protected-access

    assert "s3cret" not in shown and shown.endswith("'<command hidden: no_log>'")


# ------------------------------------------------- the control directory ssh really uses (issue 17, item 10)

OTHER_UID = 65534  # nobody: "another user" on the controller


def other_users(path: Path) -> Path:
    """`path`, handed to another user (as an attacker's own directory would be)."""
    if os.geteuid() != 0:
        pytest.skip("handing a directory to another user needs root")
    os.chown(path, OTHER_UID, OTHER_UID)
    return path


def ssh_config(argv: list[str]) -> dict[str, str]:
    """What the real ssh makes of a command line (``ssh -G``: the configuration it would use, every
    token expanded; nothing is connected)."""
    shown = subprocess.run([argv[0], "-G", *argv[1:]], capture_output=True, text=True, check=True).stdout
    return dict(line.split(" ", 1) for line in shown.splitlines() if " " in line)


def test_the_control_socket_ssh_uses_lies_in_the_directory_that_was_checked(tmp_path):
    conn = connection(tmp_path, remote_user="root", port=2222)

    argv = conn._ssh_argv()  # pylint: disable=protected-access

    used = Path(ssh_config(argv)["controlpath"])
    assert used.parent == SHORT_DIRS[-1] / "cp" and len(used.name) == 40  # DIR/%C, %C expanded by ssh itself


@pytest.mark.parametrize("given", ["{base}/pctcp-%u", "{base}/%C-dir", "{base}/${{GPUOPS_UNSET}}", "{base}/a\"b", "{base}/a\\b",
                                   "{base}/a\nb"])
def test_a_control_directory_ssh_would_expand_or_parse_is_refused_naming_the_option(tmp_path, given):
    """(Ansible expands a set environment variable in a path option itself; ssh would expand an unset one.)"""
    base = short_dir().parent
    conn = connection(tmp_path, control_path_dir=given.format(base=base))

    with pytest.raises(AnsibleError, match="control_path_dir: .* must not contain %, \\$, quotes, backslashes or control"):
        conn._ssh_argv()  # pylint: disable=protected-access

    assert list(base.iterdir()) == []  # nothing was created


def test_another_users_control_master_behind_percent_u_never_sees_a_task(tmp_path):
    """The attack: control_path_dir /tmp/pctcp-%u. The plugin used to check (and create) the literal
    directory, while ssh expanded %u and connected to the control socket another user had planted in
    /tmp/pctcp-root, handing it the task. Now the task is refused before ssh runs."""
    base = short_dir().parent
    planted_dir = base / f"pctcp-{pwd.getpwuid(os.geteuid()).pw_name}"  # what ssh makes of pctcp-%u
    planted_dir.mkdir()
    other_users(planted_dir)
    target = ["ssh", "-o", "BatchMode=yes", "-p", "1", "-l", "root", "--", "127.0.0.1"]
    socket_path = ssh_config(target[:1] + ["-o", f"ControlPath={planted_dir}/%C"] + target[1:])["controlpath"]
    master = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    master.bind(socket_path)
    master.listen(4)
    master.settimeout(0.1)
    received: list[bytes] = []
    listening = threading.Event()
    listening.set()

    def fake_control_master() -> None:
        """Takes what a client sends, then hangs up (the client then gives up on it)."""
        while listening.is_set():
            try:
                client, _address = master.accept()
            except socket.timeout:
                continue
            with client:
                client.settimeout(2)
                try:
                    received.append(client.recv(4096))
                except OSError:
                    received.append(b"")

    thread = threading.Thread(target=fake_control_master, daemon=True)
    thread.start()
    conn = connection(tmp_path, control_path_dir=f"{base}/pctcp-%u", remote_addr="127.0.0.1", port=1,
                      remote_user="root", timeout=2, host_key_checking=False)
    try:
        with pytest.raises(AnsibleError, match="control_path_dir: .* must not contain %"):
            conn.exec_command("echo the module payload")
    finally:
        listening.clear()
        thread.join(5)
        master.close()
    assert received == [], "ssh connected to the control socket another user planted"


def test_a_parent_that_is_a_symlink_another_user_can_change_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a link of another user needs root")
    base = short_dir().parent
    (base / "real").mkdir(mode=0o700)
    (base / "link").symlink_to(base / "real")
    os.lchown(base / "link", OTHER_UID, OTHER_UID)
    conn = connection(tmp_path, control_path_dir=str(base / "link" / "cp"))

    with pytest.raises(AnsibleError, match=r"control_path_dir: .*/link is a symbolic link that a user other than root can change"):
        conn._ssh_argv()  # pylint: disable=protected-access

    assert not (base / "real" / "cp").exists()


def test_a_symlink_only_root_can_change_is_resolved_and_ssh_gets_the_resolved_directory(tmp_path):
    """An administrator's /home -> /srv/home: followed, and ssh is handed the path without the link, the
    one that was checked."""
    if os.geteuid() != 0:
        pytest.skip("a link only root can change needs root")
    base = short_dir().parent
    (base / "srv").mkdir(mode=0o755)
    (base / "home").symlink_to(base / "srv")
    conn = connection(tmp_path, control_path_dir=str(base / "home" / "cp"))

    used = Path(ssh_config(conn._ssh_argv())["controlpath"])  # pylint: disable=protected-access

    assert used.parent == base / "srv" / "cp" and (base / "srv" / "cp").stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("make", ["writable_by_all", "writable_by_group", "owned_by_another_user"])
def test_a_parent_another_user_can_rename_in_is_refused(tmp_path, make):
    base = short_dir().parent
    parent = base / "p"
    parent.mkdir(mode=0o755)
    (parent / "cp").mkdir(mode=0o700)  # the control directory itself is fine: its parent is not
    if make == "owned_by_another_user":
        other_users(parent)
    else:
        parent.chmod(0o777 if make == "writable_by_all" else 0o775)
    conn = connection(tmp_path, control_path_dir=str(parent / "cp"))

    with pytest.raises(AnsibleError, match=r"control_path_dir: .*/p \(on its path\) (is writable by other users|belongs to uid)"):
        conn._ssh_argv()  # pylint: disable=protected-access


def test_a_sticky_world_writable_parent_like_tmp_is_accepted(tmp_path):
    """In a sticky directory no one else may rename or remove an entry they do not own."""
    parent = short_dir().parent / "sticky"
    parent.mkdir()
    parent.chmod(0o1777)
    conn = connection(tmp_path, control_path_dir=str(parent / "cp"))

    argv = conn._ssh_argv()  # pylint: disable=protected-access

    assert Path(ssh_config(argv)["controlpath"]).parent == parent / "cp"
    assert (parent / "cp").stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("extra", ["-o ControlPath=/tmp/other/%C", "-oControlPath=/tmp/x", "-o 'controlpath /tmp/x'",
                                   "-S /tmp/x", "-S/tmp/x", "-TS /tmp/x", "-v -S /tmp/x"])
def test_a_control_path_of_its_own_in_ssh_extra_args_is_refused(tmp_path, extra):
    conn = connection(tmp_path, ssh_extra_args=extra)

    with pytest.raises(AnsibleError, match="ssh_extra_args must not set ControlPath"):
        conn._ssh_argv()  # pylint: disable=protected-access


@pytest.mark.parametrize("extra", ["-l Sam", "-J Sjump", "-o User=S", "-i /keys/S"])
def test_an_s_that_is_an_argument_is_not_a_control_path(tmp_path, extra):
    conn = connection(tmp_path, ssh_extra_args=extra)

    assert conn._ssh_argv()[-2:] == ["--", "pve1.example.org"]  # pylint: disable=protected-access


@pytest.mark.parametrize("persist", [0, 60])
def test_a_control_path_in_the_users_ssh_config_is_never_used(tmp_path, persist):
    """Where ~/.ssh/config (here a -F file) names a control socket in /tmp with %u, ssh would be a client
    of whatever master listens there, even with ControlMaster=no: the plugin's ControlPath overrides it."""
    config = tmp_path / "ssh_config"
    config.write_text("Host *\n  ControlMaster auto\n  ControlPath /tmp/pctcp-%u/%C\n", encoding="utf-8")
    conn = connection(tmp_path, persist=persist, ssh_extra_args=f"-F {config}")

    used = ssh_config(conn._ssh_argv()).get("controlpath")  # pylint: disable=protected-access

    if persist == 0:
        assert used is None  # ssh -G shows no control path at all for ControlPath=none
    else:
        assert used is not None and Path(used).parent == SHORT_DIRS[-1] / "cp"
