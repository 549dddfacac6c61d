"""_metrics/textfile.py: a relaunch summary as the Prometheus text format, written whole, never through a symlink.

The text is read back with a small parser that follows the exposition format's rules (the real
promtool and node_exporter read it in tests/integration/test_metrics_node_exporter.py).
"""

from __future__ import annotations

import math
import os
import re
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import ESCALATION_WORDS, HEALTH_WORDS
from ansible_collections.gpuops.relaunch.plugins.module_utils._launch.decision import ACTION_WORDS as DECISION_ACTIONS
from ansible_collections.gpuops.relaunch.plugins.module_utils._metrics.textfile import (
    ACTION_WORDS,
    HEALTH_SERIES,
    HOST_LABEL,
    JOB_LABEL,
    LIVE_FILE_PREFIX,
    LIVE_TIMESTAMP_METRIC,
    RUN_LABEL,
    TIMESTAMP_METRIC,
    Family,
    MetricsWriteError,
    comparable,
    escape_label_value,
    file_name,
    format_value,
    job_metrics,
    live_metrics,
    render,
    write_textfile,
)

NOBODY = 65534
NOW = 1767225600.5
# An inventory hostname is any text: the label keeps it as it is.
HOST = 'gpu-node-7 "a"\\b'
SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\.)*)",?')


def unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "\\": "\\", '"': '"'}[m.group(1)], text)


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(name, sorted labels): value}; asserts every line is a comment of the format or one sample."""
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    assert text.endswith("\n")
    typed: set[str] = set()
    for line in text.split("\n")[:-1]:  # lines end at "\n" only, as the format says
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _hash, _type, name, kind = line.split(" ")
            assert kind == "gauge" and name not in typed
            typed.add(name)
            continue
        match = SAMPLE.match(line)
        assert match, line
        body = match["labels"] or ""
        pairs = LABEL.findall(body)
        assert "".join(f'{k}="{v}",' for k, v in pairs).rstrip(",") == body, line
        key = (match["name"], tuple(sorted((k, unescape(v)) for k, v in pairs)))
        assert key not in samples, f"duplicate series {key}"
        assert match["name"] in typed, f"{match['name']} has no TYPE line before it"
        samples[key] = float(match["value"])
    return samples


def value(samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def summary(**overrides) -> dict:
    base = {
        "health": {"state": "stalled", "since_progress": 912.25, "last_step": "1200",
                   "last_progress_at": "2026-01-01T00:00:00+00:00"},
        "relaunch_guard": {"recent": 2, "max_relaunches": 3},
        "action": "relaunch", "failed": None, "found": "container_reboot", "container_reset": True,
        "gpu_released": True,
    }
    base.update(overrides)
    return base


GPUS = [{"index": 1, "uuid": "GPU-b", "used_mib_after": 0.0}, {"index": 0, "uuid": "GPU-a", "used_mib": 40960.5}]


def test_the_checkpoint_resumed_is_told():
    found = {"step": 1200, "torn_skipped": 2, "work_lost_steps": 34}
    samples = parse(render(job_metrics("llm", summary(checkpoint=found), GPUS, NOW, HOST)))
    assert value(samples, "gpuops_job_resumed_checkpoint_step", gpuops_host=HOST, gpuops_job="llm") == 1200
    assert value(samples, "gpuops_job_torn_checkpoints_skipped", gpuops_host=HOST, gpuops_job="llm") == 2
    assert value(samples, "gpuops_job_work_lost_steps", gpuops_host=HOST, gpuops_job="llm") == 34
    assert "gpuops_job_resumed_checkpoint_step" not in render(job_metrics("llm", summary(), GPUS, NOW, HOST))


def test_every_metric_of_a_full_summary():
    samples = parse(render(job_metrics("llm", summary(), GPUS, NOW, HOST)))
    for word in HEALTH_WORDS:
        assert value(samples, "gpuops_job_health", gpuops_host=HOST, gpuops_job="llm", state=word) == (1 if word == "stalled" else 0)
    assert value(samples, "gpuops_job_seconds_since_progress", gpuops_host=HOST, gpuops_job="llm") == 912.25
    assert value(samples, "gpuops_job_last_progress_timestamp_seconds", gpuops_host=HOST, gpuops_job="llm") == 1767225600
    assert value(samples, "gpuops_job_last_step", gpuops_host=HOST, gpuops_job="llm") == 1200
    assert value(samples, "gpuops_job_recent_relaunches", gpuops_host=HOST, gpuops_job="llm") == 2
    assert value(samples, "gpuops_job_relaunch_limit", gpuops_host=HOST, gpuops_job="llm") == 3
    assert value(samples, TIMESTAMP_METRIC, gpuops_host=HOST, gpuops_job="llm") == NOW
    for word in ACTION_WORDS:
        assert value(samples, "gpuops_relaunch_last_action", gpuops_host=HOST, gpuops_job="llm", action=word) == (1 if word == "relaunch" else 0)
    for word in ESCALATION_WORDS:
        assert value(samples, "gpuops_relaunch_found", gpuops_host=HOST, gpuops_job="llm", escalation=word) == (1 if word == "container_reboot" else 0)
    assert value(samples, "gpuops_relaunch_container_reset", gpuops_host=HOST, gpuops_job="llm") == 1
    assert value(samples, "gpuops_relaunch_gpu_released", gpuops_host=HOST, gpuops_job="llm") == 1
    assert value(samples, "gpuops_gpu_memory_used_mib", gpuops_host=HOST, gpuops_job="llm", gpu="0", uuid="GPU-a") == 40960.5
    assert value(samples, "gpuops_gpu_memory_used_mib", gpuops_host=HOST, gpuops_job="llm", gpu="1", uuid="GPU-b") == 0
    assert len(samples) == 6 + 6 + 6 + 4 + len(ESCALATION_WORDS) + 2 + 2


def test_the_actions_are_the_decisions_and_failed():
    assert ACTION_WORDS == (*DECISION_ACTIONS, "failed")


def test_a_failed_step_is_the_action_failed_whatever_was_decided():
    samples = parse(render(job_metrics("j", summary(action="relaunch", failed="Launch: boom"), [], NOW, HOST)))
    assert value(samples, "gpuops_relaunch_last_action", gpuops_host=HOST, gpuops_job="j", action="failed") == 1
    assert value(samples, "gpuops_relaunch_last_action", gpuops_host=HOST, gpuops_job="j", action="relaunch") == 0


def test_the_order_is_fixed_and_gpus_follow_their_index():
    text = render(job_metrics("j", summary(), GPUS, NOW, HOST))
    assert text == render(job_metrics("j", summary(), list(reversed(GPUS)), NOW, HOST))
    names = [line.split(" ")[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert names[0] == "gpuops_job_health" and names[-1] == "gpuops_gpu_memory_used_mib"
    gpu_lines = [line for line in text.splitlines() if line.startswith("gpuops_gpu_memory_used_mib{")]
    assert ['gpu="0"' in gpu_lines[0], 'gpu="1"' in gpu_lines[1]] == [True, True]


@pytest.mark.parametrize("job", ['a"b', "a\nb", "a\\b", 'q"\\n"\n\\', "ünïcode ✓", "tab\tand\rcr", "}{,= "])
def test_a_job_name_cannot_break_the_file(job):
    text = render(job_metrics(job, summary(), GPUS, NOW, HOST))
    # One line per sample: a newline in the name is escaped, never written.
    samples = parse(text)
    assert value(samples, "gpuops_job_health", gpuops_host=HOST, gpuops_job=job, state="stalled") == 1
    assert {dict(labels)["gpuops_job"] for _name, labels in samples} == {job}
    assert {dict(labels)["gpuops_host"] for _name, labels in samples} == {HOST}


def test_after_a_relaunch_the_file_tells_the_new_run_and_keeps_what_the_probe_saw_apart():
    relaunched = summary(relaunched=True, after={"state": "running", "recent_relaunches": 3})
    samples = parse(render(job_metrics("llm", relaunched, GPUS, NOW, HOST)))
    labels = {"gpuops_host": HOST, "gpuops_job": "llm"}
    for word in HEALTH_WORDS:
        assert value(samples, "gpuops_job_health", **labels, state=word) == (1 if word == "running" else 0)
        assert value(samples, "gpuops_relaunch_probe_health", **labels, state=word) == (1 if word == "stalled" else 0)
    # This run's relaunch is counted; the stalled run's progress is not the new run's.
    assert value(samples, "gpuops_job_recent_relaunches", **labels) == 3
    names = {name for name, _labels in samples}
    assert not {"gpuops_job_seconds_since_progress", "gpuops_job_last_step",
                "gpuops_job_last_progress_timestamp_seconds"} & names


def test_a_failed_relaunch_leaves_the_health_after_it_unknown():
    failed = summary(failed="Launch: boom", after={"state": "unknown", "recent_relaunches": 3})
    samples = parse(render(job_metrics("llm", failed, [], NOW, HOST)))
    assert all(v == 0 for (name, _labels), v in samples.items() if name == "gpuops_job_health")
    assert value(samples, "gpuops_relaunch_probe_health", gpuops_host=HOST, gpuops_job="llm", state="stalled") == 1


def test_the_live_file_carries_the_jobs_lifetime_without_the_runs_label():
    lifetime = {"relaunches": 4, "first_at": 1.0, "last_failure": {
        "at": 1764691200.5, "health": "crashed", "cause": "hardware", "exit_code": None, "exit_signal": "SIGKILL"}}
    text = render(live_metrics("llm", "gpu1", {"state": "running"}, 1764691300.0, run="r1", lifetime=lifetime))
    job = 'gpuops_host="gpu1",gpuops_job="llm",gpuops_rank0="gpu1"'.split(",")
    assert "# TYPE gpuops_job_relaunches_total counter\n" in text
    assert f"gpuops_job_relaunches_total{{{job[1]},{job[0]},{job[2]}}} 4\n" in text
    assert ('gpuops_job_last_failure{gpuops_job="llm",gpuops_host="gpu1",gpuops_rank0="gpu1",health="crashed",'
            'signal="SIGKILL",cause="hardware"} 1\n') in text
    assert "gpuops_job_last_failure_timestamp_seconds{" in text and "gpuops_job_last_failure_exit_code" not in text
    # A record that says more than train_launch writes is not a label value; none, no series.
    odd = {"relaunches": True, "last_failure": {"health": "x" * 99, "cause": "Evil\n", "exit_signal": "kill -9",
                                                "exit_code": 3}}
    text = render(live_metrics("llm", "gpu1", {"state": "running"}, 1.0, run="r1", lifetime=odd))
    assert "gpuops_job_relaunches_total" not in text and "gpuops_job_last_failure_exit_code{" in text
    assert 'health="unknown",signal="",cause="unknown"} 1' in text
    assert "gpuops_job_last_failure" not in render(live_metrics("llm", "gpu1", {"state": "running"}, 1.0, run="r1"))


def test_a_job_with_a_live_file_has_its_health_series_there_and_nowhere_else():
    relaunch = parse(render(job_metrics("llm", summary(live_metrics="/m/gpuops_job_llm.prom"), GPUS, NOW, HOST)))
    health = {"state": "running", "since_progress": 4.5, "last_step": "7", "last_progress_at": "2026-01-01T00:00:00+00:00"}
    live = parse(render(live_metrics("llm", HOST, health, NOW, rank0="gpu-0", run="0123abcd")))
    relaunch_series, live_series = set(relaunch), set(live)
    # node_exporter refuses a series that two files write.
    assert not relaunch_series & live_series
    assert {name for name, _labels in live} == set(HEALTH_SERIES) | {LIVE_TIMESTAMP_METRIC}
    assert not set(HEALTH_SERIES) & {name for name, _labels in relaunch}
    # The live file also names the job's rank 0 (the event path groups the ranks' alerts by it) and the
    # run judged (each failed run is a notification of its own).
    labels = {"gpuops_host": HOST, "gpuops_job": "llm", "gpuops_rank0": "gpu-0", "gpuops_run": "0123abcd"}
    assert value(live, "gpuops_job_health", **labels, state="running") == 1
    assert value(live, "gpuops_job_seconds_since_progress", **labels) == 4.5
    assert value(live, "gpuops_job_last_step", **labels) == 7
    assert value(live, LIVE_TIMESTAMP_METRIC, **labels) == NOW
    assert file_name("llm", LIVE_FILE_PREFIX) == "gpuops_job_llm.prom" != file_name("llm")


def test_every_series_names_its_job_and_inventory_host_never_job_or_instance():
    # Prometheus renames a textfile's `job` to `exported_job` and sets `instance` to an address: the
    # rulebook limits a relaunch by these two labels, so every series carries both.
    samples = parse(render(job_metrics("llm", summary(), GPUS, NOW, HOST)))
    assert samples
    for name, labels in samples:
        keys = dict(labels)
        assert keys[JOB_LABEL] == "llm" and keys[HOST_LABEL] == HOST, name
        assert not {"job", "instance", "exported_job"} & set(keys), name


@pytest.mark.parametrize("host, text", [("", "inventory hostname"), (None, "inventory hostname"), ("h" * 254, "at most 253")])
def test_a_missing_or_overlong_host_names_its_option(host, text):
    with pytest.raises(BadOption) as raised:
        job_metrics("j", {}, [], NOW, host)
    assert raised.value.option == "host" and text in raised.value.reason


def test_escaping_follows_the_format():
    assert escape_label_value('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    family = Family("x", "help with \\ and\nnewline")
    family.add(1, job='"')
    assert render([family]) == '# HELP x help with \\\\ and\\nnewline\n# TYPE x gauge\nx{job="\\""} 1\n'


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "nan", "inf", "-Infinity"])
def test_nan_and_infinity_are_never_written(bad):
    health = {"state": "running", "since_progress": bad, "last_step": bad}
    gpus = [{"index": 0, "used_mib": bad}]
    text = render(job_metrics("j", summary(health=health, relaunch_guard={"recent": bad}), gpus, NOW, HOST))
    assert not re.search(r"(?i)nan|inf", text.replace("_info", ""))
    samples = parse(text)
    for name in ("gpuops_job_seconds_since_progress", "gpuops_job_last_step", "gpuops_job_recent_relaunches"):
        assert value(samples, name, gpuops_host=HOST, gpuops_job="j") is None
    assert not any(name == "gpuops_gpu_memory_used_mib" for name, _labels in samples)
    family = Family("x", "h")
    family.add(math.nan)
    assert render([family]) == ""


def test_missing_data_is_left_out_not_guessed():
    samples = parse(render(job_metrics("j", {}, [], NOW, HOST)))
    names = {name for name, _labels in samples}
    assert names == {"gpuops_job_health", TIMESTAMP_METRIC, "gpuops_relaunch_last_action", "gpuops_relaunch_probe_health"}
    # No state seen: every health state is 0; nothing decided: the action is none.
    assert all(v == 0 for (name, _labels), v in samples.items() if name == "gpuops_job_health")
    assert value(samples, "gpuops_relaunch_last_action", gpuops_host=HOST, gpuops_job="j", action="none") == 1


def test_a_noop_run_has_no_found_no_drain_and_no_gpus():
    noop = summary(action="none", found="not looked: nothing was relaunched", container_reset=False, gpu_released=None,
                   health={"state": "running", "since_progress": None, "last_step": "step seven", "last_progress_at": None})
    samples = parse(render(job_metrics("j", noop, [], NOW, HOST)))
    names = {name for name, _labels in samples}
    assert "gpuops_relaunch_found" not in names and "gpuops_relaunch_gpu_released" not in names
    assert "gpuops_job_last_step" not in names  # a step that is not a number
    assert "gpuops_job_seconds_since_progress" not in names
    assert value(samples, "gpuops_relaunch_container_reset", gpuops_host=HOST, gpuops_job="j") == 0


@pytest.mark.parametrize("at, expect", [
    ("2026-01-01T00:00:00Z", 1767225600), ("2026-01-01T01:00:00+01:00", 1767225600),
    ("2026-01-01T00:00:00", None), ("yesterday", None), ("", None),
])
def test_the_last_progress_time_needs_its_offset(at, expect):
    health = {"state": "running", "last_progress_at": at}
    samples = parse(render(job_metrics("j", summary(health=health), [], NOW, HOST)))
    assert value(samples, "gpuops_job_last_progress_timestamp_seconds", gpuops_host=HOST, gpuops_job="j") == expect


@pytest.mark.parametrize("data, gpus, option, text", [
    ({"health": "running"}, [], "summary", "health must be a mapping"),
    ({"relaunch_guard": ["x"]}, [], "summary", "relaunch_guard must be a mapping"),
    ({"health": {"since_progress": "soon"}}, [], "summary", "health.since_progress must be a number, got 'soon'"),
    ({"health": {"since_progress": True}}, [], "summary", "got a boolean"),
    ({}, "GPU-a", "gpus", "must be a list of mappings"),
    ({}, [3], "gpus", "element 0 must be a mapping"),
    ({}, [{"used_mib": 1}], "gpus", "neither an index nor a uuid"),
    ({}, [{"index": -1}], "gpus", "whole number of 0 or more"),
    ({}, [{"index": 0.5}], "gpus", "whole number of 0 or more"),
    ({}, [{"index": 0, "used_mib": "lots"}], "gpus", "used_mib must be a number"),
    ({}, [{"index": 0}, {"index": "0"}], "gpus", "GPU 0 is listed more than once"),
])
def test_bad_input_names_its_option(data, gpus, option, text):
    with pytest.raises(BadOption) as raised:
        job_metrics("j", data, gpus, NOW, HOST)
    assert raised.value.option == option and text in raised.value.reason


def test_a_gpu_without_index_is_labelled_by_its_uuid():
    samples = parse(render(job_metrics("j", {}, [{"uuid": "GPU-x", "used_mib": 5}], NOW, HOST)))
    assert value(samples, "gpuops_gpu_memory_used_mib", gpuops_host=HOST, gpuops_job="j", gpu="GPU-x", uuid="GPU-x") == 5


@pytest.mark.parametrize("number, text", [(1.0, "1"), (0.0, "0"), (912.25, "912.25"), (1767225600.123, "1767225600.123"),
                                          (1e20, "1e+20"), (-3.0, "-3")])
def test_values_are_written_as_the_format_reads_them(number, text):
    assert format_value(number) == text
    assert float(text) == number


@pytest.mark.parametrize("job, name", [
    ("llm-pretrain_2.b", "gpuops_relaunch_llm-pretrain_2.b.prom"),
    ("..", "gpuops_relaunch_...prom"),
])
def test_a_safe_job_name_is_the_file_name(job, name):
    assert file_name(job) == name


@pytest.mark.parametrize("job", ["a/b", "../../etc/cron.d/x", "a b", 'q"', "a\nb", "ü", "a\x00b"])
def test_an_unsafe_job_name_is_made_safe_and_kept_apart(job):
    name = file_name(job)
    assert re.fullmatch(r"gpuops_relaunch_[A-Za-z0-9_.-]+-[0-9a-f]{12}\.prom", name), name
    assert "/" not in name and file_name(job) == name
    # "a/b" and "a_b" are two jobs: two files.
    assert name != file_name(re.sub(r"[^A-Za-z0-9_.-]", "_", job))


@pytest.mark.parametrize("job, text", [("", "non-empty"), ("x" * 201, "at most 200")])
def test_a_job_name_that_cannot_be_a_file_name_is_refused(job, text):
    with pytest.raises(BadOption) as raised:
        file_name(job)
    assert raised.value.option == "job" and text in raised.value.reason


@pytest.mark.parametrize("job", ["j", "cr\rin the name"])
def test_changed_looks_past_the_timestamp(job):
    first = render(job_metrics(job, summary(), GPUS, NOW, HOST))
    later = render(job_metrics(job, summary(), GPUS, NOW + 600, HOST))
    assert first != later and comparable(first) == comparable(later)
    other = render(job_metrics(job, summary(action="none"), GPUS, NOW, HOST))
    assert comparable(first) != comparable(other)


# --- the writer -------------------------------------------------------------------------------------


@pytest.fixture(name="textdir")
def textdir_fixture() -> Iterator[Path]:
    """A collector directory under a 0755 folder of root's in /tmp (pytest's tmp_path is 0700, so nobody
    could not reach it); removed at the end."""
    base = Path(tempfile.mkdtemp(prefix="gpuops-metrics-", dir="/tmp"))
    try:
        base.chmod(0o755)
        (base / "textfile").mkdir(mode=0o755)
        yield base / "textfile"
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=True, timeout=60)


def test_writes_the_file_whole_with_mode_0644(textdir):
    text = render(job_metrics("j", summary(), GPUS, NOW, HOST))
    written = write_textfile(str(textdir), "gpuops_relaunch_j.prom", text)
    path = textdir / "gpuops_relaunch_j.prom"
    assert written.path == str(path) and written.written and written.changed and written.before is None
    assert path.read_text(encoding="utf-8") == text
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(os.listdir(textdir)) == ["gpuops_relaunch_j.prom"]  # no temporary file left
    again = write_textfile(str(textdir), "gpuops_relaunch_j.prom", render(job_metrics("j", summary(), GPUS, NOW + 60, HOST)))
    assert again.written and not again.changed and again.before == text
    assert str(NOW + 60) in path.read_text(encoding="utf-8")
    other = write_textfile(str(textdir), "gpuops_relaunch_j.prom", render(job_metrics("j", summary(action="none"), [], NOW, HOST)))
    assert other.changed


def test_the_umask_does_not_take_the_read_bits(textdir):
    old = os.umask(0o077)
    try:
        write_textfile(str(textdir), "m.prom", "x 1\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((textdir / "m.prom").stat().st_mode) == 0o644


def test_check_mode_writes_nothing_and_says_whether_it_would_change(textdir):
    text = render(job_metrics("j", summary(), GPUS, NOW, HOST))
    would = write_textfile(str(textdir), "m.prom", text, check_mode=True)
    assert would.changed and not would.written and list(textdir.iterdir()) == []
    write_textfile(str(textdir), "m.prom", text)
    same = write_textfile(str(textdir), "m.prom", render(job_metrics("j", summary(), GPUS, NOW + 1, HOST)), check_mode=True)
    assert not same.changed and not same.written
    assert (textdir / "m.prom").read_text(encoding="utf-8") == text


def test_a_symlink_at_the_file_name_is_replaced_not_followed(textdir):
    victim = textdir.parent / "victim"
    victim.write_text("root's file\n")
    (textdir / "m.prom").symlink_to(victim)
    written = write_textfile(str(textdir), "m.prom", "x 1\n")
    assert written.changed and written.before is None  # what the link points at is never read
    assert victim.read_text() == "root's file\n"
    assert not (textdir / "m.prom").is_symlink() and (textdir / "m.prom").read_text() == "x 1\n"


def test_a_fifo_or_a_hard_link_at_the_file_name_is_replaced(textdir):
    os.mkfifo(textdir / "f.prom")
    assert write_textfile(str(textdir), "f.prom", "x 1\n").changed  # did not block on the FIFO
    assert (textdir / "f.prom").read_text() == "x 1\n"
    other = textdir.parent / "other"
    other.write_text("x 1\n")
    os.link(other, textdir / "h.prom")
    written = write_textfile(str(textdir), "h.prom", "x 2\n")
    assert written.changed and other.read_text() == "x 1\n"


def test_a_directory_that_is_missing_or_not_one_is_refused(textdir):
    with pytest.raises(MetricsWriteError, match="does not exist .*not created"):
        write_textfile(str(textdir / "missing"), "m.prom", "x 1\n")
    assert not (textdir / "missing").exists()
    (textdir / "file").write_text("")
    with pytest.raises(MetricsWriteError, match="is not a directory"):
        write_textfile(str(textdir / "file"), "m.prom", "x 1\n")
    with pytest.raises(MetricsWriteError, match="not an absolute path"):
        write_textfile("relative/dir", "m.prom", "x 1\n")


def test_a_directory_reached_through_a_link_another_user_can_change_is_refused(textdir):
    home = textdir.parent / "home"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)
    target = textdir.parent / "elsewhere"
    target.mkdir()
    subprocess.run(["ln", "-s", str(target), str(home / "link")], check=True, user=NOBODY, group=NOBODY,
                   extra_groups=[], timeout=30)
    with pytest.raises(MetricsWriteError, match="symbolic link that a user other than root can change"):
        write_textfile(str(home / "link"), "m.prom", "x 1\n")
    assert list(target.iterdir()) == []


def test_every_metric_the_alert_rules_read_is_one_that_is_written():
    rules = Path(__file__).resolve().parents[5] / "extensions" / "prometheus" / "rules"
    text = "".join(path.read_text(encoding="utf-8") for path in sorted(rules.glob("*.yml")))
    read = set(re.findall(r"\bgpuops_[a-z_]+\b", text)) - {JOB_LABEL, HOST_LABEL, RUN_LABEL}
    written = {family.name for family in job_metrics("j", {}, [], NOW, HOST) + live_metrics("j", HOST, {}, NOW, gpus={"ok": True, "gpus": []})}
    assert read and read <= written, sorted(read - written)


@pytest.mark.parametrize("run", ["", "a b", "x" * 65, "{{ 1 }}", "r1\n", 7])
def test_a_run_label_that_is_no_run_id_is_refused_naming_it(run):
    if run == "":
        # No run given: no label (a caller that knows none).
        assert all(dict(labels).get("gpuops_run") is None
                   for family in live_metrics("llm", HOST, {}, NOW, run=run) for labels, _value in family.samples)
        return
    with pytest.raises(BadOption, match="run"):
        live_metrics("llm", HOST, {}, NOW, run=run)


def test_a_gpu_gate_refusal_is_the_action_refused_and_names_each_bad_gpu():
    gate = {"outcome": "refuse", "bad": [{"index": 1, "uuid": "GPU-b", "escalation": "host_reboot"},
                                         {"index": 3, "uuid": "GPU-d", "escalation": "gpu_reset"}]}
    samples = parse(render(job_metrics("j", summary(action="refused", gpu_gate=gate), [], NOW, HOST)))
    assert value(samples, "gpuops_relaunch_last_action", gpuops_host=HOST, gpuops_job="j", action="refused") == 1
    assert value(samples, "gpuops_relaunch_gpu_bad", gpuops_host=HOST, gpuops_job="j", gpu="1", uuid="GPU-b",
                 escalation="host_reboot") == 1
    assert value(samples, "gpuops_relaunch_gpu_bad", gpuops_host=HOST, gpuops_job="j", gpu="3", uuid="GPU-d",
                 escalation="gpu_reset") == 1
