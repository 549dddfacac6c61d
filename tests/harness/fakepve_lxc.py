"""A Proxmox VE API (fakepve) over real HTTPS, whose containers are real LXC containers.

fakepve (PyPI, AGPL) is used as a test dependency only: this file imports it, subclasses two of its
classes and copies nothing from it. What is added here:

- a real CA: a CA certificate signs the server certificate, and clients verify against the CA file
  (``ca_path``), as they would against a cluster's ``pve-root-ca.pem``;
- the fake on its own event loop in a thread, with thread-safe ways to change its state while a
  client (ansible-playbook in a subprocess) talks to it;
- a bridge: every time the fake sets a container's status inside a task (start, stop, shutdown,
  reboot), the real LXC container is started (``lxc-start``) or killed (``lxc-stop -k``), and the
  fake reports the real init pid. So an API reboot really ends every process in the container;
- hooks to lose the answer to a request the server did carry out, or to do something (expire
  the tickets, say) just before a request is handled.

The containers are real but light: a directory rootfs that bind-mounts the host's /usr and /etc
read-only, no network (``lxc.net.0.type = empty``), AppArmor unconfined, and an init that by default
never reaps (``sleep infinity``), so an orphan that dies inside stays a zombie until the container
stops. Each lives in a private lxcpath under a temporary directory, is named by its vmid as on a
PVE node (``pct exec`` is ``lxc-attach -n <vmid>``), and is destroyed by name at the end.

    with proxmox_lab(tmp_path, vmid=200, hostname="gpu01") as lab:
        zombie = lab.container.make_zombie()
        run_playbook(... gpuops.relaunch.proxmox_ct_reboot: lab.module_args(vmid=200, expected_hostname="gpu01"))
        assert not lab.container.exists(zombie)

(or import the ``pve_lab`` pytest fixture). ``lab.container`` runs things inside
(``attach``, ``start_process``, ``make_zombie``) and gives Ansible a way in (``nsenter_host_vars``);
``lab.server`` changes the fake while clients talk to it (``call``, ``later``, ``drop_answer``,
``before_request``, ``expire_tickets``) and shows what it saw (``requests``, ``tasks``).
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from fakepve import FakeCt, FakePve, TaskError

from tests.harness.pidns import nsenter_inventory, nsenter_vars, process_starttime
from tests.harness.procstates import host_pid, state_of, wait_until

LXC_TIMEOUT = 30
LOOP_CALL_TIMEOUT = 30

# Inits for the container. A PID namespace's init that never calls wait() keeps every orphan
# that dies inside as a zombie; the reaping one is the well-behaved contrast.
NON_REAPING_INIT = "#!/bin/sh\nexec /usr/bin/sleep infinity\n"
REAPING_INIT = """#!/usr/bin/python3
import os, signal
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
while True:
    signal.sigwaitinfo({signal.SIGCHLD})
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
"""
INITS = {"non-reaping": NON_REAPING_INIT, "reaping": REAPING_INIT}


# ---------------------------------------------------------------------------------- certificates


@dataclass(frozen=True)
class Pki:
    """A CA and a server certificate it signed (PEM files)."""

    ca_path: str
    cert_path: str
    key_path: str


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
            )
        )


def make_pki(directory: str | os.PathLike, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"), name: str = "pve") -> Pki:
    """A fresh CA (like a cluster's pve-root-ca.pem) and a server certificate for `hosts` signed by it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} test root CA {secrets.token_hex(4)}")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_path = directory / f"{name}-root-ca.pem"
    cert_path = directory / f"{name}-ssl.pem"
    key_path = directory / f"{name}-ssl.key"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key_path, server_key)
    return Pki(str(ca_path), str(cert_path), str(key_path))


# ------------------------------------------------------------------------------- LXC containers


class ContainerError(RuntimeError):
    """An lxc-* command failed."""


@dataclass(frozen=True)
class ProcId:
    """A process on the host, identified so that a reused pid is never mistaken for it."""

    pid: int
    starttime: int


def proc_id(pid: int) -> ProcId | None:
    starttime = process_starttime(pid)
    return ProcId(pid, starttime) if starttime is not None else None


def _children(pid: int) -> list[int]:
    """Host pids of the children of `pid` (all its threads' children)."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            out += [int(child) for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            continue
    return out


@dataclass
class LxcContainer:
    """A real LXC container with a private lxcpath, created, started, stopped and destroyed by name."""

    name: str
    lxcpath: str
    hostname: str
    init: str = "non-reaping"
    init_id: ProcId | None = None
    starts: int = 0

    @property
    def directory(self) -> Path:
        return Path(self.lxcpath) / self.name

    @property
    def rootfs(self) -> Path:
        return self.directory / "rootfs"

    def _lxc(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [tool, "-P", self.lxcpath, "-n", self.name, *args],
            capture_output=True, text=True, timeout=LXC_TIMEOUT, check=False,
        )
        if check and proc.returncode != 0:
            raise ContainerError(f"{tool} {self.name}: exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()}")
        return proc

    def create(self) -> None:
        """Write the rootfs skeleton and the LXC config."""
        if self.directory.exists():
            raise ContainerError(f"container {self.name} already exists in {self.lxcpath}")
        for sub in ("usr", "etc", "proc", "sys", "dev", "tmp", "run", "root", "var/tmp"):
            (self.rootfs / sub).mkdir(parents=True, exist_ok=True)
        for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            host = Path("/") / top
            if host.is_symlink():  # merged /usr: the links point into the bind-mounted /usr
                (self.rootfs / top).symlink_to(os.readlink(host).lstrip("/"))
        init = self.rootfs / "gpuops-init"
        init.write_text(INITS.get(self.init, self.init), encoding="utf-8")
        init.chmod(0o755)
        (self.directory / "config").write_text(
            "\n".join([
                f"lxc.uts.name = {self.hostname}",
                f"lxc.rootfs.path = dir:{self.rootfs}",
                "lxc.mount.entry = /usr usr none bind,ro 0 0",
                "lxc.mount.entry = /etc etc none bind,ro 0 0",
                "lxc.mount.auto = proc:mixed sys:ro",
                "lxc.autodev = 1",
                "lxc.net.0.type = empty",
                "lxc.apparmor.profile = unconfined",
                "lxc.cgroup.relative = 1",
                "lxc.init.cmd = /gpuops-init",
                "",
            ]),
            encoding="utf-8",
        )

    def running(self) -> bool:
        """Whether the init recorded at the last start still runs (cheap: one /proc read)."""
        return self.init_id is not None and process_starttime(self.init_id.pid) == self.init_id.starttime

    @property
    def init_pid(self) -> int | None:
        return self.init_id.pid if self.running() else None

    def start(self) -> None:
        if self.running():
            return
        self._lxc("lxc-start", "-d")
        self._lxc("lxc-wait", "-s", "RUNNING", "-t", str(LXC_TIMEOUT))
        pid = int(self._lxc("lxc-info", "-pH").stdout.strip())
        init_id = proc_id(pid)
        if init_id is None:
            raise ContainerError(f"container {self.name}: init {pid} vanished right after the start")
        self.init_id = init_id
        self.starts += 1

    def stop(self) -> None:
        """Kill the container (SIGKILL to its init ends everything inside) and wait until it is gone."""
        self._lxc("lxc-stop", "-k", check=False)
        wait_until(lambda: not self.running(), timeout=LXC_TIMEOUT, what=f"container {self.name} to stop")
        self._lxc("lxc-wait", "-s", "STOPPED", "-t", str(LXC_TIMEOUT))

    def destroy(self) -> None:
        """Stop it if it runs, then remove its directory (the bind mounts exist only while it runs)."""
        if self.directory.exists():
            state = self._lxc("lxc-info", "-sH", check=False).stdout.strip()
            if state and state != "STOPPED":
                self.stop()
            self._lxc("lxc-destroy", check=False)
            shutil.rmtree(self.directory, ignore_errors=True)

    # ------------------------------------------------------------------ inside the container

    def attach_argv(self, argv: list[str]) -> list[str]:
        """The command line that runs `argv` inside, as ``pct exec`` does (``lxc-attach --clear-env``)."""
        return ["lxc-attach", "-P", self.lxcpath, "-n", self.name, "--clear-env", "--", *argv]

    def attach(self, argv: list[str], timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.attach_argv(argv), capture_output=True, text=True, timeout=timeout, check=False, **kwargs
        )

    def processes(self) -> list[ProcId]:
        """Every process inside (host pids), the init first."""
        if not self.running() or self.init_id is None:
            return []
        found, pending = [], [self.init_id.pid]
        while pending:
            pid = pending.pop(0)
            ident = proc_id(pid)
            if ident is not None:
                found.append(ident)
                pending.extend(_children(pid))
        return found

    def zombies(self) -> list[ProcId]:
        """The zombies inside (host pids)."""
        return [ident for ident in self.processes() if state_of(ident.pid) == "Z"]

    def exists(self, ident: ProcId) -> bool:
        """Whether that very process (pid and start time) still exists, zombie or not."""
        return process_starttime(ident.pid) == ident.starttime

    def make_zombie(self) -> ProcId:
        """An orphan that dies inside: with the non-reaping init it stays a zombie of PID 1 for ever."""
        before = set(self.zombies())
        proc = self.attach(["/bin/sh", "-c", "/bin/sleep 0.05 & exit 0"])
        if proc.returncode != 0:
            raise ContainerError(f"lxc-attach {self.name}: {proc.stderr.strip()}")
        found: list[ProcId] = []

        def appeared() -> bool:
            found[:] = [z for z in self.zombies() if z not in before]
            return bool(found)

        wait_until(appeared, timeout=10, what=f"a zombie in container {self.name}")
        return found[0]

    def start_process(self, argv: list[str]) -> ProcId:
        """Start `argv` inside, detached and orphaned to the container's init; returns its host pid."""
        init_pid = self.init_pid
        if init_pid is None:
            raise ContainerError(f"container {self.name} is not running")
        proc = self.attach(["/bin/sh", "-c", '"$@" </dev/null >/dev/null 2>&1 & echo $!', "sh", *argv])
        if proc.returncode != 0 or not proc.stdout.strip().isdigit():
            raise ContainerError(f"lxc-attach {self.name}: {proc.stderr.strip() or proc.stdout.strip()}")
        ident = proc_id(host_pid(init_pid, int(proc.stdout.strip())))
        if ident is None:
            raise ContainerError(f"{argv} ended before it could be identified in container {self.name}")
        return ident

    def nsenter_host_vars(self) -> dict[str, str]:
        """Host vars that reach inside with community.docker.nsenter, looking the init pid up afresh at
        every connection (lxc-info), so they keep working across reboots. For a YAML/JSON inventory."""
        return nsenter_vars("{{ lookup('ansible.builtin.pipe', 'lxc-info -P " + self.lxcpath + " -n " + self.name + " -pH') }}")

    def inventory(self, host: str = "ct") -> str:
        """An INI inventory line that makes Ansible run tasks inside (community.docker.nsenter).

        It names the current init pid, so it is good until the next restart; see nsenter_host_vars.
        """
        pid = self.init_pid
        if pid is None:
            raise ContainerError(f"container {self.name} is not running")
        return nsenter_inventory(pid, host)


# ------------------------------------------------------------------------------------- the bridge


class BridgedCt(FakeCt):
    """A fakepve container whose status is a real LXC container's.

    fakepve ends every power path by assigning ``status`` inside the task (which holds the config
    lock), so the setter is where the real container is started or killed. The calls are
    synchronous: a reboot's stop and start must not race. A failure ends the task with
    ``TASK ERROR`` as on PVE.
    """

    container: LxcContainer

    @property
    def status(self) -> str:  # type: ignore[override]
        return "running" if self.container.running() else "stopped"

    @status.setter
    def status(self, value: str) -> None:
        try:
            if value == "running":
                self.container.start()
            elif value == "stopped" and self.container.running():
                self.container.stop()
        except (ContainerError, AssertionError, subprocess.TimeoutExpired) as exc:
            raise TaskError(f"lxc: {exc}") from exc

    @property
    def pid(self) -> int | None:  # type: ignore[override]
        return self.container.init_pid

    @pid.setter
    def pid(self, value: Any) -> None:
        # fakepve hands out made-up pids; the real init pid is reported instead.
        pass


def bridge(ct: FakeCt, container: LxcContainer) -> BridgedCt:
    """Make the fake container `ct` follow (and drive) the real `container`."""
    running = ct.status == "running"
    ct.__dict__.pop("status", None)
    ct.__dict__.pop("pid", None)
    ct.__class__ = BridgedCt
    bridged: BridgedCt = ct  # type: ignore[assignment]
    bridged.container = container
    if running:
        container.start()
        bridged.started_at = time.time()
    return bridged


@dataclass
class _Hook:
    method: str
    suffix: str
    times: int
    before: Callable[[FakePve], None] | None = None
    drop_answer: bool = False
    # Turns the answer's "data" into what the client gets instead (a PVE that answers differently).
    rewrite: Callable[[Any], Any] | None = None


class HookedFakePve(FakePve):
    """FakePve with per-request hooks in front of its own middleware."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hooks: list[_Hook] = []
        self.dropped: list[tuple[str, str]] = []
        # Every request that arrived, including those fakepve's network faults then drop unrecorded.
        self.received: list[tuple[str, str]] = []

    def _build_app(self) -> web.Application:
        app = super()._build_app()
        app.middlewares.insert(0, self._hook_middleware)
        return app

    @web.middleware
    async def _hook_middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        self.received.append((request.method, request.path))
        hook = next(
            (h for h in self.hooks if h.times > 0 and h.method == request.method and request.path.endswith(h.suffix)),
            None,
        )
        if hook is None:
            return await handler(request)
        hook.times -= 1
        if hook.before is not None:
            hook.before(self)
        response = await handler(request)
        if hook.rewrite is not None and isinstance(response, web.Response) and response.body is not None:
            answer = json.loads(bytes(response.body))
            answer["data"] = hook.rewrite(answer.get("data"))
            return web.json_response(answer, status=response.status)
        if hook.drop_answer:
            # The server did the work; the client never hears about it.
            self.dropped.append((request.method, request.path))
            if request.transport is not None:
                request.transport.close()
            raise ConnectionResetError("fakepve_lxc: answer dropped on purpose")
        return response


# ----------------------------------------------------------------------------------- the server


class FakePveServer:
    """A HookedFakePve served over HTTPS on 127.0.0.1 from its own event loop thread."""

    def __init__(self, pki: Pki, user: str = "root@pam", password: str | None = None, time_scale: float = 0.0) -> None:
        self.pki = pki
        self.password = password or secrets.token_urlsafe(12)
        self.pve = HookedFakePve(user=user, password=self.password, host="127.0.0.1", port=0)
        self.pve.time_scale = time_scale
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name="fakepve-lxc", daemon=True)
        self.thread.start()
        self.run(self.pve.start(pki.cert_path, pki.key_path))

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def host(self) -> str:
        return self.pve.host

    @property
    def port(self) -> int:
        return self.pve.port

    def run(self, coro: Any) -> Any:
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(LOOP_CALL_TIMEOUT)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call fn on the server's loop (the only safe place to change the fake while it serves)."""

        async def call() -> Any:
            return fn(*args, **kwargs)

        return self.run(call())

    def later(self, seconds: float, fn: Callable[..., Any], *args: Any) -> None:
        """Call fn on the server's loop after `seconds` (e.g. to clear a lock while a client waits)."""
        self.loop.call_soon_threadsafe(self.loop.call_later, seconds, lambda: fn(*args))

    def stop(self) -> None:
        try:
            self.run(self.pve.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(LOOP_CALL_TIMEOUT)
            if not self.thread.is_alive():
                self.loop.close()

    # ------------------------------------------------------------------------------ faults

    def drop_answer(self, method: str, suffix: str, times: int = 1) -> None:
        """Carry out the next `times` matching requests but close the connection instead of answering."""
        self.call(self.pve.hooks.append, _Hook(method, suffix, times, drop_answer=True))

    def before_request(self, method: str, suffix: str, action: Callable[[FakePve], None], times: int = 1) -> None:
        """Run action(pve) just before the next `times` matching requests are handled."""
        self.call(self.pve.hooks.append, _Hook(method, suffix, times, before=action))

    def rewrite_answer(self, method: str, suffix: str, rewrite: Callable[[Any], Any], times: int = 1_000_000) -> None:
        """Answer the next `times` matching requests (by default all of them) with rewrite(data) instead of
        data: what a PVE that answers differently (a node in no cluster, say) or an API that lies sends."""
        self.call(self.pve.hooks.append, _Hook(method, suffix, times, rewrite=rewrite))

    def flaky_network(self, drop_rate: float, seed: int) -> None:
        """Drop (connection reset, unanswered, unrecorded) that share of requests, repeatably.

        fakepve seeds its random source when it starts; seeding it again here makes the drops the
        same on every run of a test.
        """

        def flaky() -> None:
            self.pve.flaky_network(drop_rate=drop_rate, seed=seed)
            self.pve._random.seed(seed)  # pylint: disable=protected-access

        self.call(flaky)

    def expire_tickets(self) -> None:
        """Every ticket handed out so far is past its expiry (the next request with one gets 401)."""
        self.call(expire_tickets, self.pve)

    def add_token(self, user: str, name: str) -> str:
        """An API token user!name; returns its secret."""
        secret = secrets.token_hex(16)
        self.call(self.pve.apitokens.__setitem__, f"{user}!{name}", secret)
        return secret

    def add_user(self, user: str, password: str | None = None) -> str:
        password = password or secrets.token_urlsafe(12)
        self.call(self.pve.users.__setitem__, user, password)
        return password

    def requests(self, method: str | None = None, contains: str = "") -> list[tuple[str, str]]:
        """(method, path) of the requests the server saw, oldest first, optionally filtered."""
        seen = self.call(lambda: list(self.pve.requests))
        return [(m, p) for m, p, _body in seen if (method is None or m == method) and contains in p]

    def received(self, method: str | None = None, contains: str = "") -> list[tuple[str, str]]:
        """(method, path) of every request that arrived, those the fake's network faults dropped included."""
        seen = self.call(lambda: list(self.pve.received))
        return [(m, p) for m, p in seen if (method is None or m == method) and contains in p]

    def tasks(self, vmid: int | None = None, task_type: str | None = None) -> list[dict[str, Any]]:
        """The task records (copies), oldest first."""
        records = self.call(lambda: [dict(t) for t in self.pve.tasklog])
        return [
            t for t in records
            if (vmid is None or t["id"] == str(vmid)) and (task_type is None or t["type"] == task_type)
        ]


def expire_tickets(pve: FakePve) -> None:
    """Every ticket of `pve` is past its expiry; call on the server's loop (or as a before_request action)."""
    for session in pve.tickets.values():
        session["expires"] = time.time() - 1


# -------------------------------------------------------------------------------------- the lab


@dataclass
class ProxmoxLab:
    """A running fake PVE with one bridged container, and what a client needs to reach it."""

    server: FakePveServer
    container: LxcContainer
    ct: BridgedCt
    vmid: int
    node: str
    hostname: str
    pki: Pki
    user: str = "root@pam"
    extra_containers: list[LxcContainer] = field(default_factory=list)

    @property
    def pve(self) -> HookedFakePve:
        return self.server.pve

    @property
    def password(self) -> str:
        return self.server.password

    def module_args(self, **extra: Any) -> dict[str, Any]:
        """Options for gpuops.relaunch.proxmox_ct_reboot: ticket login, certificate checked against the CA."""
        args = {
            "api_host": self.server.host,
            "api_port": self.server.port,
            "api_user": self.user,
            "api_password": self.password,
            "validate_certs": True,
            "ca_path": self.pki.ca_path,
            "api_timeout": 5,
        }
        args.update(extra)
        return args

    def environment(self) -> dict[str, str]:
        """The same connection as PROXMOX_* environment variables."""
        return {
            "PROXMOX_HOST": self.server.host,
            "PROXMOX_PORT": str(self.server.port),
            "PROXMOX_USER": self.user,
            "PROXMOX_PASSWORD": self.password,
            "PROXMOX_CA_PATH": self.pki.ca_path,
        }

    def add_container(self, vmid: int, hostname: str, node: str = "pve1", init: str = "non-reaping",
                      running: bool = True) -> BridgedCt:
        """Another bridged container (destroyed with the lab)."""
        container = LxcContainer(str(vmid), self.container.lxcpath, hostname, init=init)
        self.extra_containers.append(container)
        container.create()
        return self.server.call(_add_bridged, self.pve, vmid, hostname, node, container, running)


def _add_bridged(pve: FakePve, vmid: int, hostname: str, node: str, container: LxcContainer,
                 running: bool) -> BridgedCt:
    ct = pve.add_ct(vmid, hostname, node=node, status="running" if running else "stopped",
                    config={"hostname": hostname})
    return bridge(ct, container)


@pytest.fixture
def pve_lab(tmp_path) -> Iterator[ProxmoxLab]:
    """pytest fixture: proxmox_lab with its defaults (vmid 200, hostname gpu-train-01, node pve1,
    a non-reaping init) and tasks that really run asynchronously (time_scale 0.01).
    Import it into a test module to use it."""
    with proxmox_lab(tmp_path, time_scale=0.01) as lab:
        yield lab


@contextmanager
def proxmox_lab(
    tmp_path: str | os.PathLike,
    vmid: int = 200,
    hostname: str = "gpu-train-01",
    node: str = "pve1",
    init: str = "non-reaping",
    time_scale: float = 0.0,
    running: bool = True,
) -> Iterator[ProxmoxLab]:
    """A fake PVE over HTTPS (CA-signed certificate) with container `vmid` bridged to a real LXC one.

    Everything it started ends with the block: the server, its thread, every container (by name).
    """
    if shutil.which("lxc-start") is None:
        raise ContainerError("lxc-start is missing: install the lxc package (make apt)")
    base = Path(tmp_path)
    pki = make_pki(base / "pki")
    lxcpath = base / "lxc"
    lxcpath.mkdir(parents=True, exist_ok=True)
    container = LxcContainer(str(vmid), str(lxcpath), hostname, init=init)
    server: FakePveServer | None = None
    lab: ProxmoxLab | None = None
    try:
        container.create()
        server = FakePveServer(pki, time_scale=time_scale)
        ct = server.call(_add_bridged, server.pve, vmid, hostname, node, container, running)
        lab = ProxmoxLab(server=server, container=container, ct=ct, vmid=vmid, node=node, hostname=hostname, pki=pki)
        yield lab
    finally:
        if server is not None:
            server.stop()
        for extra in lab.extra_containers if lab else []:
            extra.destroy()
        container.destroy()


# ------------------------------------------------------------------------ a lab outside pytest
# For Molecule (extensions/molecule/container_reset), whose create and destroy playbooks run it as
# a command:
#
#     python -m tests.harness.fakepve_lxc up DIR [--vmid 200 --hostname NAME --node pve1]
#     python -m tests.harness.fakepve_lxc down DIR
#
# `up` starts `serve DIR` in a session of its own (stdio to DIR/lab.log) and returns once the lab
# runs: fakepve over HTTPS on 127.0.0.1 with one bridged LXC container, an API token, and
# DIR/lab.json (mode 0600) saying what was started (the server process's pid and start time, the
# container's name, lxcpath and init) and how to reach it (host, port, user, token, password, CA).
# A lab that already runs is left alone. `down` asks the server to stop through the FIFO
# DIR/control (no signal), waits until that very process is gone, then destroys the container by
# its recorded name if it is still there, and removes DIR. Each prints one JSON line with `changed`.
# The server's own end (the lab's context manager) stops the server and destroys the container.

LAB_STATE = "lab.json"
LAB_CONTROL = "control"
LAB_LOG = "lab.log"
LAB_TOKEN = "molecule"
LAB_START_TIMEOUT = 120
LAB_STOP_TIMEOUT = 120


def _read_lab(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / LAB_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _lab_alive(record: dict[str, Any]) -> bool:
    return process_starttime(int(record["pid"])) == int(record["starttime"])


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` (mode 0600) through a temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
    os.replace(tmp, path)


def serve_lab(directory: str | os.PathLike, vmid: int, hostname: str, node: str) -> None:
    """Run a lab in DIR until "stop" arrives on DIR/control; DIR/lab.json describes it meanwhile."""
    directory = Path(directory).resolve()
    control = directory / LAB_CONTROL
    control.unlink(missing_ok=True)
    os.mkfifo(control, 0o600)
    try:
        with proxmox_lab(directory, vmid=vmid, hostname=hostname, node=node, time_scale=0.01) as lab:
            token = lab.server.add_token(lab.user, LAB_TOKEN)
            init = lab.container.init_id
            record = {
                "pid": os.getpid(), "starttime": process_starttime(os.getpid()),
                "host": lab.server.host, "port": lab.server.port, "user": lab.user,
                "password": lab.password, "token_id": LAB_TOKEN, "token_secret": token,
                "ca_path": lab.pki.ca_path, "node": node, "vmid": vmid, "hostname": hostname,
                "container": lab.container.name, "lxcpath": lab.container.lxcpath,
                "init_pid": init.pid if init else None, "init_starttime": init.starttime if init else None,
            }
            _write_private(directory / LAB_STATE, json.dumps(record) + "\n")
            while True:
                # Blocks until a writer opens the FIFO; returns at the writer's close.
                with open(control, encoding="utf-8") as fifo:
                    if "stop" in fifo.read().split():
                        break
    finally:
        (directory / LAB_STATE).unlink(missing_ok=True)
        control.unlink(missing_ok=True)


def lab_up(directory: str | os.PathLike, vmid: int, hostname: str, node: str) -> dict[str, Any]:
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    record = _read_lab(directory)
    if record is not None and _lab_alive(record):
        return {"changed": False, "pid": record["pid"], "container": record["container"]}
    if (directory / "lxc" / str(vmid)).exists():
        raise ContainerError(f"{directory}: container {vmid} is there but no lab runs; run `down {directory}` first")
    env = dict(os.environ)
    here = Path(__file__).resolve()
    repo = here.parents[2]
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(repo), str(repo / ".build" / "collections"), env.get("PYTHONPATH", "")]))
    with open(directory / LAB_LOG, "ab") as log:
        server = subprocess.Popen(  # pylint: disable=consider-using-with
            [sys.executable, "-m", "tests.harness.fakepve_lxc", "serve", str(directory), "--vmid", str(vmid),
             "--hostname", hostname, "--node", node],
            cwd=repo, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def ready() -> dict[str, Any] | None:
        found = _read_lab(directory)
        if found is not None and int(found["pid"]) == server.pid:
            return found
        if server.poll() is not None:
            tail = (directory / LAB_LOG).read_text(encoding="utf-8", errors="replace")[-3000:]
            raise ContainerError(f"the lab server exited with {server.returncode}:\n{tail}")
        return None

    record = wait_until(ready, timeout=LAB_START_TIMEOUT, what=f"the lab in {directory} to start", interval=0.1)
    return {"changed": True, "pid": record["pid"], "container": record["container"]}


def lab_down(directory: str | os.PathLike) -> dict[str, Any]:
    directory = Path(directory).resolve()
    if not directory.exists():
        return {"changed": False}
    record = _read_lab(directory)
    changed = False
    if record is not None and _lab_alive(record):
        try:
            fd = os.open(directory / LAB_CONTROL, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError as exc:  # ENXIO: no reader (yet or any more)
            raise ContainerError(f"the lab server {record['pid']} does not read {directory / LAB_CONTROL}: {exc}") from exc
        with os.fdopen(fd, "w", encoding="utf-8") as control:
            control.write("stop\n")
        wait_until(lambda: not _lab_alive(record), timeout=LAB_STOP_TIMEOUT,
                   what=f"the lab server {record['pid']} to stop")
        changed = True
    # What the server's own end did not remove (it died, say): the containers it made, by name.
    lxcpath = directory / "lxc"
    for name in sorted(os.listdir(lxcpath)) if lxcpath.is_dir() else []:
        if name.isdigit():
            LxcContainer(name, str(lxcpath), hostname="").destroy()
            changed = True
    shutil.rmtree(directory)
    return {"changed": changed}


def main(argv: list[str] | None = None) -> None:
    import argparse  # pylint: disable=import-outside-toplevel

    parser = argparse.ArgumentParser(prog="python -m tests.harness.fakepve_lxc", description=__doc__.split("\n", maxsplit=1)[0])
    parser.add_argument("action", choices=("up", "down", "serve"))
    parser.add_argument("directory")
    parser.add_argument("--vmid", type=int, default=200)
    parser.add_argument("--hostname", default="gpu-train-01")
    parser.add_argument("--node", default="pve1")
    args = parser.parse_args(argv)
    if args.action == "serve":
        serve_lab(args.directory, args.vmid, args.hostname, args.node)
        return
    result = lab_up(args.directory, args.vmid, args.hostname, args.node) if args.action == "up" else lab_down(args.directory)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
