"""The one escalation ranking and the one finding vocabulary (_base/verdict.py)."""

from __future__ import annotations

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import (
    FINDING_KINDS,
    Escalation,
    Finding,
    FindingKind,
    Verdict,
    worst,
)


def test_verdict_add_refuses_a_kind_outside_the_vocabulary():
    verdict = Verdict()
    # Words of earlier versions, plural forms, and anything else are programming errors.
    for word in ("zombies", "unreaped_orphans", "job_running", "driver_sleep", "gpu_devices_open", "", "ZOMBIE"):
        with pytest.raises(ValueError, match="is not a finding kind"):
            verdict.add(word, Escalation.SIGNALS, "why", [7])
    with pytest.raises(ValueError, match="is not a finding kind"):
        Finding("unreaped_zombie", Escalation.NONE, "why")
    assert verdict.findings == []


def test_a_kind_is_stored_and_reported_as_its_word():
    verdict = Verdict()
    verdict.add(FindingKind.UNREAPED_ORPHAN, Escalation.CONTAINER_REBOOT, "orphans", [9, 7])
    verdict.add("zombie", Escalation.SIGNALS, "a zombie", [5])
    assert [f.kind for f in verdict.findings] == ["unreaped_orphan", "zombie"]
    assert verdict.as_dict()["findings"][0] == {"kind": "unreaped_orphan", "escalation": "container_reboot",
                                                "pids": [7, 9], "why": "orphans"}
    assert verdict.escalation == Escalation.CONTAINER_REBOOT


def test_the_vocabulary_is_singular_and_unique():
    assert len(set(FINDING_KINDS)) == len(FINDING_KINDS)
    assert all(word == word.lower() and " " not in word for word in FINDING_KINDS)
    # One form: no word is another one plus an "s".
    assert not {word + "s" for word in FINDING_KINDS} & set(FINDING_KINDS)


def test_worst_is_the_one_ranking():
    assert worst([]) == Escalation.NONE
    assert worst([Escalation.SIGNALS, Escalation.HOST_ACTION, Escalation.CONTAINER_REBOOT]) == Escalation.HOST_ACTION
