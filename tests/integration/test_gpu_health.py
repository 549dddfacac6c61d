"""gpuops.relaunch.gpu_health through ansible-playbook: the real kernel log and the simulated NVML.

XID lines are written into the real kernel log by the kernel itself (tests/harness/kernel_xid.py) and
read back from /dev/kmsg by the module; the same text written from user space, with or without a
priority prefix, and a line before the cut-off, must not count. The simulated driver (driven as in
test_gpu_mem_wait) reports a pending remap with a recovery action, a lost GPU, and reads the driver
does not support. One playbook run, two looks (all GPUs; one GPU by UUID in check mode).
"""

from __future__ import annotations

import os
import sys
import time

from tests.harness.gpu_holder import sim_gpu
from tests.harness.kernel_xid import kernel_xids
from tests.harness.playbook import run_playbook
from tests.harness.procstates import wait_until

MODULE = "gpuops.relaunch.gpu_health"
TARGET_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


def test_xids_from_the_kernel_log_and_the_simulated_gpus_are_judged() -> None:
    with sim_gpu(devices=4) as gpu, kernel_xids() as log:
        # Buses no other test's simulated GPU has (they start at 3B): the kernel log is the machine's, and a
        # relaunch's GPU gate elsewhere would count these XID 79s against its own GPU 0.
        for device in gpu.devices:
            device["pci_bus_id"] = "00000000:%02X:00.0" % (0xE0 + gpu.devices.index(device))
        gpu.devices[1].update(remapped_rows=[0, 1, 1, 0], recovery_action=1)
        gpu.devices[2].update(recovery_action=None)  # a driver before 570: the field is not supported
        gpu.devices[3]["lost"] = True
        gpu.fault("nvmlDeviceGetRemappedRows", "NOT_SUPPORTED", device=2)
        gpu.save()
        log.kernel_line("NVRM: Xid (PCI:0000:e2:00): 95, pid=1, name=before, Uncontained ECC error.")
        # The kernel stamps a record with its own clock, read here through CLOCK_MONOTONIC: a cut-off taken the
        # same millisecond can fall either side of it. Half a second apart, the XID 95 is before it for certain.
        cutoff = time.time() + 0.5
        wait_until(lambda: time.time() > cutoff, timeout=5, what="the cut-off to pass", interval=0.05)
        log.kernel_line("NVRM: Xid (PCI:0000:e0:00): 79, pid=4242, name=python3, GPU has fallen off the bus.")
        log.kernel_line("NVRM: Xid (PCI:0000:e0:00): 79, pid=4242, name=python3, GPU has fallen off the bus.")
        log.kernel_line("NVRM: Xid (PCI:0000:e2:00): 13, pid=77, name=\x1b[2Jtrain, Graphics Exception")
        for prefix in ("", "<3>", "<12>"):
            log.user_line("NVRM: Xid (PCI:0000:e2:00): 79, pid=1, name=forged, GPU has fallen off the bus.", prefix)
        tasks = [
            {"name": "all", MODULE: {"since": cutoff}, "environment": gpu.env()},
            {"name": "one", MODULE: {"devices": [gpu.devices[2]["uuid"]], "since": cutoff}, "environment": gpu.env(),
             "check_mode": True},
        ]
        run = run_playbook([{"hosts": "localhost", "connection": "local", "gather_facts": False,
                             "vars": {"ansible_python_interpreter": TARGET_PYTHON}, "tasks": tasks}], timeout=300)
    whole, one = run.result("all"), run.result("one")

    assert not whole.get("failed") and whole["changed"] is False, whole
    assert whole["backend"] == "pynvml" and whole["healthy"] is False
    assert whole["escalation"] == "host_reboot"
    by_index = {entry["index"]: entry for entry in whole["gpus"]}
    # GPU 0 (bus E0): one burst of two kernel lines of XID 79 after the cut-off.
    [burst] = by_index[0]["xids"]
    assert (burst["xid"], burst["class"], burst["lines"], burst["pids"]) == (79, "reboot_host", 2, [4242])
    assert by_index[0]["escalation"] == "host_reboot"
    # GPU 1: the pending remap and the recovery action say a reset.
    assert {(f["kind"], f["escalation"]) for f in by_index[1]["findings"]} == {("row_remap", "gpu_reset"), ("recovery_action", "gpu_reset")}
    assert by_index[1]["reads"]["recovery_action"] == {"status": "ok", "value": 1, "action": "gpu_reset"}
    # GPU 2 (bus E2): its XID 95 was before the cut-off and the forged 79s came from user space; the
    # application's XID 13 counts only as the application's. Unsupported reads say so, and are no error.
    assert by_index[2]["escalation"] == "none"
    assert [(x["xid"], x["class"]) for x in by_index[2]["xids"]] == [(13, "application")]
    assert "\x1b" not in str(by_index[2]["xids"]) and "\\x1b" in by_index[2]["xids"][0]["text"]
    assert by_index[2]["reads"]["recovery_action"]["status"] == "unsupported"
    assert by_index[2]["reads"]["remapped_rows"]["status"] == "unsupported"
    # GPU 3: lost.
    assert [(f["kind"], f["escalation"]) for f in by_index[3]["findings"]] == [("gpu_lost", "host_reboot")]
    log_scan = whole["kernel_log"]
    assert log_scan["status"] == "read" and log_scan["user_lines_ignored"] >= 3 and log_scan["xid_lines"] == 3
    assert log_scan["before_cutoff"] >= 1

    assert not one.get("failed") and one["healthy"] is True and one["escalation"] == "none", one
    assert [entry["index"] for entry in one["gpus"]] == [2]
