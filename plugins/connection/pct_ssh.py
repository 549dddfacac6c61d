# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r"""
name: pct_ssh
short_description: Run tasks in a Proxmox LXC container with C(pct exec) over one shared OpenSSH connection to its node
version_added: 0.1.0
description:
  - Reaches a Proxmox VE LXC container through its node, the way operators do by hand
    (C(ssh node pct exec VMID -- ...)), with the system OpenSSH client.
  - Every remote action is exactly one C(ssh) invocation that runs one
    C(pct exec VMID -- /bin/sh -c COMMAND) on the node. With pipelining (on by default here) a
    module task is one such exec, the module fed on its standard input; no temporary files are
    written in the container for it.
  - The C(ssh) invocations share one authenticated connection to the node (OpenSSH connection
    sharing, C(ControlMaster=auto) and C(ControlPersist)), so after the first task a task costs no
    SSH handshake. All containers of one node (same address, port and user) share that connection.
    The control socket lives in O(control_path_dir), a directory private to the controller's user.
  - Files are copied into and out of the container through the same connection
    (C(pct exec VMID -- /bin/sh -c 'cat > PATH') with the file on standard input, and
    C(cat PATH) for a fetch), so M(ansible.builtin.copy), M(ansible.builtin.template) and
    M(ansible.builtin.fetch) work inside the container; C(pct push) and C(pct pull) are not used.
  - The node's host key is checked by default (C(StrictHostKeyChecking=yes)), independently of
    Ansible's global C(host_key_checking) setting; see O(host_key_checking).
  - Authentication is by key or by an SSH agent only (C(BatchMode=yes)). Passwords are neither
    asked for nor passed to C(ssh); C(ansible_password) is ignored. Nothing this plugin logs names
    the private key file, at any verbosity, and for a task with C(no_log) the command line it logs
    at C(-vvv) leaves out the command run in the container.
author:
  - gpuops.relaunch maintainers (@gpuops)
requirements:
  - The OpenSSH client (C(ssh)) on the controller.
  - On the node, O(remote_user) may run C(pct exec) (as a rule, C(root)).
  - In the container, C(/bin/sh) and C(cat).
options:
  remote_addr:
    description:
      - Address of the Proxmox node the container runs on (not of the container).
    type: string
    default: inventory_hostname
    vars:
      - name: inventory_hostname
      - name: ansible_host
      - name: ansible_ssh_host
      - name: ansible_pct_ssh_host
  port:
    description:
      - SSH port of the node. Unset, C(ssh) decides (its configuration, or 22).
    type: int
    ini:
      - section: defaults
        key: remote_port
    env:
      - name: ANSIBLE_REMOTE_PORT
    vars:
      - name: ansible_port
      - name: ansible_ssh_port
    keyword:
      - name: port
  remote_user:
    description:
      - User to log in to the node as. It must be allowed to run C(pct exec); tasks then run as
        C(root) inside the container, so no C(become) is needed there.
    type: string
    default: root
    ini:
      - section: defaults
        key: remote_user
    env:
      - name: ANSIBLE_REMOTE_USER
    vars:
      - name: ansible_user
      - name: ansible_ssh_user
    keyword:
      - name: remote_user
  vmid:
    description:
      - ID of the LXC container on the node (what C(pct exec) takes).
    type: int
    required: true
    vars:
      - name: proxmox_vmid
      - name: ansible_pct_ssh_vmid
  private_key_file:
    description:
      - Private key to log in to the node with (C(IdentityFile), with C(IdentitiesOnly=yes)).
        Unset, C(ssh) uses its configuration, its default keys and the agent.
      - The path is never written to Ansible's output.
    type: path
    ini:
      - section: defaults
        key: private_key_file
    env:
      - name: ANSIBLE_PRIVATE_KEY_FILE
    vars:
      - name: ansible_private_key_file
      - name: ansible_ssh_private_key_file
    cli:
      - name: private_key_file
        option: '--private-key'
  host_key_checking:
    description:
      - Whether the node's host key must already be known (C(StrictHostKeyChecking=yes)); an unknown
        or changed key then fails the connection.
      - V(false) is C(StrictHostKeyChecking=no), which accepts an unknown key (and records it).
        For C(accept-new) (accept and record an unknown key, refuse a changed one), put
        C(-o StrictHostKeyChecking=accept-new) in O(ssh_extra_args).
      - Deliberately not read from Ansible's global C(host_key_checking) setting (or
        E(ANSIBLE_HOST_KEY_CHECKING)), so that turning checks off for other hosts does not turn
        them off for Proxmox nodes.
    type: boolean
    default: true
    ini:
      - section: pct_ssh_connection
        key: host_key_checking
    env:
      - name: ANSIBLE_PCT_SSH_HOST_KEY_CHECKING
    vars:
      - name: ansible_host_key_checking
      - name: ansible_pct_ssh_host_key_checking
  known_hosts_file:
    description:
      - Known hosts file to check the node's key against (C(UserKnownHostsFile)). Unset, C(ssh)'s
        default (C(~/.ssh/known_hosts) of the controller's user, then the system-wide file).
    type: path
    ini:
      - section: pct_ssh_connection
        key: known_hosts_file
    env:
      - name: ANSIBLE_PCT_SSH_KNOWN_HOSTS_FILE
    vars:
      - name: ansible_pct_ssh_known_hosts_file
  ssh_executable:
    description:
      - The OpenSSH client to run.
    type: string
    default: ssh
    ini:
      - section: pct_ssh_connection
        key: ssh_executable
    env:
      - name: ANSIBLE_PCT_SSH_EXECUTABLE
    vars:
      - name: ansible_pct_ssh_executable
  ssh_extra_args:
    description:
      - Further arguments for C(ssh) (for example C(-o ServerAliveInterval=15) or C(-J jumphost)).
        They are split as a shell would split them, and shown at verbosity C(-vvv), so do not put
        secrets in them.
      - They come before the plugin's own C(-o) options, and C(ssh) keeps the first value it is
        given for an option, so an option here wins over the plugin's (for example
        C(-o StrictHostKeyChecking=accept-new), or another C(ControlPersist)).
      - Except C(ControlPath) (C(-o ControlPath=...) or C(-S)), which is refused. The control socket
        lives where O(control_path_dir) says, in a directory that was checked.
    type: string
    default: ''
    ini:
      - section: pct_ssh_connection
        key: ssh_extra_args
    env:
      - name: ANSIBLE_PCT_SSH_EXTRA_ARGS
    vars:
      - name: ansible_ssh_extra_args
      - name: ansible_pct_ssh_extra_args
  pct_path:
    description:
      - Path of C(pct) on the node.
    type: string
    default: /usr/sbin/pct
    ini:
      - section: pct_ssh_connection
        key: pct_path
    env:
      - name: ANSIBLE_PCT_SSH_PCT_PATH
    vars:
      - name: ansible_pct_ssh_pct_path
  control_path_dir:
    description:
      - Directory of the shared connections' control sockets. Created with mode C(0700) when
        missing; refused unless it is a directory (not a link) of this user that no one else has
        any access to (mode C(0700) or stricter).
      - Every directory above it, from C(/) down, must be a real directory that belongs to C(root) or
        to this user and that no other user may write to, unless it has the sticky bit (as C(/tmp)
        has). Otherwise another user could rename the directory and put one of their own, with their
        own control socket, in its place. Missing directories are created with mode C(0700).
      - A symlink on the way is followed only where only C(root) can change it (an administrator's
        C(/home -> /srv/home)), and C(ssh) is then given the path without it, the one that was
        checked; any other symlink is refused.
      - Taken literally. A C(%) or a C($) in it fails the task, naming this option, because ssh would
        expand its tokens (C(%u), C(%h), ...) and C(${VARIABLE}) and use a directory that was never
        checked. So do quotes, backslashes and control characters.
      - The plugin's own C(ControlPath) is the only one; a C(ControlPath) option or C(-S) in
        O(ssh_extra_args) is refused.
      - Each socket is named by OpenSSH's C(%C) hash of the connection (local host, node, port,
        user). A Unix socket's path is limited to 107 bytes, so the directory may be at most 49 bytes long.
    type: path
    default: ~/.ansible/pct_ssh
    ini:
      - section: pct_ssh_connection
        key: control_path_dir
    env:
      - name: ANSIBLE_PCT_SSH_CONTROL_PATH_DIR
    vars:
      - name: ansible_pct_ssh_control_path_dir
  persist:
    description:
      - Seconds the shared connection to a node stays open after its last use (C(ControlPersist)).
      - V(0) turns connection sharing off; then every remote action logs in anew. Not even a control
        socket named in the user's ssh configuration is used then (C(ControlPath=none)).
    type: int
    default: 60
    ini:
      - section: pct_ssh_connection
        key: persist
    env:
      - name: ANSIBLE_PCT_SSH_PERSIST
    vars:
      - name: ansible_pct_ssh_persist
  timeout:
    description:
      - Seconds to wait for the TCP connection to the node (C(ConnectTimeout)).
    type: int
    default: 10
    ini:
      - section: defaults
        key: timeout
    env:
      - name: ANSIBLE_TIMEOUT
    vars:
      - name: ansible_ssh_timeout
      - name: ansible_pct_ssh_timeout
    cli:
      - name: timeout
  pipelining:
    description:
      - Whether a module is fed to the interpreter on standard input (one remote exec per module
        task) instead of being copied to a temporary file first.
      - On by default for this connection. It is not used with C(become) methods that do not
        support it, with C(async) tasks, or when C(ANSIBLE_KEEP_REMOTE_FILES) is set.
    type: boolean
    default: true
    ini:
      - section: defaults
        key: pipelining
      - section: connection
        key: pipelining
      - section: pct_ssh_connection
        key: pipelining
    env:
      - name: ANSIBLE_PIPELINING
      - name: ANSIBLE_PCT_SSH_PIPELINING
    vars:
      - name: ansible_pipelining
      - name: ansible_pct_ssh_pipelining
notes:
  - Tasks run as C(root) in the container (what C(pct exec) gives). C(become) to another user
    inside works only when it needs no password.
  - An exit status of 255 is how both C(ssh) and C(pct) report that they could not reach the
    container; the plugin reports it as an unreachable host, with C(ssh)'s or C(pct)'s message
    (for example that the container's configuration file does not exist on the node).
  - M(ansible.builtin.meta) C(reset_connection) asks the shared connection to the node to stop
    (C(ssh -O stop)); it closes once its running sessions end, and the next task opens a new one.
    To end it at once, run C(ssh -O exit -o ControlPath=DIR/HASH node).
seealso:
  - name: community.proxmox.proxmox_pct_remote
    description: The same path (C(pct exec) through the node) with paramiko, one SSH login per task.
    link: https://docs.ansible.com/ansible/latest/collections/community/proxmox/proxmox_pct_remote_connection.html
"""

EXAMPLES = r"""
# Inventory (YAML): containers 200 and 201 on node pve1, reached as root with a key.
# all:
#   children:
#     gpu_containers:
#       vars:
#         ansible_connection: gpuops.relaunch.pct_ssh
#         ansible_host: pve1.example.org
#         ansible_user: root
#         ansible_private_key_file: ~/.ssh/pve_ed25519
#         ansible_python_interpreter: /usr/bin/python3
#       hosts:
#         gpu-train-01:
#           proxmox_vmid: 200
#         gpu-train-02:
#           proxmox_vmid: 201

- name: Run inside the containers
  hosts: gpu_containers
  gather_facts: false
  tasks:
    - name: One pct exec for this module task
      ansible.builtin.command: nvidia-smi -L
      changed_when: false

    - name: Files go into the container
      ansible.builtin.template:
        src: train.env.j2
        dest: /etc/default/train
        mode: "0640"
"""

import getopt
import os
import selectors
import shlex
import subprocess
import threading
import typing as t
import unicodedata

from ansible.errors import AnsibleConnectionFailure, AnsibleError, AnsibleFileNotFound
from ansible.module_utils.common.text.converters import to_bytes, to_text
from ansible.plugins.connection import ConnectionBase
from ansible.utils.display import Display

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.private_dir import (
    NO_ACCESS_FOR_OTHERS,
    check_private_dir,
    resolve_dir,
)

display = Display()

# ssh exits 255 when it could not run the command; pct exits 255 when it could not reach the container.
UNREACHABLE_RC = 255
READ_SIZE = 65536
REDACTED_KEY = "<private key file>"


# 107 bytes of sun_path, less "/" + 40 hex digits of %C + "." + 16 characters of ssh's temporary name.
MAX_CONTROL_DIR_BYTES = 107 - 58
# What ssh expands or parses in a ControlPath: %-tokens, ${VARIABLES}, quotes and backslash escapes.
SSH_EXPANDED = frozenset("%$\"'\\")
# ssh's own getopt string (OpenSSH 9.x): which options take an argument, so that -S is found
# wherever it is (-S path, -Spath, -TS path) and a user name or path that holds an S is not.
SSH_GETOPT = "1246ab:c:e:fgi:kl:m:no:p:qstvxAB:CD:E:F:GI:J:KL:MNO:PQ:R:S:TVw:W:XYy"


class Connection(ConnectionBase):
    """Tasks in a Proxmox LXC container: one ``ssh NODE pct exec VMID -- /bin/sh -c CMD`` per action,
    over an OpenSSH connection shared between tasks (ControlMaster/ControlPersist)."""

    transport = "gpuops.relaunch.pct_ssh"
    has_pipelining = True
    # Would make a module's stdin a terminal: pipelining needs it to be the module.
    has_tty = False

    def __init__(self, *args: t.Any, **kwargs: t.Any) -> None:
        super().__init__(*args, **kwargs)
        self._control_dir: str | None = None

    # ------------------------------------------------------------------------------- options

    def _vmid(self) -> int:
        vmid = self.get_option("vmid")
        if vmid is None:
            raise AnsibleError("gpuops.relaunch.pct_ssh needs the container's vmid (proxmox_vmid)")
        if int(vmid) <= 0:
            raise AnsibleError(f"gpuops.relaunch.pct_ssh: vmid must be a positive integer, not {vmid}")
        return int(vmid)

    def _node(self) -> str:
        return to_text(self.get_option("remote_addr"))

    def _where(self) -> str:
        user = self.get_option("remote_user")
        port = self.get_option("port")
        node = f"{user}@{self._node()}" if user else self._node()
        return f"{node}:{port}" if port else node

    def _private_control_dir(self) -> str:
        """The control socket directory ssh is to use: taken literally, root's symlinks on the way resolved
        (so that the path ssh opens is the one checked), walked from / and private to this user (made 0700
        where missing); AnsibleError naming control_path_dir otherwise."""
        given = to_text(self.get_option("control_path_dir"))
        try:
            if any(char in given for char in SSH_EXPANDED) or any(unicodedata.category(char) == "Cc" for char in given):
                # ssh expands %u, %h, ${HOME} ... in a ControlPath and parses quotes and backslashes: the
                # directory it used would not be the one checked here, and could be another user's.
                raise BadOption(
                    "control_path_dir",
                    f"{given!r} must not contain %, $, quotes, backslashes or control characters: ssh would expand"
                    " %-tokens (%u, %h, ...) and ${VARIABLES} in it and use a directory that was never checked;"
                    " give the directory literally (for example ~/.ansible/pct_ssh)",
                )
            path = resolve_dir("control_path_dir", given)
            if len(os.fsencode(path)) > MAX_CONTROL_DIR_BYTES:
                # ssh names the socket DIR/%C (40 hex digits) and first binds DIR/%C.<16 random
                # characters>: a longer directory fails later with "too long for Unix domain socket".
                raise BadOption(
                    "control_path_dir",
                    f"{path} is too long for a control socket (at most {MAX_CONTROL_DIR_BYTES} bytes: a Unix"
                    " socket's path is limited to 107); choose a shorter directory",
                )
            check_private_dir("control_path_dir", path, NO_ACCESS_FOR_OTHERS)
        except BadOption as exc:
            raise AnsibleError(f"gpuops.relaunch.pct_ssh: {exc}") from None
        return path

    def _extra_args(self) -> list[str]:
        """ssh_extra_args, split as a shell would; AnsibleError if they set a control path of their own."""
        args = self._split_ssh_args(to_text(self.get_option("ssh_extra_args") or ""))
        if _sets_control_path(args):
            raise AnsibleError(
                "gpuops.relaunch.pct_ssh: ssh_extra_args must not set ControlPath (-o ControlPath=... or -S):"
                " the plugin's control sockets live in control_path_dir, which it checks; set that instead"
            )
        return args

    def _ssh_argv(self, *control: str) -> list[str]:
        """The ssh command line up to and including the node's address (a control command like
        ``-O stop`` comes in front of the address)."""
        # The extra arguments come first: ssh keeps the first value it is given for an option, so
        # theirs win over the plugin's own.
        argv = [to_text(self.get_option("ssh_executable")), "-T"]
        argv += self._extra_args()
        options = {
            "BatchMode": "yes",
            "StrictHostKeyChecking": "yes" if self.get_option("host_key_checking") else "no",
            "ConnectTimeout": str(int(self.get_option("timeout"))),
        }
        persist = int(self.get_option("persist"))
        if persist > 0:
            if self._control_dir is None:
                self._control_dir = self._private_control_dir()
            options.update(
                ControlMaster="auto",
                ControlPersist=f"{persist}s",
                ControlPath=os.path.join(self._control_dir, "%C"),
            )
        else:
            # "none", not unset: a ControlPath from the user's ssh_config (in /tmp, with %u, say) would
            # still make ssh a client of whatever master listens there.
            options.update(ControlMaster="no", ControlPath="none")
        known_hosts = self.get_option("known_hosts_file")
        if known_hosts:
            options["UserKnownHostsFile"] = os.path.expanduser(to_text(known_hosts))
        key = self.get_option("private_key_file")
        if key:
            options["IdentityFile"] = os.path.expanduser(to_text(key))
            options["IdentitiesOnly"] = "yes"
        for name, value in options.items():
            argv += ["-o", f'{name}="{value}"' if " " in value else f"{name}={value}"]
        port = self.get_option("port")
        if port:
            argv += ["-p", str(int(port))]
        user = self.get_option("remote_user")
        if user:
            argv += ["-l", to_text(user)]
        argv += list(control)
        argv += ["--", self._node()]
        return argv

    def _redact(self, text: str) -> str:
        """`text` without the private key file's path (as given, and expanded)."""
        key = self.get_option("private_key_file")
        if key:
            for form in (os.path.expanduser(to_text(key)), to_text(key)):
                text = text.replace(form, REDACTED_KEY)
        return text

    def _shown(self, argv: list[str], command: bool = False) -> str:
        """A command line fit for the log: the private key file is never named, and the command
        (the last word when `command`) is hidden for a task with ``no_log``."""
        if command and getattr(self._play_context, "no_log", False):
            argv = argv[:-1] + ["<command hidden: no_log>"]
        return self._redact(" ".join(shlex.quote(arg) for arg in argv))

    def _pct_exec(self, script: str) -> str:
        """The command line the node runs: ``pct exec VMID -- /bin/sh -c SCRIPT``, quoted for the
        node's login shell, so that all of SCRIPT runs in the container and none of it on the node."""
        pct = to_text(self.get_option("pct_path"))
        return " ".join(shlex.quote(word) for word in (pct, "exec", str(self._vmid()), "--", "/bin/sh", "-c", script))

    # ------------------------------------------------------------------------------- running

    def _run(self, script: str, stdin: t.Any = None, stdout_file: t.Any = None) -> tuple[int, bytes, bytes]:
        """One ssh invocation that runs `script` in the container. `stdin` is bytes, a file opened
        for reading, or None (no input); `stdout_file` a file opened for writing, or None (collected)."""
        remote = self._pct_exec(script)
        argv = self._ssh_argv() + [remote]
        display.vvv(f"SSH: {self._shown(argv, command=True)}", host=self._node())
        if stdin is None:
            stdin_arg: t.Any = subprocess.DEVNULL
        elif isinstance(stdin, bytes):
            stdin_arg = subprocess.PIPE
        else:
            stdin_arg = stdin
        try:
            process = subprocess.Popen(  # pylint: disable=consider-using-with
                argv, stdin=stdin_arg, stdout=stdout_file if stdout_file is not None else subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        except OSError as exc:
            raise AnsibleConnectionFailure(f"gpuops.relaunch.pct_ssh: cannot run {argv[0]}: {exc}") from exc
        writer = None
        if isinstance(stdin, bytes):
            writer = threading.Thread(target=_feed, args=(process.stdin, stdin), daemon=True)
            writer.start()
        out, err = _collect(process)
        if writer is not None:
            writer.join()
        return process.returncode, out, err

    def _check_reached(self, rc: int, stderr: bytes) -> None:
        """Exit 255: ssh could not log in or run pct, or pct could not reach the container."""
        if rc != UNREACHABLE_RC:
            return
        message = self._redact(to_text(stderr, errors="surrogate_or_replace").strip())
        raise AnsibleConnectionFailure(
            f"gpuops.relaunch.pct_ssh: could not run pct exec in container {self._vmid()} through {self._where()} "
            f"(exit {rc}): {message or 'no message'}"
        )

    # ------------------------------------------------------------------------ the plugin API

    def _connect(self) -> Connection:
        if not self._connected:
            display.vvv(
                f"ESTABLISH PCT_SSH CONNECTION TO CONTAINER {self._vmid()} THROUGH {self._where()}", host=self._node()
            )
            self._connected = True
        return self

    def exec_command(self, cmd: str, in_data: bytes | None = None, sudoable: bool = True) -> tuple[int, bytes, bytes]:
        super().exec_command(cmd, in_data=in_data, sudoable=sudoable)
        if sudoable and self.become and self.become.expect_prompt():
            raise AnsibleError(
                "gpuops.relaunch.pct_ssh does not answer become password prompts: tasks already run as root in "
                "the container; use become only with a method that needs no password"
            )
        rc, out, err = self._run(cmd, stdin=in_data)
        self._check_reached(rc, err)
        return rc, out, err

    def put_file(self, in_path: str, out_path: str) -> None:
        super().put_file(in_path, out_path)
        display.vvv(f"PUT {in_path} TO {out_path} IN CONTAINER {self._vmid()}", host=self._node())
        if not os.path.isfile(to_bytes(in_path, errors="surrogate_or_strict")):
            raise AnsibleFileNotFound(f"file or module does not exist: {in_path}")
        with open(to_bytes(in_path, errors="surrogate_or_strict"), "rb") as source:
            rc, out, err = self._run(f"cat > {shlex.quote(out_path)}", stdin=source)
        self._check_reached(rc, err)
        if rc != 0:
            raise AnsibleError(
                f"failed to transfer {in_path} to {out_path} in container {self._vmid()} (exit {rc}): "
                f"{to_text(out + err, errors='surrogate_or_replace').strip()}"
            )

    def fetch_file(self, in_path: str, out_path: str) -> None:
        super().fetch_file(in_path, out_path)
        display.vvv(f"FETCH {in_path} FROM CONTAINER {self._vmid()} TO {out_path}", host=self._node())
        target = to_bytes(out_path, errors="surrogate_or_strict")
        with open(target, "wb") as sink:
            rc, _out, err = self._run(f"cat -- {shlex.quote(in_path)}", stdout_file=sink)
        if rc != 0:
            os.unlink(target)
        self._check_reached(rc, err)
        if rc != 0:
            raise AnsibleError(
                f"failed to fetch {in_path} from container {self._vmid()} (exit {rc}): "
                f"{to_text(err, errors='surrogate_or_replace').strip()}"
            )

    def reset(self) -> None:
        """Ask the node's shared connection to stop: it stops taking new sessions and ends when its
        running ones do (other containers' tasks on the same node are not cut off)."""
        if int(self.get_option("persist")) > 0:
            argv = self._ssh_argv("-O", "stop")
            display.vvv(f"SSH CONTROL: {self._shown(argv)}", host=self._node())
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, check=False)
            if proc.returncode != 0:
                display.vvv(
                    f"no shared connection to stop: {self._redact(to_text(proc.stderr, errors='surrogate_or_replace').strip())}",
                    host=self._node(),
                )
        self.close()

    def close(self) -> None:
        # The shared connection outlives the task on purpose (ControlPersist); nothing else is open.
        self._connected = False


def _sets_control_path(args: list[str]) -> bool:
    """Whether ssh arguments choose a control socket of their own (-o ControlPath, in any spelling, or -S)."""
    if any("controlpath" in arg.lower() for arg in args):
        return True
    try:
        options, _rest = getopt.gnu_getopt(args, SSH_GETOPT)
    except getopt.GetoptError:
        # An option this ssh's getopt string does not know (a newer ssh): judge by the words alone.
        return any(arg.startswith("-S") for arg in args)
    return any(name == "-S" for name, _value in options)


def _feed(pipe: t.IO[bytes], data: bytes) -> None:
    """Write `data` to the child's stdin and close it (a child that exits early is not an error here:
    its exit status says what happened)."""
    try:
        pipe.write(data)
    except (BrokenPipeError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except BrokenPipeError:
            pass


def _collect(process: subprocess.Popen) -> tuple[bytes, bytes]:
    """Read the child's stdout (if piped) and stderr until it exits.

    Not ``communicate()``: when this ssh starts the shared connection, the master it leaves behind
    could hold a copy of stderr (ssh's own debug logging does that), and an end of file would then
    only come when the master ends. So once the child has exited, what is already in the pipes is
    read and the rest is not waited for."""
    chunks: dict[int, list[bytes]] = {}
    streams = [stream for stream in (process.stdout, process.stderr) if stream is not None]
    with selectors.DefaultSelector() as selector:
        for stream in streams:
            chunks[stream.fileno()] = []
            selector.register(stream.fileno(), selectors.EVENT_READ)
        while selector.get_map():
            exited = process.poll() is not None
            events = selector.select(timeout=0 if exited else 1.0)
            if not events and exited:
                break
            for key, _mask in events:
                data = os.read(key.fd, READ_SIZE)
                if data:
                    chunks[key.fd].append(data)
                else:
                    selector.unregister(key.fd)
    process.wait()
    out = b"".join(chunks[process.stdout.fileno()]) if process.stdout is not None else b""
    err = b"".join(chunks[process.stderr.fileno()]) if process.stderr is not None else b""
    for stream in streams:
        stream.close()
    return out, err
