"""The fleet across the slices of a sliced AWX job (issue 27, item 4): part files that never replace each other, and a
merge whose counts add up (plugin_utils/relaunch_flow.merge_fleets, plugin_utils/report_files)."""

from __future__ import annotations

import json
import os

import pytest

from ansible_collections.gpuops.relaunch.plugins.plugin_utils.relaunch_flow import (
    FLEET_STATUSES, FleetError, awx_job, fleet_summary, host_summary, merge_fleets,
)
from ansible_collections.gpuops.relaunch.plugins.plugin_utils.report_files import (
    FLEET_FILE, ReportError, fleet_file_name, fleet_part, list_reports, read_report, summary_file_name,
    workflow_part_pattern, write_report,
)
from tests.harness.awx_slices import awx_meta_vars

RANKS = {"index": 0, "of": 2, "ranks": ["r0", "r1"]}


def summary(host: str, action: str = "none", failure: str | None = None, rank: dict | None = None) -> dict:
    results = {"probe": {"health": {"state": "crashed" if action == "relaunch" else "running"}},
               "decision": {"action": action, "why": "w"}}
    if action == "relaunch":
        results["launch"] = {"pid": 7, "operation": "start", "changed": True}
    return host_summary(host, False, results, failure, rank)


def slices() -> dict[str, dict]:
    """Two slices: a relaunched host and rank 1 of a job in one, rank 0 and a healthy host in the other."""
    one = fleet_summary({"a-solo": summary("a-solo", "relaunch"), "r1": summary("r1", rank=dict(RANKS, index=1))})
    two = fleet_summary({"r0": summary("r0", rank=RANKS), "z": summary("z"), "y": None})
    return {"fleet-awx-workflow-9-job-10.json": one, "fleet-awx-workflow-9-job-11.json": two}


def test_merged_counts_are_the_sum_of_the_parts_and_jobs_are_recounted_over_all_of_them():
    parts = slices()
    merged = merge_fleets(parts)
    assert set(merged["hosts"]) == {"a-solo", "r1", "r0", "z", "y"}
    assert merged["counts"] == {status: sum(part["counts"][status] for part in parts.values()) for status in FLEET_STATUSES}
    assert merged["counts"] == {"relaunched": 1, "unchanged": 3, "refused": 0, "failed": 1, "would_relaunch": 0}
    # Alone, slice one's job lists rank 0 (in the other slice) as failed; merged, it is not.
    assert parts["fleet-awx-workflow-9-job-10.json"]["jobs"]["r0"]["failed"] == ["r0"]
    assert merged["jobs"] == {"r0": {"ranks": ["r0", "r1"], "relaunched": [], "failed": []}}
    assert merged["parts"] == {"fleet-awx-workflow-9-job-10.json": 2, "fleet-awx-workflow-9-job-11.json": 3}
    # A merged fleet is a fleet: it merges again (with parts of another run).
    other = fleet_summary({"q": summary("q", "relaunch")})
    assert merge_fleets({"merged": merged, "other": other})["counts"]["relaunched"] == 2


def test_a_host_in_two_parts_is_refused_naming_the_host_and_the_parts():
    parts = slices()
    parts["fleet-awx-workflow-8-job-3.json"] = fleet_summary({"z": summary("z"), "r0": summary("r0", rank=RANKS)})
    with pytest.raises(FleetError) as raised:
        merge_fleets(parts)
    assert str(raised.value).startswith(
        "2 host(s) are in more than one fleet summary (r0 in fleet-awx-workflow-9-job-11.json, "
        "fleet-awx-workflow-8-job-3.json; z in fleet-awx-workflow-9-job-11.json, fleet-awx-workflow-8-job-3.json)")
    assert "nothing was merged" in str(raised.value)


@pytest.mark.parametrize("fleet, why", [
    ([], "a JSON list, not an object"),
    ({"hosts": {}}, "lacks hosts, jobs or counts"),
    ({"hosts": {"a": {"status": "fine"}}, "jobs": {}, "counts": {}}, "host(s) a have no status of a fleet"),
    ({"hosts": {"a": {"status": "relaunched"}}, "jobs": {},
      "counts": {"relaunched": 2, "unchanged": 0, "refused": 0, "failed": 0, "would_relaunch": 0}},
     "are not those of its 1 host(s)"),
    ({"hosts": {}, "jobs": {"a": {"ranks": "a,b"}}, "counts": dict.fromkeys(FLEET_STATUSES, 0)}, "no list of ranks"),
])
def test_what_is_not_a_fleet_summary_is_named_and_nothing_is_merged(fleet, why):
    with pytest.raises(FleetError) as raised:
        merge_fleets(dict(slices(), **{"x\x1b[2J.json": fleet}))
    assert str(raised.value).startswith("x\\x1b[2J.json: not a fleet summary of gpuops.relaunch.relaunch_fleet: ")
    assert why in str(raised.value)


def test_nothing_to_merge_and_ranks_that_differ_between_parts_are_refused():
    with pytest.raises(FleetError, match="no fleet summary to merge"):
        merge_fleets({})
    other = fleet_summary({"r1": summary("r1", rank={"index": 1, "of": 3, "ranks": ["r0", "r1", "r2"]})})
    with pytest.raises(FleetError, match="lists ranks r0, r1 in .* and r0, r1, r2 in b: these are not parts of one run"):
        merge_fleets({"a": slices()["fleet-awx-workflow-9-job-11.json"], "b": other})


def test_a_slice_writes_a_part_file_of_its_own_that_no_host_file_can_be():
    slice_one = fleet_part(awx_job(awx_meta_vars(10, 9, "relaunch")))
    slice_two = fleet_part(awx_job(awx_meta_vars(11, 9, "relaunch")))
    assert (slice_one, slice_two) == ("awx-workflow-9-job-10", "awx-workflow-9-job-11")
    assert fleet_file_name(slice_one) == "fleet-awx-workflow-9-job-10.json" != fleet_file_name(slice_two)
    # Outside AWX, and an AWX job of no workflow (no other job shares its fleet): fleet.json, as before.
    assert fleet_part(awx_job({})) == "" and fleet_part(awx_job(awx_meta_vars(5, None, "t"))) == ""
    assert fleet_file_name("") == FLEET_FILE
    assert "@" not in fleet_file_name("a@b/c") and "/" not in fleet_file_name("a@b/c")
    assert fleet_file_name(slice_one) != summary_file_name("fleet", "awx-workflow-9-job-10")


def test_a_workflows_parts_are_found_and_no_other_workflows(tmp_path):
    for name in ("fleet-awx-workflow-9-job-10.json", "fleet-awx-workflow-9-job-11.json", "fleet-awx-workflow-99-job-1.json",
                 "fleet-awx-workflow-9.json", "fleet.json", "h@j.json"):
        (tmp_path / name).write_text("{}", encoding="utf-8")
    assert list_reports(str(tmp_path), workflow_part_pattern("9")) == [
        "fleet-awx-workflow-9-job-10.json", "fleet-awx-workflow-9-job-11.json"]
    assert list_reports(str(tmp_path), workflow_part_pattern("[9]*")) == []
    with pytest.raises(ReportError, match="cannot list"):
        list_reports(str(tmp_path / "none"), "*")


def test_a_part_is_read_only_from_a_regular_file_of_json(tmp_path):
    fleet = slices()["fleet-awx-workflow-9-job-10.json"]
    write_report(str(tmp_path), "part.json", fleet)
    assert read_report(str(tmp_path), "part.json") == json.loads(json.dumps(fleet))
    os.symlink(tmp_path / "part.json", tmp_path / "link.json")
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "text.json").write_text("fleet: no", encoding="utf-8")
    (tmp_path / "bytes.json").write_bytes(b"\xff\xfe")
    for name, why in [("link.json", "is a symbolic link, not a report file"), ("fifo.json", "is not a regular file"),
                      ("dir.json", "is not a regular file"), ("text.json", "is not JSON"), ("bytes.json", "is not JSON"),
                      ("missing.json", "cannot open")]:
        with pytest.raises(ReportError) as raised:
            read_report(str(tmp_path), name)
        assert str(tmp_path / name) in str(raised.value) and why in str(raised.value), str(raised.value)
    for name in ("../part.json", "..", "", "a/b.json"):
        with pytest.raises(ReportError, match="must be a file name inside the directory"):
            read_report(str(tmp_path), name)
    # The directory is reached without a link another user could point elsewhere (one they own).
    (tmp_path / "parts").symlink_to(tmp_path)
    assert read_report(str(tmp_path / "parts"), "part.json") == json.loads(json.dumps(fleet))  # root's link
    os.lchown(tmp_path / "parts", 65534, 65534)
    with pytest.raises(ReportError, match="cannot open the directory"):
        read_report(str(tmp_path / "parts"), "part.json")


def test_a_part_nested_too_deeply_is_refused_naming_it(tmp_path):
    """No "maximum recursion depth exceeded": the file or the variable is named, nothing is merged."""
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    with pytest.raises(ReportError) as raised:
        read_report(str(tmp_path), "deep.json")
    assert str(tmp_path / "deep.json") in str(raised.value) and "nested too deeply" in str(raised.value)
    deep: dict = {}
    inner = deep
    for _level in range(5000):
        inner["hosts"] = {}
        inner = inner["hosts"]
    with pytest.raises(FleetError) as refused:
        merge_fleets(dict(slices(), **{"fleet_part_7": deep}))
    assert str(refused.value) == ("fleet_part_7: not a fleet summary of gpuops.relaunch.relaunch_fleet: it is nested "
                                  "more than 32 levels deep")
