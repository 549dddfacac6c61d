"""The relaunch as a watchdog: the AWX schedule (extensions/awx/schedule.yml) and the systemd timer +
service for a controller (extensions/systemd/). No AWX server and no systemd as PID 1 here: what AWX
would check on a schedule is checked on the file (its rrule by AWX's rules, the survey answers by the
survey), and the units go through ``systemd-analyze verify`` where it exists, and through a parse of
their keys always.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import pytest
import yaml
from jinja2 import StrictUndefined
from jinja2.sandbox import ImmutableSandboxedEnvironment

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
AWX_DIR = REPO / "extensions" / "awx"
SYSTEMD_DIR = REPO / "extensions" / "systemd"
SERVICE = SYSTEMD_DIR / "gpuops-relaunch.service"
TIMER = SYSTEMD_DIR / "gpuops-relaunch.timer"
COMMAND = "/usr/bin/ansible-playbook gpuops.relaunch.relaunch -i /etc/gpuops/inventory.yml"


# --- the AWX schedule -----------------------------------------------------------------------------

# RFC 5545 as AWX takes it (awx/api/serializers.py, SchedulePreviewSerializer.validate_rrule):
# exactly one DTSTART, with a time zone (TZID or a UTC "Z"); RRULEs with a FREQ other than SECONDLY;
# not COUNT and UNTIL together; COUNT at most 999; no numbered BYDAY (e.g. 1MO).
DTSTART = re.compile(r"^DTSTART(?:;TZID=(?P<tz>[^:]+))?:(?P<at>\d{8}T\d{6})(?P<z>Z?)$")
FREQS = {"MINUTELY", "HOURLY", "DAILY", "WEEKLY", "MONTHLY", "YEARLY"}
RRULE_KEYS = {"FREQ", "INTERVAL", "COUNT", "UNTIL", "BYSECOND", "BYMINUTE", "BYHOUR", "BYDAY", "BYMONTHDAY",
              "BYYEARDAY", "BYWEEKNO", "BYMONTH", "BYSETPOS", "WKST"}


def rrule_problems(text: str) -> list[str]:
    """What AWX would refuse in `text` (empty: nothing)."""
    problems: list[str] = []
    parts = text.split()
    starts = [part for part in parts if part.startswith("DTSTART")]
    rules = [part for part in parts if part.startswith("RRULE:")]
    if len(starts) != 1:
        problems.append(f"needs exactly one DTSTART, got {len(starts)}")
    for start in starts:
        match = DTSTART.match(start)
        if match is None:
            problems.append(f"DTSTART is not DTSTART[;TZID=zone]:YYYYMMDDTHHMMSS[Z]: {start}")
            continue
        datetime.strptime(match["at"], "%Y%m%dT%H%M%S")
        if match["tz"] is None and not match["z"]:
            problems.append("DTSTART needs a time zone (TZID=...) or UTC (Z)")
        if match["tz"] is not None:
            try:
                ZoneInfo(match["tz"])
            except (ZoneInfoNotFoundError, ValueError):
                problems.append(f"unknown time zone {match['tz']}")
    if not rules:
        problems.append("needs an RRULE")
    for rule in rules:
        fields = dict(item.split("=", 1) for item in rule[len("RRULE:"):].split(";"))
        unknown = set(fields) - RRULE_KEYS
        if unknown:
            problems.append(f"unknown RRULE parts {sorted(unknown)}")
        if fields.get("FREQ") not in FREQS:
            problems.append(f"FREQ must be one of {sorted(FREQS)} (SECONDLY is not supported), got {fields.get('FREQ')}")
        if "INTERVAL" in fields and not (fields["INTERVAL"].isdigit() and int(fields["INTERVAL"]) > 0):
            problems.append(f"INTERVAL must be a positive integer, got {fields['INTERVAL']}")
        if "COUNT" in fields and "UNTIL" in fields:
            problems.append("COUNT and UNTIL together")
        if "COUNT" in fields and int(fields["COUNT"]) > 999:
            problems.append("COUNT over 999")
        if re.search(r"[+-]?\d", fields.get("BYDAY", "")):
            problems.append("numbered BYDAY")
    for part in parts:
        if not part.startswith(("DTSTART", "RRULE:", "EXRULE:")):
            problems.append(f"unexpected part {part}")
    return problems


def test_rrule_rules_refuse_what_awx_refuses():
    assert rrule_problems("DTSTART;TZID=UTC:20260101T000000 RRULE:FREQ=MINUTELY;INTERVAL=10") == []
    assert rrule_problems("DTSTART:20260101T000000Z RRULE:FREQ=HOURLY") == []
    assert rrule_problems("RRULE:FREQ=MINUTELY;INTERVAL=10") == ["needs exactly one DTSTART, got 0"]
    assert "DTSTART needs a time zone (TZID=...) or UTC (Z)" in rrule_problems("DTSTART:20260101T000000 RRULE:FREQ=DAILY")
    assert any("SECONDLY" in p for p in rrule_problems("DTSTART:20260101T000000Z RRULE:FREQ=SECONDLY"))
    assert "COUNT and UNTIL together" in rrule_problems(
        "DTSTART:20260101T000000Z RRULE:FREQ=DAILY;COUNT=2;UNTIL=20270101T000000Z")
    assert "unknown time zone Mars/Olympus" in rrule_problems("DTSTART;TZID=Mars/Olympus:20260101T000000 RRULE:FREQ=DAILY")
    assert "INTERVAL must be a positive integer, got 0" in rrule_problems("DTSTART:20260101T000000Z RRULE:FREQ=DAILY;INTERVAL=0")


def _schedule_play() -> dict[str, Any]:
    (play,) = yaml.safe_load((AWX_DIR / "schedule.yml").read_text(encoding="utf-8"))
    return play


def _rendered_schedule_task() -> dict[str, Any]:
    """The awx.awx.schedule task's arguments, rendered with the play's vars and its vars_files."""
    play = _schedule_play()
    variables = dict(play["vars"])
    for name in play["vars_files"]:
        variables.update(yaml.safe_load((AWX_DIR / name).read_text(encoding="utf-8")))
    (task,) = [t for t in play["tasks"] if "awx.awx.schedule" in t]
    sandbox = ImmutableSandboxedEnvironment(undefined=StrictUndefined)

    def render(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: render(value) for key, value in node.items()}
        if isinstance(node, list):
            return [render(value) for value in node]
        if isinstance(node, str) and "{{" in node:
            # A template that is one expression keeps the expression's type, as Ansible's does.
            whole = re.fullmatch(r"\{\{(.*)\}\}", node.strip(), re.S)
            if whole:
                return sandbox.compile_expression(whole[1].strip(), undefined_to_none=False)(**variables)
            return sandbox.from_string(node).render(**variables)
        return node

    return render(task["awx.awx.schedule"])


def test_schedule_launches_the_existing_job_template_every_ten_minutes():
    args = _rendered_schedule_task()
    template = yaml.safe_load((AWX_DIR / "job_template.yml").read_text(encoding="utf-8"))["relaunch_awx_job_template"]
    assert args["unified_job_template"] == template["name"]
    assert template["playbook"] == "playbooks/relaunch.yml" and (REPO / template["playbook"]).is_file()
    # No overlapping runs: AWX queues a launch while the template's previous job still runs.
    assert template["allow_simultaneous"] is False
    assert rrule_problems(args["rrule"]) == []
    assert "RRULE:FREQ=MINUTELY;INTERVAL=10" in args["rrule"].split()
    assert args["state"] == "present" and args["enabled"] is True
    # job_type on a schedule needs the template to ask for it at launch.
    assert args["job_type"] == "run" and template["ask_job_type_on_launch"] is True


def test_schedule_answers_the_survey():
    args = _rendered_schedule_task()
    survey = {q["variable"]: q for q in json.loads((AWX_DIR / "survey.json").read_text(encoding="utf-8"))["spec"]}
    answers = args["extra_data"]
    assert set(answers) <= set(survey), set(answers) - set(survey)
    for variable, question in survey.items():
        if question["required"] and question.get("default") in (None, ""):
            assert variable in answers, variable
    for variable, value in answers.items():
        question = survey[variable]
        if question["type"] == "multiplechoice":
            assert value in question["choices"], (variable, value)
        if question["type"] == "text":
            assert question.get("min", 0) <= len(value) <= question.get("max", 1024), variable


def test_schedule_playbook_passes_syntax_check_and_lint():
    syntax = subprocess.run([str(BIN / "ansible-playbook"), "--syntax-check", "-i", "localhost,", str(AWX_DIR / "schedule.yml")],
                            cwd=str(REPO), capture_output=True, text=True, timeout=300, check=False)
    assert syntax.returncode == 0, syntax.stdout + syntax.stderr
    lint = subprocess.run([str(BIN / "ansible-lint"), "--profile", "production", "--offline", "extensions/awx/schedule.yml"],
                          cwd=str(REPO), capture_output=True, text=True, timeout=600, check=False)
    assert lint.returncode == 0, lint.stdout + lint.stderr


# --- the systemd timer and service ------------------------------------------------------------------


def unit_keys(path: Path) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (a key may repeat), as systemd reads a unit file (comments, no continuations)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), f"{path.name}:{number}: no continuation lines in these examples"
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"{path.name}:{number}: not KEY=VALUE in a section: {raw}"
        key, value = line.split("=", 1)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_service_runs_the_relaunch_once_per_start_hardened():
    service = unit_keys(SERVICE)["Service"]
    assert service["Type"] == ["oneshot"]
    assert service["ExecStart"] == [COMMAND]
    # Not root, no way to become root, nothing of the machine writable but its own state.
    assert service["User"] == ["gpuops"] and service["NoNewPrivileges"] == ["yes"]
    assert service["CapabilityBoundingSet"] == [""] and service["ProtectSystem"] == ["strict"]
    for key in ("ProtectHome", "PrivateTmp", "PrivateDevices", "ProtectKernelTunables", "ProtectKernelModules",
                "ProtectControlGroups", "RestrictSUIDSGID", "RestrictNamespaces", "LockPersonality"):
        assert service[key] == ["yes"], key
    assert service["StateDirectory"] == ["gpuops"] and service["WorkingDirectory"] == ["/var/lib/gpuops"]
    assert service["Environment"].count("HOME=/var/lib/gpuops") == 1
    # A run that hangs ends; the credentials file is optional ("-").
    assert service["TimeoutStartSec"] and service["EnvironmentFile"][0].startswith("-/etc/gpuops/")
    assert "Restart" not in service  # the timer starts it again; a crash loop would only hammer the targets
    assert "Install" not in unit_keys(SERVICE)  # started by the timer only


def test_timer_starts_the_service_every_ten_minutes_after_the_last_run_ended():
    timer = unit_keys(TIMER)
    assert timer["Timer"]["Unit"] == [SERVICE.name]
    # Counted from the end of the last run: a oneshot run in progress is never started twice, and a
    # slow run does not queue another behind it.
    assert timer["Timer"]["OnUnitInactiveSec"] == ["10min"]
    assert timer["Timer"]["OnBootSec"]
    assert timer["Install"]["WantedBy"] == ["timers.target"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_units_pass_systemd_analyze_verify(tmp_path: Path):
    # verify checks that ExecStart's program exists: the venv's ansible-playbook stands in for
    # /usr/bin/ansible-playbook, nothing else changes.
    shutil.copy(TIMER, tmp_path / TIMER.name)
    text = SERVICE.read_text(encoding="utf-8")
    assert text.count(COMMAND) == 1
    (tmp_path / SERVICE.name).write_text(
        text.replace("/usr/bin/ansible-playbook ", f"{BIN / 'ansible-playbook'} ", 1), encoding="utf-8")
    verify = subprocess.run(["systemd-analyze", "verify", str(tmp_path / SERVICE.name), str(tmp_path / TIMER.name)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert verify.returncode == 0 and verify.stderr.strip() == "", verify.stderr
