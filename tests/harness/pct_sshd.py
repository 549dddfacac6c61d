"""A real sshd on 127.0.0.1 that answers ``/usr/sbin/pct exec VMID -- CMD`` like a Proxmox node.

community.proxmox.proxmox_pct_remote logs in over SSH (paramiko) and runs the hard-coded
``/usr/sbin/pct exec <vmid> -- <cmd>``. This harness lets that production path run here without
touching /usr/sbin:

- its own sshd (config, host key, ``PidFile`` and ``AuthorizedKeysFile`` in a private directory,
  a free port on 127.0.0.1, key login for root only), started in the foreground and stopped by
  its recorded pid;
- a ``ForceCommand`` script that replaces a leading ``/usr/sbin/pct `` of the client's command
  with a ``pct`` shim in the same directory and refuses anything else;
- the shim: ``pct exec VMID -- CMD...`` is ``lxc-attach -P LXCPATH -n VMID --clear-env -- CMD...``
  (what ``pct exec`` runs on a node), for the containers registered with :meth:`PctSshd.register`;
  every other verb fails with a message that says so. It counts its invocations: each appends one
  line ``VERB VMID`` to a file in the private directory (:meth:`PctSshd.pct_calls`), so a test can
  tell how many ``pct exec`` a play cost;
- a client key pair made for this session and a HOME directory whose ``.ssh/known_hosts`` already
  holds the server's host key, so the plugin can check the host key without prompting.

    with pct_sshd(tmp_path / "sshd") as sshd:
        sshd.register(200, lab.container.lxcpath)
        inventory = {"all": {"hosts": {"gpu-train-01": sshd.host_vars(200)}}}
        run_playbook(..., env=sshd.environment())

(or import the session-scoped ``pct_ssh`` pytest fixture).

The same sshd serves this collection's own connection, gpuops.relaunch.pct_ssh (OpenSSH with
connection sharing): :meth:`PctSshd.pct_ssh_host_vars` gives its inventory variables, with the
control sockets in a directory the caller owns, and :func:`stop_shared_connections` ends the
shared connections (``ssh -O exit``) found there.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness.pidns import process_starttime
from tests.harness.procstates import wait_until

SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = "/run/sshd"
START_TIMEOUT = 30
STOP_TIMEOUT = 30

# sshd runs this instead of whatever the client asked for; the client's command line is in
# SSH_ORIGINAL_COMMAND. A real node's login shell would run that line, so the rewritten line is
# handed to a shell too: quoting and word splitting stay exactly as the plugin meant them.
FORCE_COMMAND = """#!/bin/sh
case "$SSH_ORIGINAL_COMMAND" in
    "/usr/sbin/pct "*)
        exec /bin/sh -c "{pct} ${{SSH_ORIGINAL_COMMAND#/usr/sbin/pct }}" ;;
    *)
        echo "pct_sshd: this test sshd runs only /usr/sbin/pct commands, not: $SSH_ORIGINAL_COMMAND" >&2
        exit 126 ;;
esac
"""

# Only `pct exec` is implemented; the container's lxcpath is looked up by vmid in {registry}.
# Every call, refused or not, appends "VERB VMID" to {calls} (one short line: an atomic append).
PCT_SHIM = """#!/bin/sh
printf '%s %s\\n' "${{1:-}}" "${{2:-}}" >> {calls}
if [ "$#" -lt 1 ] || [ "$1" != exec ]; then
    echo "pct (test shim): only 'pct exec VMID -- CMD...' is implemented, not 'pct $*'" >&2
    exit 255
fi
vmid=${{2:-}}
case "$vmid" in
    ''|*[!0-9]*)
        echo "pct (test shim): vmid: value '$vmid' does not look like a valid VM ID" >&2
        exit 255 ;;
esac
if [ ! -f "{registry}/$vmid" ]; then
    echo "pct (test shim): Configuration file 'nodes/localhost/lxc/$vmid.conf' does not exist" >&2
    exit 255
fi
shift 2
if [ "${{1:-}}" = -- ]; then
    shift
fi
exec lxc-attach -P "$(cat "{registry}/$vmid")" -n "$vmid" --clear-env -- "$@"
"""

SSHD_CONFIG = """# A test sshd for the pct_remote path: key login for root, every session runs ForceCommand.
ListenAddress 127.0.0.1
Port {port}
HostKey {host_key}
PidFile {pid_file}
AuthorizedKeysFile {authorized_keys}
AllowUsers root
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
# The files live under /tmp, which is world-writable: StrictModes would refuse them.
StrictModes no
PermitTTY yes
PrintMotd no
PrintLastLog no
X11Forwarding no
AllowTcpForwarding no
AllowAgentForwarding no
MaxStartups 100:30:200
ForceCommand {force_command}
LogLevel VERBOSE
"""


class SshdError(RuntimeError):
    """The test sshd could not be set up or started."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def answers_ssh(port: int) -> bool:
    """Whether an SSH server greets on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            return sock.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def _keygen(path: Path, comment: str) -> str:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True, capture_output=True, timeout=30,
    )
    return path.with_suffix(".pub").read_text(encoding="utf-8").strip()


def _write_executable(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
    path.chmod(0o755)


@dataclass
class PctSshd:
    """A running test sshd and what a proxmox_pct_remote client needs to use it."""

    directory: Path
    port: int
    pid: int
    starttime: int
    client_key: Path
    home: Path
    process: subprocess.Popen | None = None

    @property
    def registry(self) -> Path:
        return self.directory / "containers"

    @property
    def log_path(self) -> Path:
        return self.directory / "sshd.log"

    @property
    def calls_path(self) -> Path:
        return self.directory / "pct-calls"

    @property
    def known_hosts(self) -> Path:
        """The known_hosts file that holds (only) this server's host key."""
        return self.home / ".ssh" / "known_hosts"

    def pct_call_log(self) -> list[str]:
        """One ``VERB VMID`` entry per ``pct`` invocation so far, oldest first."""
        try:
            return self.calls_path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []

    def pct_calls(self, verb: str = "exec", vmid: int | None = None) -> int:
        """How many times `pct VERB` (for container `vmid`, or any) ran so far."""
        return sum(
            1 for line in self.pct_call_log()
            if line.split(" ")[0] == verb and (vmid is None or line.split(" ")[1:] == [str(vmid)])
        )

    def register(self, vmid: int, lxcpath: str) -> None:
        """`pct exec VMID` reaches the LXC container named VMID in `lxcpath` (as on a node)."""
        (self.registry / str(int(vmid))).write_text(lxcpath, encoding="utf-8")

    def unregister(self, vmid: int) -> None:
        (self.registry / str(int(vmid))).unlink(missing_ok=True)

    def host_vars(self, vmid: int) -> dict[str, object]:
        """Inventory variables of a host that is container `vmid`, reached the production way."""
        return {
            "ansible_connection": "community.proxmox.proxmox_pct_remote",
            "ansible_host": "127.0.0.1",
            "ansible_port": self.port,
            "ansible_user": "root",
            "ansible_private_key_file": str(self.client_key),
            "proxmox_vmid": int(vmid),
            # The host key is really checked (against the pre-seeded known_hosts), whatever
            # ansible.cfg says.
            "ansible_host_key_checking": True,
            "ansible_python_interpreter": "/usr/bin/python3",
        }

    def pct_ssh_host_vars(self, vmid: int, control_path_dir: str | os.PathLike) -> dict[str, object]:
        """Inventory variables of a host that is container `vmid`, reached with gpuops.relaunch.pct_ssh.

        The host key is checked by the plugin's default against this server's known_hosts file
        (OpenSSH reads ``~`` from the password database, not from HOME, so the file is named)."""
        return {
            "ansible_connection": "gpuops.relaunch.pct_ssh",
            "ansible_host": "127.0.0.1",
            "ansible_port": self.port,
            "ansible_user": "root",
            "ansible_private_key_file": str(self.client_key),
            "ansible_pct_ssh_known_hosts_file": str(self.known_hosts),
            "ansible_pct_ssh_control_path_dir": str(control_path_dir),
            "proxmox_vmid": int(vmid),
            "ansible_python_interpreter": "/usr/bin/python3",
        }

    def environment(self) -> dict[str, str]:
        """Environment for ansible-playbook: HOME holds .ssh/known_hosts with this server's key."""
        return {"HOME": str(self.home)}

    def running(self) -> bool:
        return process_starttime(self.pid) == self.starttime

    def log(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to the recorded sshd (only if it is still that process), then wait until it is gone.

        Sessions that are still open have their own processes, which end when the listener's
        connections close; the listener is the only process this harness started.
        """
        if self.running():
            os.kill(self.pid, signal.SIGTERM)
        if self.process is not None:
            # Our own child: waiting reaps it (a zombie would still look like the recorded process).
            self.process.wait(timeout=STOP_TIMEOUT)
        wait_until(lambda: not self.running(), timeout=STOP_TIMEOUT, what=f"sshd {self.pid} to stop")


def _start(directory: Path, sshd_config: Path, port: int) -> subprocess.Popen:
    # -D: stay in the foreground, so the pid is the one Popen knows; -E: log to a file.
    return subprocess.Popen(  # pylint: disable=consider-using-with
        [SSHD, "-D", "-f", str(sshd_config), "-E", str(directory / "sshd.log")],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


@contextmanager
def pct_sshd(directory: str | os.PathLike) -> Iterator[PctSshd]:
    """Start the test sshd in `directory` (created); stop it by its pid when the block ends."""
    if not os.path.exists(SSHD):
        raise SshdError(f"{SSHD} is missing: install openssh-server (make apt)")
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "containers").mkdir(exist_ok=True)
    os.makedirs(PRIVSEP_DIR, mode=0o755, exist_ok=True)

    host_key = directory / "ssh_host_ed25519_key"
    host_public = _keygen(host_key, "pct-sshd host key")
    client_key = directory / "client_ed25519"
    client_public = _keygen(client_key, "pct-sshd client key")
    authorized_keys = directory / "authorized_keys"
    authorized_keys.write_text(client_public + "\n", encoding="utf-8")
    authorized_keys.chmod(0o600)

    pct = directory / "pct"
    _write_executable(pct, PCT_SHIM.format(registry=shlex.quote(str(directory / "containers")),
                                           calls=shlex.quote(str(directory / "pct-calls"))))
    force_command = directory / "pct-forcecommand"
    _write_executable(force_command, FORCE_COMMAND.format(pct=shlex.quote(str(pct))))

    home = directory / "home"
    (home / ".ssh").mkdir(parents=True, exist_ok=True, mode=0o700)

    process: subprocess.Popen | None = None
    sshd: PctSshd | None = None
    try:
        for _attempt in range(5):
            port = free_port()
            sshd_config = directory / "sshd_config"
            sshd_config.write_text(
                SSHD_CONFIG.format(
                    port=port, host_key=host_key, pid_file=directory / "sshd.pid",
                    authorized_keys=authorized_keys, force_command=force_command,
                ),
                encoding="utf-8",
            )
            test = subprocess.run([SSHD, "-t", "-f", str(sshd_config)], capture_output=True, text=True,
                                  timeout=30, check=False)
            if test.returncode != 0:
                raise SshdError(f"sshd -t rejects {sshd_config}: {test.stderr.strip()}")
            process = _start(directory, sshd_config, port)
            starttime = process_starttime(process.pid)
            if starttime is None:
                raise SshdError(f"sshd exited at once: {process.wait()}")
            sshd = PctSshd(directory, port, process.pid, starttime, client_key, home, process)
            wait_until(lambda: answers_ssh(port) or process.poll() is not None, timeout=START_TIMEOUT,
                       what=f"sshd to answer on 127.0.0.1:{port}")
            if process.poll() is None:
                break
            # Someone took the port between the look and the bind: try another one.
            sshd = None
            process = None
        if sshd is None:
            raise SshdError(f"sshd did not start: {(directory / 'sshd.log').read_text(errors='replace')[-2000:]}")
        (home / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{sshd.port} {host_public}\n", encoding="utf-8")
        yield sshd
    finally:
        if sshd is not None:
            sshd.stop()


def shared_connections(control_path_dir: str | os.PathLike) -> list[Path]:
    """The control sockets of the OpenSSH shared connections in `control_path_dir`."""
    directory = Path(control_path_dir)
    if not directory.is_dir():
        return []
    return sorted(path for path in directory.iterdir() if path.is_socket())


def stop_shared_connections(control_path_dir: str | os.PathLike) -> None:
    """End every shared connection (ControlMaster) whose socket is in `control_path_dir`:
    ``ssh -O exit`` through its own socket (no signal, no pattern), then wait until it is gone."""
    for socket_path in shared_connections(control_path_dir):
        subprocess.run(
            ["ssh", "-o", f"ControlPath={socket_path}", "-O", "exit", "--", "pct-sshd-master"],
            stdin=subprocess.DEVNULL, capture_output=True, timeout=STOP_TIMEOUT, check=False,
        )
    wait_until(lambda: not shared_connections(control_path_dir), timeout=STOP_TIMEOUT,
               what=f"the shared ssh connections in {control_path_dir} to end")


@pytest.fixture(scope="session")
def pct_ssh(tmp_path_factory) -> Iterator[PctSshd]:
    """pytest fixture: one test sshd (and one client key pair) for the whole test session.
    Tests register their containers (``pct_ssh.register(vmid, lxcpath)``) and unregister them.
    Import it into a test module to use it."""
    with pct_sshd(tmp_path_factory.mktemp("pct-sshd")) as sshd:
        yield sshd
