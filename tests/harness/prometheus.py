"""Real Prometheus parts for tests: Debian's promtool and node_exporter, unpacked by `make prometheus-tools`.

:func:`check_metrics` runs ``promtool check metrics`` on a textfile; :func:`node_exporter` starts the
real node_exporter with the textfile collector only, on a free loopback port, waits (polling, with a
deadline) until it answers, and stops it by the pid it recorded; :func:`parse_exposition` reads the
text format as Prometheus does (label values unescaped, lines ending at a newline only).

:func:`prometheus_server` and :func:`alertmanager` start Debian's Prometheus server and Alertmanager
the same way (loopback, free ports, their data in the test's directory, stopped by recorded pid), for
the event chain (tests/integration/test_event_chain.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.harness.procstates import wait_until

REPO = Path(__file__).resolve().parents[2]
PROM_BIN = REPO / ".build" / "prometheus" / "usr" / "bin"
PROMTOOL = PROM_BIN / "promtool"
NODE_EXPORTER = PROM_BIN / "prometheus-node-exporter"
PROMETHEUS = PROM_BIN / "prometheus"
ALERTMANAGER = PROM_BIN / "prometheus-alertmanager"
# Debian's Alertmanager reads its templates from here only; `make prometheus-tools` puts them there.
ALERTMANAGER_TEMPLATES = [Path("/usr/share/prometheus/alertmanager") / name for name in ("default.tmpl", "email.tmpl")]
INSTALL = "make prometheus-tools"

_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)(?: \S+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\.)*)",?')

Series = tuple[str, tuple[tuple[str, str], ...]]


def require(*binaries: Path) -> None:
    """Skip the test, naming the make target, where the unpacked binaries are missing; fail instead under
    `make test` (GPUOPS_REQUIRE_TOOLS=1), whose set-up installs them: there a missing one is a missing install
    step, never a green run that tested nothing."""
    missing = [str(binary.relative_to(REPO) if binary.is_relative_to(REPO) else binary)
               for binary in binaries if not binary.is_file()]
    if missing:
        skip_or_fail(f"{', '.join(missing)} missing: run `{INSTALL}`")


def skip_or_fail(message: str) -> None:
    """pytest.skip(message), or pytest.fail(message) under `make test` (GPUOPS_REQUIRE_TOOLS=1)."""
    if os.environ.get("GPUOPS_REQUIRE_TOOLS") == "1":
        pytest.fail(message)
    pytest.skip(message)


def check_metrics(path: Path) -> subprocess.CompletedProcess:
    """promtool check metrics < PATH (rc 0: the text format, and promtool's lint, accept it)."""
    require(PROMTOOL)
    with open(path, "rb") as stream:
        return subprocess.run([str(PROMTOOL), "check", "metrics"], stdin=stream, capture_output=True, text=True,
                              timeout=60, check=False)


def parse_exposition(text: str) -> dict[Series, float]:
    """{(name, sorted (label, value) pairs): value} of every sample; comments skipped."""
    samples: dict[Series, float] = {}
    for line in text.split("\n"):
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        pairs = [(name, re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), raw))
                 for name, raw in _LABEL.findall(match["labels"] or "")]
        samples[(match["name"], tuple(sorted(pairs)))] = float(match["value"])
    return samples


def sample(samples: dict[Series, float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def names(samples: dict[Series, float]) -> set[str]:
    return {name for name, _labels in samples}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Exporter:
    """A running node_exporter: its pid and its /metrics URL."""

    pid: int
    url: str
    log: Path

    def scrape(self) -> str:
        with urllib.request.urlopen(self.url, timeout=10) as response:  # noqa: S310 - loopback only
            return response.read().decode("utf-8")

    def scrape_until(self, condition, what: str, timeout: float = 30.0) -> dict[Series, float]:
        """Scrape until `condition(samples)` holds, and return those samples (no fixed sleep)."""
        def attempt():
            samples = parse_exposition(self.scrape())
            return samples if condition(samples) else None
        return wait_until(attempt, timeout=timeout, what=what, interval=0.1)


@contextmanager
def node_exporter(textfile_dir: Path, log_dir: Path) -> Iterator[Exporter]:
    """The real node_exporter with only the textfile collector, on 127.0.0.1 and a free port."""
    require(NODE_EXPORTER)
    port = free_port()
    argv = [str(NODE_EXPORTER), "--collector.disable-defaults", "--collector.textfile",
            f"--collector.textfile.directory={textfile_dir}", f"--web.listen-address=127.0.0.1:{port}"]
    with serve(argv, "node_exporter", log_dir, f"http://127.0.0.1:{port}", "/metrics", timeout=30) as service:
        yield Exporter(service.pid, service.url + "/metrics", service.log)


@dataclass
class Service:
    """A started server: its pid, base URL and log."""

    pid: int
    url: str
    log: Path

    def get(self, path: str) -> Any:
        """GET url+path as JSON."""
        with urllib.request.urlopen(self.url + path, timeout=10) as response:  # noqa: S310 - loopback only
            return json.loads(response.read().decode("utf-8"))


@contextmanager
def serve(argv: list[str], name: str, log_dir: Path, url: str, ready_path: str,
          timeout: float = 60) -> Iterator[Service]:
    """Run `argv` until the block ends: it is ready when GET url+ready_path answers 200; stopped by the pid
    Popen recorded (SIGTERM, then SIGKILL after 10 s)."""
    log = log_dir / f"{name}.log"
    with open(log, "wb") as output:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT)  # pylint: disable=consider-using-with
    service = Service(proc.pid, url, log)
    try:
        def answers() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited ({proc.returncode}): {log.read_text(errors='replace')[-4000:]}")
            try:
                with urllib.request.urlopen(url + ready_path, timeout=5) as response:  # noqa: S310 - loopback only
                    return response.status == 200
            except (urllib.error.URLError, ConnectionError):
                return False
        wait_until(answers, timeout=timeout, what=f"{name} to answer on {url}{ready_path}", interval=0.05)
        yield service
    finally:
        # Only the process this started, by the pid Popen recorded.
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@contextmanager
def prometheus_server(config: dict[str, Any], work: Path) -> Iterator[Service]:
    """Debian's Prometheus server with `config` (prometheus.yml as a dict), its TSDB under `work`. Firing
    alerts are sent again every second (--rules.alert.resend-delay), so that Alertmanager learns at once
    that one ended."""
    require(PROMETHEUS)
    port = free_port()
    path = work / "prometheus.yml"
    path.write_text(json.dumps(config), encoding="utf-8")
    argv = [str(PROMETHEUS), f"--config.file={path}", f"--storage.tsdb.path={work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}", "--rules.alert.resend-delay=1s"]
    with serve(argv, "prometheus", work, f"http://127.0.0.1:{port}", "/-/ready") as service:
        yield service


@contextmanager
def alertmanager(config: dict[str, Any], work: Path) -> Iterator[Service]:
    """Debian's Alertmanager with `config` (alertmanager.yml as a dict), alone: no cluster (gossip) port."""
    require(ALERTMANAGER, *ALERTMANAGER_TEMPLATES)
    port = free_port()
    path = work / "alertmanager.yml"
    path.write_text(json.dumps(config), encoding="utf-8")
    argv = [str(ALERTMANAGER), f"--config.file={path}", f"--storage.path={work / 'alertmanager'}",
            f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="]
    with serve(argv, "alertmanager", work, f"http://127.0.0.1:{port}", "/-/ready") as service:
        yield service
