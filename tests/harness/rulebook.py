"""ansible-rulebook (EDA), for real: the collection's rulebook, its webhook on a loopback port.

:func:`rulebook` starts ``ansible-rulebook -r gpuops.relaunch.RULEBOOK`` (the collection's
extensions/eda/rulebooks/, found through ansible.cfg's collections_path) with an inventory and vars,
waits (polling, with a deadline) until its webhook answers, and ends it by the pid it recorded. The
rulebook prints every event it receives (``--print-events``) and the output of every playbook it runs:
:meth:`Rulebook.events` and :meth:`Rulebook.recaps` read them back from its log.

Its rule engine is Drools in a JVM (drools_jpy): JAVA_HOME must name a Java 17 runtime
(openjdk-17-jre-headless, the Makefile's APT_PKGS). Starting it takes seconds: start it once per file.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.harness.playbook import REPO
from tests.harness.procstates import wait_until
from tests.harness.prometheus import free_port, skip_or_fail

BIN = Path(sys.executable).parent
RULEBOOK = BIN / "ansible-rulebook"
JAVA_HOMES = sorted(Path("/usr/lib/jvm").glob("java-17-openjdk-*"))

_EVENT = re.compile(r"\[received event\] \*+\nRuleset: [^\n]*\nEvent:\n(.*?)\n\*{80}\n", re.S)
_RECAP = re.compile(r"^PLAY RECAP \*+\n((?:\S+\s+: .*\n)+)", re.M)
_COUNT = re.compile(r"(\w+)=(\d+)")


def java_home() -> Path | None:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return Path(home)
    return next((path for path in JAVA_HOMES if (path / "bin" / "java").is_file()), None)


def require() -> Path:
    """Skip (fail under `make test`), naming what installs it, where ansible-rulebook or Java 17 is missing;
    the JAVA_HOME to use."""
    if not RULEBOOK.is_file():
        skip_or_fail("ansible-rulebook missing: run `make venv` (requirements/test.txt)")
    home = java_home()
    if home is None:
        skip_or_fail("no Java 17 runtime under /usr/lib/jvm: run `make apt` (openjdk-17-jre-headless)")
    return home


@dataclass
class Rulebook:
    """A running ansible-rulebook: its pid, its webhook, its output (events and playbook runs) and its log
    (its logger's lines: a failed run is logged there once more, whole, so it is kept apart)."""

    pid: int
    webhook: str
    token: str
    log: Path
    errors: Path | None = None

    def text(self) -> str:
        # ansible-runner writes a playbook's lines with CRLF; the rulebook's own with LF.
        return self.log.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")

    def post(self, payload: dict[str, Any], token: str | None = None) -> int:
        """POST `payload` to the webhook as Alertmanager does; the HTTP status."""
        request = urllib.request.Request(  # noqa: S310 - loopback only
            self.webhook, data=json.dumps(payload).encode("utf-8"), method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {token or self.token}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - loopback only
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    def events(self) -> list[dict[str, Any]]:
        """Every event the rulebook received, as it printed them (meta.received_at, payload)."""
        return [ast.literal_eval(block) for block in _EVENT.findall(self.text())]

    def recaps(self) -> list[dict[str, dict[str, int]]]:
        """The PLAY RECAP of every playbook run the rulebook made, in order: {host: {ok, changed, failed, ...}}."""
        recaps = []
        for block in _RECAP.findall(self.text()):
            recap = {}
            for line in block.splitlines():
                host, _sep, counts = line.partition(":")
                recap[host.strip()] = {name: int(value) for name, value in _COUNT.findall(counts)}
            recaps.append(recap)
        return recaps


def received_at(event: dict[str, Any]) -> float:
    """When the rulebook received `event` (its meta.received_at, UTC), in seconds since the epoch."""
    stamp = event["meta"]["received_at"].replace("Z", "+00:00")
    return datetime.fromisoformat(stamp).timestamp()


@contextmanager
def rulebook(name: str, inventory: str | Path, work: Path, variables: dict[str, Any] | None = None,
             port: int | None = None, token: str | None = None, timeout: float = 90) -> Iterator[Rulebook]:
    """ansible-rulebook -r gpuops.relaunch.NAME -i INVENTORY, its webhook on 127.0.0.1 and `port` (a free
    one by default) with `token` (the rulebook's vars gpuops_eda_webhook_host/_port/_token), until the
    block ends."""
    home = require()
    port = port or free_port()
    token = token or f"test-token-{os.getpid()}"
    values = dict(variables or {}, gpuops_eda_webhook_host="127.0.0.1", gpuops_eda_webhook_port=port,
                  gpuops_eda_webhook_token=token)
    vars_file = work / "rulebook_vars.json"
    vars_file.write_text(json.dumps(values), encoding="utf-8")
    log = work / "rulebook.out"
    errors = work / "rulebook.log"
    env = dict(os.environ, JAVA_HOME=str(home), ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_FORCE_COLOR="0", PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    with open(log, "wb") as output, open(errors, "wb") as logged:
        # A session of its own: the playbook runs it starts (ansible-runner, ansible-playbook) are in its
        # process group, so the clean-up reaches a run still going, by the recorded pid as group id.
        proc = subprocess.Popen(  # pylint: disable=consider-using-with
            [str(RULEBOOK), "-r", f"gpuops.relaunch.{name}", "-i", str(inventory), "--vars", str(vars_file),
             "--print-events"],
            cwd=str(work), env=env, stdin=subprocess.DEVNULL, stdout=output, stderr=logged,
            start_new_session=True,
        )
    running = Rulebook(proc.pid, f"http://127.0.0.1:{port}/alerts", token, log, errors)
    try:
        def listening() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"ansible-rulebook exited ({proc.returncode}): {running.text()[-2000:]}"
                                     f"{errors.read_text(errors='replace')[-2000:]}")
            # Without the token the webhook answers 401: it listens, and refuses what it must.
            try:
                return running.post({}, token="wrong") == 401
            except (urllib.error.URLError, ConnectionError):
                return False
        wait_until(listening, timeout=timeout, what=f"ansible-rulebook's webhook on {running.webhook}", interval=0.1)
        yield running
    finally:
        _end(proc)


def _end(proc: subprocess.Popen) -> None:
    """SIGTERM to the rulebook's process group (its id is the pid recorded at start: start_new_session), then
    SIGKILL to what is left of it."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; a playbook run it started may still be in the group.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        break
