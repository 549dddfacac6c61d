"""The XID table, the kernel-log records, the bursts and the GPU health verdict (_gpu/xid.py, _gpu/health.py)."""

from __future__ import annotations

import os

import pytest

from ansible_collections.gpuops.relaunch.plugins.module_utils._base.options import BadOption, OptionsInvalid
from ansible_collections.gpuops.relaunch.plugins.module_utils._base.verdict import ESCALATION_WORDS, Escalation, worst
from ansible_collections.gpuops.relaunch.plugins.module_utils._gpu import health, health_reads, query, xid
from tests.harness.gpu_holder import STATE_ENV, sim_gpu

BOOT = 1_767_225_600.0  # the epoch time of the kernel's timestamp 0 in these fixtures
LINE79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python3, GPU has fallen off the bus."


def record(message: str, usec: int, facility: int = 0, level: int = 3, seq: int = 1) -> bytes:
    """One /dev/kmsg record as the kernel gives it (with a dictionary line after the message)."""
    return f"{facility * 8 + level},{seq},{usec},-;{message}\n SUBSYSTEM=pci\n".encode()


def entry(index: int = 0, bus: str = "00000000:3B:00.0", **reads) -> dict:
    base = {"recovery_action": {"value": 0}, "remapped_rows": {"value": {"corrected": 0, "uncorrected": 0, "pending": False, "failure": False}},
            "retired_pages_pending": {"value": False}, "ecc_uncorrected_volatile": {"value": 0},
            "nvlink": {"unsupported": "no NVLink"}, "throttle_reasons": {"value": 0}}
    base.update(reads)
    return {"index": index, "uuid": f"GPU-{index}", "pci_bus_id": bus, "identity_errors": [], "reads": base}


def test_the_gpu_words_rank_between_a_container_reboot_and_host_action():
    assert ESCALATION_WORDS == ("none", "signals", "container_reboot", "gpu_reset", "host_reboot", "host_action")
    assert worst([Escalation.HOST_REBOOT, Escalation.GPU_RESET, Escalation.CONTAINER_REBOOT]) == Escalation.HOST_REBOOT
    assert worst([Escalation.HOST_REBOOT, Escalation.HOST_ACTION]) == Escalation.HOST_ACTION


def test_the_table_classes_follow_the_catalog_and_say_where_sources_disagree():
    classes = {code: rule.xid_class for code, rule in xid.XID_TABLE.items()}
    assert {c for c, k in classes.items() if k == xid.APPLICATION} == {13, 31, 43, 45, 94}
    assert {c for c, k in classes.items() if k == xid.RESET_GPU} == {46, 62, 64, 95, 109, 119, 120, 140, 143}
    assert {c for c, k in classes.items() if k == xid.REBOOT_HOST} == {79}
    assert {c for c, k in classes.items() if k == xid.WORKFLOW} == {48, 74, 154}
    assert {c for c, k in classes.items() if k == xid.INFORMATIONAL} == {63, 92}
    assert all(rule.source.startswith(xid.XID_CATALOG) for rule in xid.XID_TABLE.values())
    assert "device plugin" in xid.XID_TABLE[109].source
    assert "Azure" in xid.XID_TABLE[63].source and "Azure" in xid.XID_TABLE[92].source


def test_a_site_overrides_an_entry_and_bad_overrides_name_the_option():
    table = xid.xid_table({"92": "reset_gpu", 13: {"class": "reset_gpu", "bursts": 3}})
    assert table[92].xid_class == xid.RESET_GPU and table[92].source == xid.SITE_SOURCE
    assert table[13].bursts == 3 and xid.XID_TABLE[13].bursts == 1  # the shipped table is untouched
    for bad in ({"x": "reset_gpu"}, {79: "reboot"}, {79: {"class": "reset_gpu", "bursts": 0}},
                {79: {"class": "reset_gpu", "extra": 1}}, {79: {"class": "reset_gpu", "bursts": True}}):
        with pytest.raises(BadOption) as caught:
            xid.xid_table(bad)
        assert caught.value.option == "xid_overrides"


def test_bus_ids_of_the_log_and_of_nvml_are_the_same_gpu():
    assert xid.parse_bus_id("0000:3b:00") == xid.parse_bus_id("00000000:3B:00.0") == (0, 0x3B, 0)
    assert xid.nvml_bus_id((0, 0x3B, 0)) == "00000000:3B:00.0"
    assert xid.parse_bus_id("not a bus") is None


def test_only_the_kernels_own_records_after_the_cutoff_count():
    records = [
        record(LINE79, 5_000_000, seq=1),                       # before the cut-off
        record(LINE79, 20_000_000, seq=2),                      # counts
        record(LINE79, 21_000_000, facility=1, seq=3),          # written from user space (<12>, logger, echo)
        record("tmpfs: Unknown parameter '" + LINE79 + "'", 22_000_000, seq=4),  # the kernel quoting user text
        record("NVRM: Xid (PCI:0000:3b:00): 13, pid=7, name=\x1b]0;evil\x07" + "x" * 500, 23_000_000, seq=5),
        record("usb 1-1: new device", 24_000_000, seq=6),
        b"garbage without a header",
    ]
    scan = xid.scan_records(records, since=BOOT + 10, boot_time=BOOT)
    assert [(line.code, line.seq) for line in scan.lines] == [(79, 2), (13, 5)]
    assert scan.user_lines_ignored == 1 and scan.before_cutoff == 1 and scan.records == 7
    first = scan.lines[0]
    assert first.bus == (0, 0x3B, 0) and first.pid == 4242 and first.name == "python3" and first.time == BOOT + 20
    hostile = scan.lines[1]
    assert "\x1b" not in hostile.text and "\\x1b" in hostile.text and len(hostile.text) <= xid.MAX_XID_TEXT
    assert "\x07" not in hostile.name and len(hostile.name) <= xid.MAX_NAME


def test_a_scan_stops_at_its_byte_bound_and_counts_lost_records():
    records = [record("filler " * 20, i) for i in range(100)]
    scan = xid.scan_records([xid._LOST] + records, since=0, boot_time=BOOT, max_bytes=2000)
    assert scan.truncated and scan.bytes >= 2000 and scan.records < 100 and scan.lost_records == 1


def test_lines_close_together_are_one_burst():
    lines = [xid.XidLine(79, (0, 0x3B, 0), BOOT + t, i, 1, "p", "t") for i, t in enumerate((0, 1, 2, 30, 31))]
    lines.append(xid.XidLine(13, (0, 0x3B, 0), BOOT + 1.5, 9, 2, "q", "t"))
    found = xid.bursts(lines, window=10)
    assert [(b.code, b.lines) for b in found] == [(79, 3), (13, 1), (79, 2)]


def judged(*entries, lines=(), overrides=None, all_gpus=True) -> health.HostHealth:
    scan = xid.KernelLogScan(lines=list(lines))
    return health.judge_host(list(entries), scan, xid.xid_table(overrides), 10.0, all_gpus)


def test_a_clean_gpu_is_healthy_and_a_throttle_is_only_a_warning():
    host = judged(entry(throttle_reasons={"value": 0x80 | 0x1}))
    assert host.escalation == Escalation.NONE and host.as_dict()["healthy"]
    [gpu] = host.as_dict()["gpus"]
    assert gpu["reads"]["throttle_reasons"]["active"] == ["hw_power_brake_slowdown"] and gpu["warnings"]
    assert judged(entry()).judgement.findings[0].kind == "healthy"


@pytest.mark.parametrize(("reads", "kind", "escalation"), [
    ({"recovery_action": {"value": 1}}, "recovery_action", "gpu_reset"),
    ({"recovery_action": {"value": 4}}, "recovery_action", "gpu_reset"),
    ({"recovery_action": {"value": 2}}, "recovery_action", "host_reboot"),
    ({"recovery_action": {"value": 99}}, "recovery_action", "host_action"),
    ({"remapped_rows": {"value": {"corrected": 0, "uncorrected": 1, "pending": True, "failure": False}}}, "row_remap", "gpu_reset"),
    ({"remapped_rows": {"value": {"corrected": 0, "uncorrected": 9, "pending": False, "failure": True}}}, "row_remap", "host_action"),
    ({"retired_pages_pending": {"value": True}}, "retired_pages", "gpu_reset"),
    ({"ecc_uncorrected_volatile": {"value": 2}}, "ecc_errors", "gpu_reset"),
    ({"nvlink": {"value": {"up": [0, 1], "down": [2]}}}, "nvlink_down", "gpu_reset"),
    ({"remapped_rows": {"error": 15, "detail": "NVML error 15: GPU is lost"}}, "gpu_lost", "host_reboot"),
    ({"ecc_uncorrected_volatile": {"error": 16, "detail": "NVML error 16"}}, "reset_required", "gpu_reset"),
])
def test_each_read_is_judged(reads, kind, escalation):
    host = judged(entry(**reads))
    assert [(f.kind, f.escalation.value) for f in host.judgement.findings] == [(kind, escalation)]


def test_an_unsupported_read_says_so_and_is_not_a_finding():
    host = judged(entry(recovery_action={"unsupported": "the driver does not support it (Not Supported)"}))
    assert host.escalation == Escalation.NONE
    assert host.as_dict()["gpus"][0]["reads"]["recovery_action"]["status"] == "unsupported"


def line(code: int, t: float, bus=(0, 0x3B, 0)) -> xid.XidLine:
    return xid.XidLine(code, bus, BOOT + t, int(t * 10), 1, "python3", f"NVRM: Xid (PCI:0000:3b:00): {code}, ...")


@pytest.mark.parametrize(("code", "escalation"), [(13, "none"), (79, "host_reboot"), (95, "gpu_reset"), (63, "none"), (1234, "none")])
def test_xids_are_judged_by_the_table(code, escalation):
    assert judged(entry(), lines=[line(code, 1)]).escalation.value == escalation


def test_a_workflow_xid_reads_the_recovery_action_or_assumes_a_reset():
    assert judged(entry(), lines=[line(48, 1)]).escalation == Escalation.NONE
    unread = entry(recovery_action={"unsupported": "before 570"})
    assert judged(unread, lines=[line(48, 1)]).escalation == Escalation.GPU_RESET


def test_a_rule_counts_bursts_not_lines():
    overrides = {13: {"class": "reset_gpu", "bursts": 2}}
    one_burst = [line(13, t) for t in (1, 2, 3, 4)]
    assert judged(entry(), lines=one_burst, overrides=overrides).escalation == Escalation.NONE
    assert judged(entry(), lines=one_burst + [line(13, 100)], overrides=overrides).escalation == Escalation.GPU_RESET


def test_an_xid_of_a_gpu_nvml_does_not_list_counts_for_the_host_only_when_all_gpus_are_selected():
    gone = [line(79, 1, bus=(0, 0x86, 0))]
    assert judged(entry(), lines=gone).escalation == Escalation.HOST_REBOOT
    host = judged(entry(), lines=gone, all_gpus=False)
    assert host.escalation == Escalation.NONE and host.as_dict()["unmatched_xids"][0]["pci_bus_id"] == "00000000:86:00.0"


def test_bad_options_are_named_all_at_once():
    params = {"devices": [""], "since": float("nan"), "xid_overrides": {79: "nope"}, "burst_window": -1,
              "kernel_log": True, "kernel_log_timeout": 0, "query_timeout": 30}
    with pytest.raises(OptionsInvalid) as caught:
        health.options_from_params(params, now=BOOT)
    assert caught.value.options == ["devices", "since", "xid_overrides", "burst_window", "kernel_log_timeout"]
    good = dict(params, devices=[], since=-60, xid_overrides={}, burst_window=10, kernel_log_timeout=5)
    assert health.options_from_params(good, now=BOOT).since == BOOT - 60


class _Links:
    """NVML's NvLink calls as a driver answers them: `links` states (1 up, 0 down), then `past` for the
    first index the GPU does not have; counts the calls."""

    NVML_NVLINK_MAX_LINKS = 36
    NVML_FEATURE_ENABLED = 1

    class NVMLError(Exception):
        def __init__(self, value):
            super().__init__(value)
            self.value = value

    def __init__(self, links, past):
        self.links, self.past, self.calls = links, past, 0

    def nvmlDeviceGetNvLinkState(self, _handle, link):  # pylint: disable=invalid-name
        self.calls += 1
        if link >= len(self.links):
            raise self.NVMLError(self.past)
        return self.links[link]


@pytest.mark.parametrize("links, past, calls", [([], 3, 1), ([1] * 18, 2, 19), ([1, 0, 1], 3, 4)])
def test_nvlink_probing_stops_at_the_first_link_the_gpu_does_not_have(links, past, calls):
    fake = _Links(links, past)
    read = health_reads._read(fake, lambda: health_reads._nvlink(fake, None))  # pylint: disable=protected-access
    assert fake.calls == calls
    if links:
        assert read["value"]["down"] == [i for i, up in enumerate(links) if not up]
    else:
        assert "unsupported" in read


# --- the nvidia-smi fallback: the health fields of its -q -x report -------------------------------

OLD_REPORT = """<?xml version="1.0" ?>
<nvidia_smi_log><gpu id="00000000:3B:00.0"><uuid>GPU-old</uuid><pci><pci_bus_id>00000000:3B:00.0</pci_bus_id></pci>
<clocks_throttle_reasons><clocks_throttle_reason_hw_slowdown>Active</clocks_throttle_reason_hw_slowdown>
<clocks_throttle_reason_hw_power_brake_slowdown>Not Active</clocks_throttle_reason_hw_power_brake_slowdown></clocks_throttle_reasons>
<ecc_errors><volatile><double_bit><device_memory>2</device_memory><total>2</total></double_bit></volatile></ecc_errors>
<retired_pages><pending_retirement>Yes</pending_retirement></retired_pages>
<remapped_rows>N/A</remapped_rows></gpu></nvidia_smi_log>"""


def test_the_nvidia_smi_report_gives_the_health_reads_it_has_and_says_which_it_has_not():
    """A V100-era report (driver before 535): throttle reasons under their old name, double-bit ECC totals,
    retired pages pending, no remapped rows."""
    [(uuid, entry)] = list(query.parse_nvidia_smi_health(OLD_REPORT).items())
    assert uuid == "GPU-old" and entry["pci_bus_id"] == "00000000:3B:00.0"
    reads = entry["reads"]
    assert reads["throttle_reasons"] == {"value": 0x8}
    assert reads["ecc_uncorrected_volatile"] == {"value": 2}
    assert reads["retired_pages_pending"] == {"value": True}
    assert "unsupported" in reads["remapped_rows"] and "unsupported" in reads["recovery_action"]
    judged = health.judge_reads({"index": 0, "uuid": uuid, **entry})
    assert judged.escalation == Escalation.GPU_RESET
    assert {f.kind for f in judged.judgement.findings} >= {"ecc_errors", "retired_pages", "throttle"}


def test_the_nvidia_smi_fallback_reads_the_simulated_drivers_health_through_the_real_tools_report(tmp_path):
    """The fake nvidia-smi (a real process) prints the report from the simulated NVML; the fallback's
    entries judge as NVML's would for what the report has."""
    with sim_gpu(devices=2) as gpu:
        gpu.devices[1].update(remapped_rows=[3, 1, 1, 0], ecc_uncorrected_volatile=4, throttle_reasons=0x80)
        gpu.save()
        os.environ[STATE_ENV] = str(gpu.state_path)
        try:
            session = query.NvidiaSmiSession(os.path.join(gpu.fake_nvidia_smi_path(), "nvidia-smi"), 30)
            entries = session.health(None)
        finally:
            del os.environ[STATE_ENV]
    assert [e["index"] for e in entries] == [0, 1]
    assert entries[1]["pci_bus_id"] == "00000000:3C:00.0"
    assert entries[1]["reads"]["remapped_rows"]["value"] == {"corrected": 3, "uncorrected": 1, "pending": True, "failure": False}
    assert entries[1]["reads"]["ecc_uncorrected_volatile"] == {"value": 4}
    assert entries[1]["reads"]["throttle_reasons"] == {"value": 0x80}
    assert entries[0]["reads"]["retired_pages_pending"] == {"value": False}
    assert [health.judge_reads(e).escalation for e in entries] == [Escalation.NONE, Escalation.GPU_RESET]
