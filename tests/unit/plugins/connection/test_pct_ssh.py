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
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from ansible.errors import AnsibleConnectionFailure, AnsibleError
from ansible.playbook.play_context import PlayContext
from ansible.plugins.loader import connection_loader, init_plugin_loader

REPO = Path(__file__).resolve().parents[4]
PLUGIN_DIR = REPO / "plugins" / "connection"


@pytest.fixture(scope="module", autouse=True)
def _plugin_loader() -> None:
    init_plugin_loader([])
    connection_loader.add_directory(str(PLUGIN_DIR))


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

    with pytest.raises(AnsibleError, match="control_path_dir .* is too long for a control socket .at most 49 bytes"):
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
    assert "ControlPath" not in values and "ControlPersist" not in values
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
    shared = tmp_path / "cp"
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
