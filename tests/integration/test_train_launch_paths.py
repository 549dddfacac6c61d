"""train_launch and relaunch.yml where the paths and the log are not to be trusted, for real.

Everything runs in a never-reaping PID namespace over nsenter (so whatever a wrong stop would
signal is inside it, and ends with it). Three things (issue 17, items 4, 5, 7):

* a start that cannot work changes nothing: a log path under a read-only bind mount (mounted in the
  namespace's own mount namespace) makes the probe fail, so relaunch.yml stops nothing;
* paths are walked, not trusted: the job runs as nobody, which owns its log directory and swaps it
  (as a real nobody process) for a symlink into a root-only directory; nothing follows it;
* terminals obey bytes: a job that prints OSC, CSI, C1 and undecodable bytes reaches the results,
  the incident record and relaunch.yml's failure message only escaped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.launch_targets import DEMO, PYTHON, Target, in_pid_namespace, playbook_popen, readable_by_all
from tests.harness.pidns import nsenter_vars
from tests.harness.playbook import REPO, PlaybookRun, run_playbook
from tests.harness.procstates import wait_until

pytestmark = pytest.mark.slow

NOBODY = 65534
RELAUNCH = str(REPO / "playbooks" / "relaunch.yml")
SUMMARY = "Summarize"
REFUSED = "Fail this host when a step failed or the crash-loop guard refused"
FAILED = REFUSED

# A job that takes over the terminal of whoever reads its log: the window title (OSC ... BEL), a
# cleared screen and colours (CSI), C1 CSI as a character (U+009B) and as a raw byte, DEL, and a
# byte that is no UTF-8; then progress lines carrying escapes, and (with EXIT) a crash.
HOSTILE_JOB = r"""
import os, sys, time
out = sys.stdout.buffer
out.write(b"boot \x1b]0;owned\x07 \x1b[2J\x1b[31mred\x1b[0m \xc2\x9b6n \x9b \x7f \xff\n")
for step in (1, 2):
    out.write(b"step %d \x1b[1mloss\x1b[0m=1.5\n" % step)
    out.flush()
    time.sleep(0.2)
if os.environ.get("EXIT"):
    out.write(b"crash \x1b]52;c;cGF3bmVk\x07\n")
    out.flush()
    sys.exit(int(os.environ["EXIT"]))
time.sleep(600)
"""


def raw_controls(text: str) -> list[str]:
    """The characters a terminal would obey (C0 but tab, DEL, C1) or that no byte encodes (surrogates)."""
    return [char for char in text if (ord(char) < 0x20 and char != "\t") or 0x7f <= ord(char) <= 0x9f
            or 0xd800 <= ord(char) <= 0xdfff]


def all_text(value: Any) -> list[str]:
    """Every string in a result, keys too."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [text for key, item in value.items() for text in (*all_text(key), *all_text(item))]
    if isinstance(value, (list, tuple)):
        return [text for item in value for text in all_text(item)]
    return []


def assert_escaped(value: Any) -> None:
    """No text in `value` that a terminal would obey; the task's own arguments (the job's source code,
    newlines and all) are the user's, not the job's, and are left out."""
    if isinstance(value, dict):
        value = {key: item for key, item in value.items() if key != "invocation"}
    found = [text for text in all_text(value) if raw_controls(text)]
    assert not found, found


def as_nobody(*argv: str) -> None:
    """A real unprivileged process (the job's user), not a chown after the fact."""
    subprocess.run(argv, check=True, user=NOBODY, group=NOBODY, extra_groups=[], timeout=30)


@pytest.fixture(name="target")
def target_fixture(tmp_path: Path) -> Iterator[Target]:
    with in_pid_namespace(tmp_path) as where:
        yield where


@pytest.fixture(name="site")
def site_fixture() -> Iterator[Path]:
    """/tmp/gpuops-paths-*/ (0755): home/ is nobody's (its logs/ and cache/ too), rootonly/ root's (0700)."""
    base = Path(tempfile.mkdtemp(prefix="gpuops-paths-", dir="/tmp"))
    try:
        base.chmod(0o755)
        (base / "home").mkdir()
        os.chown(base / "home", NOBODY, NOBODY)
        as_nobody("mkdir", str(base / "home" / "logs"), str(base / "home" / "cache"))
        (base / "rootonly").mkdir(mode=0o700)
        (base / "rootonly" / "train.log").write_text("root's own log\n")
        (base / "rootonly" / "precious").write_text("root's own file\n")
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def rootonly_untouched(site: Path) -> None:
    assert sorted(os.listdir(site / "rootonly")) == ["precious", "train.log"]
    assert (site / "rootonly" / "train.log").read_text() == "root's own log\n"
    assert (site / "rootonly" / "precious").read_text() == "root's own file\n"
    assert (site / "rootonly" / "train.log").stat().st_uid == 0


def plant(site: Path, name: str) -> None:
    """The job's user moves its directory aside and links the name into the root-only directory."""
    as_nobody("mv", str(site / "home" / name), str(site / "home" / f"{name}.old"))
    as_nobody("ln", "-s", str(site / "rootonly"), str(site / "home" / name))


def running_pid(target: Target, name: str = "job") -> int | None:
    health = target.play([{"name": "health", "gpuops.relaunch.train_launch": {
        "name": name, "state": "health", "state_dir": target.state_dir}}]).result("health")
    return health["pid"] if health["running"] else None


# --- item 4: a start that cannot work changes nothing --------------------------------------------


def relaunch_vars(target: Target, script: Path, **overrides: Any) -> dict[str, Any]:
    assert target.namespace is not None
    values = dict(
        nsenter_vars(target.namespace.init_pid),
        job_launch_name="job",
        job_launch_command=[PYTHON, str(script), "--ready-after", "0.1"],
        job_launch_log_path=target.log(),
        job_launch_state_dir=target.state_dir,
        job_launch_ready_regex="^step 1 ",
        job_launch_min_uptime=0.5,
        job_launch_startup_timeout=60,
        job_launch_term_timeout=5,
        process_cleanup_match=[f"{script}\\b".replace(".", "\\.")],
        process_cleanup_term_timeout=5,
        gpu_drain_gpus_required=False,
        gpu_drain_timeout=20,
        container_reset_allowed=False,
    )
    values.update(overrides)
    return values


def relaunch(target: Target, values: dict[str, Any], check: bool = False) -> PlaybookRun:
    inventory = target.work / "relaunch.json"
    inventory.write_text(json.dumps({"all": {"hosts": {"ct": values}}}), encoding="utf-8")
    run = run_playbook(RELAUNCH, inventory=str(inventory), check=check)
    for hosts in run.tasks.values():
        for result in hosts:
            target.remember(result)
    return run


def test_a_relaunch_whose_log_cannot_be_written_stops_nothing(target: Target) -> None:
    script = target.work / "demo_train.py"
    shutil.copy(DEMO, script)
    first = relaunch(target, relaunch_vars(target, script))
    assert first.rc == 0, first.stdout[-3000:]
    pid = first.summary()["job"]["pid"]
    assert running_pid(target) == int(pid)

    # A read-only bind mount, in the namespace's own mount namespace only.
    read_only = target.work / "ro"
    read_only.mkdir()
    assert target.namespace is not None
    mounted = target.namespace.run_inside(["mount", "--bind", "-o", "ro", str(read_only), str(read_only)])
    assert mounted.returncode == 0, mounted.stderr
    assert target.namespace.run_inside(["touch", str(read_only / "probe")]).returncode != 0

    # Another log path is another spec: the relaunch is wanted, and its start cannot work.
    run = relaunch(target, relaunch_vars(target, script, job_launch_log_path=str(read_only / "logs" / "train.log")))
    assert run.rc != 0
    summary = run.summary()
    why = (f"log_path: cannot create the log directory '{read_only}/logs': {read_only} "
           "is on a read-only file system")
    assert why in summary["failed"], summary["failed"]
    assert why in run.result(FAILED)["msg"]
    assert not run.ran_step("stop")  # the probe failed: nothing was stopped
    assert summary["relaunched"] is False
    assert running_pid(target) == int(pid)

    # train_launch itself, state=restarted: refused before the stop, naming the option and the path.
    restart = target.play([target.launch_task(command=[PYTHON, str(script), "--ready-after", "0.1"],
                                              state="restarted", log_path=str(read_only / "train.log"))])
    result = restart.result("launch")
    assert result["failed"] is True and result["changed"] is False
    assert result["msg"] == f"log_path: the log directory '{read_only}' is on a read-only file system"
    assert result["option_problems"] == [{"option": "log_path", "reason": result["msg"][len("log_path: "):]}]
    assert running_pid(target) == int(pid)
    assert not (target.work / "train.log.1").exists()


# --- item 5: paths are walked, not trusted ---------------------------------------------------------


def test_a_directory_the_jobs_user_swapped_for_a_symlink_is_never_followed(target: Target, site: Path) -> None:
    log = str(site / "home" / "logs" / "train.log")
    with readable_by_all(DEMO) as copies:
        start = target.launch_task(command=target.demo(script=copies[DEMO]), user="nobody", group="nogroup",
                                   log_path=log)
        started = target.play([start]).result("launch")
        assert started["running"] is True, started
        plant(site, "logs")
        plant(site, "cache")

        # A look reads no root-only file through the link.
        health = running_pid(target)
        assert health == started["pid"]
        looked = target.play([{"name": "health", "gpuops.relaunch.train_launch": {
            "name": "job", "state": "health", "state_dir": target.state_dir, "log_tail_lines": 50}}]).result("health")
        assert "root's own log" not in looked["log_tail"]

        # A restart (with a compile cache to clear) is refused before anything is stopped, naming both.
        restarted = target.play([dict(start, **{"gpuops.relaunch.train_launch": dict(
            start["gpuops.relaunch.train_launch"], state="restarted",
            remove_paths=[str(site / "home" / "cache" / "precious")])})]).result("launch")
        assert restarted["failed"] is True and restarted["changed"] is False
        assert f"log_path: the log directory '{site}/home/logs' cannot be reached safely: {site}/home/logs is a " \
               "symbolic link that a user other than root can change" in restarted["msg"]
        assert f"remove_paths: '{site}/home/cache/precious' cannot be reached safely: {site}/home/cache is a " \
               "symbolic link" in restarted["msg"]
        assert running_pid(target) == started["pid"]
        rootonly_untouched(site)


def test_the_job_launch_role_never_follows_a_planted_log_directory(target: Target, site: Path) -> None:
    # The role used to make the log directory with ansible.builtin.file, which follows a symlink and
    # set the root-only directory at its end to 0755; train_launch now makes it, walking the path.
    plant(site, "logs")
    run = target.play([{"name": "role", "ansible.builtin.include_role": {"name": "gpuops.relaunch.job_launch"},
                        "vars": {"job_launch_name": "job", "job_launch_command": [PYTHON, DEMO],
                                 "job_launch_log_path": str(site / "home" / "logs" / "train.log"),
                                 "job_launch_state_dir": target.state_dir}}])
    failed = run.result("gpuops.relaunch.job_launch : Launch the job and prove it started")
    assert failed["failed"] is True and f"{site}/home/logs is a symbolic link" in failed["msg"]
    assert (site / "rootonly").stat().st_mode & 0o777 == 0o700
    rootonly_untouched(site)


def test_a_state_dir_the_jobs_user_swapped_for_a_symlink_is_never_written_through(target: Target, site: Path) -> None:
    state_dir = str(site / "home" / "state")
    with readable_by_all(DEMO) as copies:
        start = target.launch_task(command=target.demo(script=copies[DEMO]), user="nobody", group="nogroup",
                                   log_path=str(site / "home" / "logs" / "train.log"), state_dir=state_dir)
        started = target.play([start]).result("launch")
        assert started["running"] is True, started
        # root made state/ (0700) in nobody's home: nobody cannot enter it, but can move it aside.
        plant(site, "state")
        again = target.play([start]).result("launch")
        assert again["failed"] is True and again["changed"] is False
        assert f"{site}/home/state is a symbolic link that a user other than root can change" in again["msg"]
        assert again["msg"].startswith("state_dir: ")
        rootonly_untouched(site)  # no job/ directory, no records written into root's directory


# A job that prints the file 'secret' of its working directory into its log (if it may read it there).
READS_ITS_WORKDIR = ("import os, time; print(open('secret').read() if os.access('secret', os.R_OK) else 'no secret here', "
                     "flush=True); print('step 1 ready', flush=True); time.sleep(600)")


def test_a_chdir_and_a_program_are_checked_as_the_jobs_user_and_never_followed_as_root(target: Target, site: Path) -> None:
    """Issue 24 items 1, 2: vault/ is root's (0700); inside it inner/ (0755) holds a secret and a program
    anyone may read and run by their mode bits, but nobody cannot pass vault/ to reach them."""
    vault = site / "vault"
    (vault / "inner").mkdir(parents=True)
    vault.chmod(0o700)
    (vault / "inner" / "secret").write_text("root's secret\n")
    program = vault / "inner" / "train.sh"
    program.write_text("#!/bin/sh\necho 'step 1 ready'\nexec sleep 600\n")
    program.chmod(0o755)
    workdir = site / "home" / "work"
    as_nobody("mkdir", str(workdir))
    start = target.launch_task(command=[PYTHON, "-c", READS_ITS_WORKDIR], user="nobody", group="nogroup",
                               chdir=str(workdir))
    started = target.play([start]).result("launch")
    assert started["running"] is True, started
    look = {"name": "health",
            "gpuops.relaunch.train_launch": {"name": "job", "state": "health", "state_dir": target.state_dir}}

    def restart(**changes: Any) -> dict[str, Any]:
        return {"name": "launch", "ignore_errors": True, "gpuops.relaunch.train_launch": dict(
            start["gpuops.relaunch.train_launch"], state="restarted", **changes)}

    # A program below a directory nobody cannot pass: asked as nobody, refused before the stop.
    run = target.play([restart(command=[str(program)]), look])
    refused = run.result("launch")
    assert refused["failed"] is True and refused["changed"] is False, refused
    assert f"command: '{program}' is not an executable file for user nobody (Permission denied)" in refused["msg"]
    assert run.result("health")["running"] is True and run.result("health")["pid"] == started["pid"]

    # Between two runs nobody swaps its working directory for a link into vault/: never entered.
    as_nobody("mv", str(workdir), str(site / "home" / "work.old"))
    as_nobody("ln", "-s", str(vault / "inner"), str(workdir))
    run = target.play([restart(), look])
    refused = run.result("launch")
    assert refused["failed"] is True and refused["changed"] is False, refused
    assert f"chdir: the working directory '{workdir}' cannot be entered as user nobody: Permission denied" \
        in refused["msg"]
    assert run.result("health")["running"] is True and run.result("health")["pid"] == started["pid"]
    assert "root's secret" not in Path(target.log()).read_text()
    rootonly_untouched(site)


# --- item 7: terminals obey bytes --------------------------------------------------------------------


def hostile(target: Target, name: str, **options: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {"ready_regex": "^step 1 ", "min_uptime": 0.3, "progress_regex": r"^step (\d+ \S+)"}
    settings.update(options)
    return target.launch_task(name=name, task_name=name, command=[PYTHON, "-c", HOSTILE_JOB], **settings)


def test_a_second_job_on_the_first_jobs_log_is_refused_before_anything_changes(target: Target) -> None:
    """Two jobs cannot share a log, however it is spelt: the second's start would rotate the first's live log away."""
    first = target.play([target.launch_task(name="first")]).result("launch")
    assert first["running"] is True
    (target.work / "linked").symlink_to(target.work)  # root's link in a directory only root may write
    spellings = {"same": target.log(), "slashes": "/" + target.log(), "dot": f"{target.work}/./train.log",
                 "linked directory": f"{target.work}/linked/train.log", "its rotation": target.log() + ".1"}
    tasks = [dict(target.launch_task(name="second", task_name=case, log_path=path), ignore_errors=True)
             for case, path in spellings.items()]
    # The first job's own log, spelt anew: the same log, so the healthy job is not restarted.
    tasks += [target.launch_task(name="first", task_name=f"first {case}", log_path=spellings[case])
              for case in ("slashes", "dot")]
    tasks.append(dict(target.launch_task(name="second", task_name="probe", state="probe", log_path="/" + target.log()),
                      ignore_errors=True))
    run = target.play(tasks)
    for case in (*spellings, "probe"):
        refused = run.result(case)
        assert refused["failed"] is True and refused["changed"] is False, (case, refused)
        assert [problem["option"] for problem in refused["option_problems"]] == ["log_path"], case
        assert "job 'first'" in refused["msg"] and f"pid {first['pid']}" in refused["msg"], refused["msg"]
    for case in ("slashes", "dot"):
        same = run.result(f"first {case}")
        assert same["changed"] is False and same["operation"] == "none" and same["pid"] == first["pid"], same
    # Nothing changed: the first job runs, writes the same log, which was not rotated.
    assert not Path(target.log() + ".1").exists() and not (Path(target.state_dir) / "second" / "run.json").exists()
    health = target.play([target.launch_task(name="first", task_name="health", state="health")]).result("health")
    assert health["health"]["state"] == "running" and health["pid"] == first["pid"]
    # Once the first job ended, its record blocks nothing.
    stop = {"name": "stop", "gpuops.relaunch.train_launch": {"name": "first", "state": "stopped",
                                                             "state_dir": target.state_dir, "term_timeout": 5}}
    second = target.launch_task(name="second", task_name="second", log_path="/" + target.log())
    after = target.play([stop, second])
    assert after.result("stop")["changed"] is True
    assert after.result("second")["running"] is True and after.result("second")["rotated_log"] == "/" + target.log() + ".1"


def test_a_jobs_terminal_escapes_reach_results_and_messages_only_escaped(target: Target) -> None:
    started = target.play([hostile(target, "loud")]).result("loud")
    assert started["running"] is True, started
    assert started["ready_line"] == "step 1 \\x1b[1mloss\\x1b[0m=1.5"
    assert "boot \\x1b]0;owned\\x07 \\x1b[2J\\x1b[31mred\\x1b[0m \\x9b6n \\x9b \\x7f \\xff" in started["log_tail"]
    assert_escaped(started)

    def at_step_two() -> dict[str, Any] | None:
        found = target.play([{"name": "health", "gpuops.relaunch.train_launch": {
            "name": "loud", "state": "health", "state_dir": target.state_dir,
            "progress_regex": r"^step (\d+ \S+)"}}]).result("health")
        return found if found["health"]["last_step"] == "2 \\x1b[1mloss\\x1b[0m=1.5" else None

    looked = wait_until(at_step_two, what="the last progress line")
    assert looked["health"]["last_progress_line"] == "step 2 \\x1b[1mloss\\x1b[0m=1.5"
    assert "\\x1b[1mloss" in looked["health"]["reason"]
    assert_escaped(looked)


def test_a_crashed_jobs_escapes_stay_escaped_in_the_incident_and_relaunch_message(target: Target) -> None:
    crash = hostile(target, "crash", env={"EXIT": "3"}, min_uptime=0.1, max_relaunches=0)
    target.play([crash])  # proven at step 1, then it crashes
    assert target.namespace is not None
    values = dict(
        nsenter_vars(target.namespace.init_pid),
        job_launch_name="crash", job_launch_command=[PYTHON, "-c", HOSTILE_JOB], job_launch_env={"EXIT": "3"},
        job_launch_log_path=target.log(), job_launch_state_dir=target.state_dir, job_launch_ready_regex="^step 1 ",
        job_launch_min_uptime=0.1, job_launch_max_relaunches=0, gpu_drain_gpus_required=False,
        container_reset_allowed=False, process_cleanup_match=["^never-matches-gpuops$"],
    )

    def crashed() -> bool:
        health = target.play([{"name": "health", "gpuops.relaunch.train_launch": {
            "name": "crash", "state": "health", "state_dir": target.state_dir}}]).result("health")
        return health["health"]["state"] == "crashed"

    wait_until(crashed, what="the crash")
    # relaunch.yml: the crash-loop guard refuses, and its failure message quotes the log tail.
    run = relaunch(target, values)
    assert run.rc != 0
    refused = run.result(REFUSED)["msg"]
    assert "crash \\x1b]52;c;cGF3bmVk\\x07" in refused and "boot \\x1b]0;owned\\x07" in refused
    assert not raw_controls(refused), refused
    assert_escaped(run.result("Look at the job, decide, and relaunch a job of one host"))  # the refusal's summary

    # A relaunch (no guard) writes the incident record before anything else: its quotes are escaped too.
    relaunched = target.play([dict(crash, **{"gpuops.relaunch.train_launch": dict(
        crash["gpuops.relaunch.train_launch"], max_relaunches=None)})]).result("crash")
    record = json.loads(Path(relaunched["incident"]).read_text(encoding="utf-8"))
    assert "crash \\x1b]52;c;cGF3bmVk\\x07" in record["log_tail"]
    assert_escaped(record)
    assert_escaped(relaunched)


def test_two_starts_on_one_log_at_the_same_instant_cannot_both_pass(target: Target, tmp_path: Path) -> None:
    """The first job moves to a new log while its old run, which ignores SIGTERM, takes term_timeout to stop;
    the second job's first start on that log comes meanwhile. Checked and claimed in one step, one start wins and
    the other is refused naming log_path; never both on one log (the later start would rotate the other's live log)."""
    shared = str(target.work / "shared.log")
    command = target.demo("--ready-after", "0.1", "--ignore-term")
    old = target.play([target.launch_task(name="first", command=command)]).result("launch")
    assert old["running"] is True
    move = dict(target.launch_task(name="first", task_name="move", command=command, log_path=shared), ignore_errors=True)
    mover = playbook_popen(target, [move], tmp_path / "move.out")
    try:
        lock = Path(target.state_dir) / "first" / ".lock"
        wait_until(lambda: _held(lock), timeout=60, what="the first job's task to hold its lock", interval=0.05)
        second = target.play([dict(target.launch_task(name="second", task_name="second", log_path=shared),
                                   ignore_errors=True)]).result("second")
        mover.wait(timeout=120)
    finally:
        if mover.poll() is None:
            os.killpg(mover.pid, 9)  # the test's own ansible-playbook session
            mover.wait()
    checks = target.play([target.launch_task(name=name, task_name=name, state="health") for name in ("first", "second")])
    on_shared = [name for name in ("first", "second") if checks.result(name)["health"]["state"] == "running"
                 and (target.read_state(name, "run.json") or {}).get("log_path") == shared]
    assert len(on_shared) == 1, ((tmp_path / "move.out").read_text()[-3000:], second)
    if on_shared == ["first"]:
        assert second["failed"] is True and [p["option"] for p in second["option_problems"]] == ["log_path"], second
        assert "job 'first'" in second["msg"], second["msg"]
    assert not Path(shared + ".1").exists()  # nobody's live log was rotated away


def _held(lock: Path) -> bool:
    """Whether another process holds the flock on `lock` now."""
    import fcntl  # pylint: disable=import-outside-toplevel
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
