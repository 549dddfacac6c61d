"""playbooks/relaunch.yml's GPU gate on real jobs and the simulated NVML: one playbook run, five hosts of one
machine (local connections), each a job of its own and a simulated driver of its own.

* gok: healthy GPUs -> relaunched, with no CUDA_VISIBLE_DEVICES of the gate's;
* greset: GPU 1 with a pending row remap and the recovery action "GPU reset", resets allowed -> reset by the
  stand-in nvidia-smi on PATH (which records it), looked at again, relaunched;
* gnoreset: the same GPU, resets not allowed (the default) -> refused, GPU 1 quarantined, nothing reset;
* glost: GPU 1 lost (NVML error 15) -> refused as host_reboot with the evidence, the crash-loop guard unchanged;
* gmin: GPU 1 lost, the job can run on 2 of 3 -> relaunched on GPUs 0 and 2, named by UUID in the job's
  CUDA_VISIBLE_DEVICES (read from /proc/PID/environ); a second run leaves it (and gok) running unchanged;
* gct: a "Proxmox container" whose GPUs its node gnode owns (relaunch_gpu_node; gnode is another local
  inventory host, outside the play, with the same simulated driver and the stand-in nvidia-smi on its PATH,
  which gct lacks): GPU 1 needs a reset, resets allowed -> reset on gnode by UUID, looked at again in gct,
  relaunched;
* gheld: the same on its node gnode2, where a process holds GPU 1 -> not reset (the wait is
  relaunch_gpu_reset_timeout), refused naming the holder's pid and the node, GPU 1 quarantined.

The simulated GPUs sit on buses no other test writes XID lines for, and the XID cut-off is this test's start
(relaunch_gpu_xid_since): the kernel log is the machine's, and other tests write XID lines into it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from tests.harness.gpu_holder import sim_gpu
from tests.harness.launch_targets import end_recorded_runs
from tests.harness.playbook import REPO, run_playbook

PLAYBOOK = str(REPO / "playbooks" / "relaunch.yml")
HOSTS = ("gok", "greset", "gnoreset", "glost", "gmin", "gct", "gheld")
# The Proxmox nodes of gct and gheld: inventory hosts outside the play (relaunch_hosts=jobs).
NODES = {"gct": "gnode", "gheld": "gnode2"}


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def test_the_gate_relaunches_resets_routes_around_and_refuses_with_the_evidence(tmp_path):
    started = time.time()
    script = tmp_path / "demo_train.py"
    shutil.copy(REPO / "playbooks" / "files" / "demo_train.py", script)
    hosts: dict[str, dict] = {}
    with ExitStack() as stack:
        gpus = {}
        for number, host in enumerate(HOSTS):
            gpu = gpus[host] = stack.enter_context(sim_gpu(devices=3 if host == "gmin" else 2))
            (tmp_path / host).mkdir()
            shutil.copy(script, tmp_path / host / "demo_train.py")
            for index, device in enumerate(gpu.devices):
                device["pci_bus_id"] = f"00000000:{0xE0 + number * 4 + index:02X}:00.0"
            environment = dict(gpu.env(), PATH=f"{gpu.fake_nvidia_smi_path()}:{os.environ['PATH']}")
            hosts[host] = {
                "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                "job_launch_name": f"gate-{host}-{os.getpid()}",
                "job_launch_command": [sys.executable, str(tmp_path / host / "demo_train.py"), "--workers", "1"],
                "job_launch_log_path": str(tmp_path / host / "train.log"),
                "job_launch_state_dir": str(tmp_path / host / "state"),
                "job_launch_ready_regex": "^step 1 ", "job_launch_min_uptime": 1, "job_launch_startup_timeout": 60,
                "process_cleanup_match": [f"{tmp_path / host / 'demo_train.py'}\\b".replace(".", "\\.")],
                "gpu_drain_gpus_required": True, "gpu_drain_timeout": 20, "gpu_drain_environment": environment,
                "relaunch_gpu_xid_since": started,
                # By NVML alone: other tests write XID lines into the machine's kernel log, and an XID on a bus
                # NVML does not list refuses every job of the host (a GPU that fell off the bus).
                "relaunch_gpu_kernel_log": False,
            }
        nodes = {}
        for host, node in NODES.items():
            # The node reads the container's GPUs with the same simulated driver, and resets them with the stand-in.
            nodes[node] = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                           "gpu_drain_environment": hosts[host]["gpu_drain_environment"]}
            hosts[host].update(relaunch_gpu_node=node, relaunch_gpu_reset_allowed=True, relaunch_gpu_reset_timeout=1,
                               gpu_drain_environment=dict(gpus[host].env(), PATH=os.environ["PATH"]))
        # A process on gnode2 holds gheld's GPU 1 (1 MiB: under the drain's ceiling, the container's drain passes).
        holder = subprocess.Popen(["sleep", "600"])  # pylint: disable=consider-using-with
        stack.callback(holder.wait)
        stack.callback(holder.kill)
        gpus["gheld"].register(holder.pid, 1, 1)
        for host in ("greset", "gnoreset", "gct", "gheld"):
            gpus[host].devices[1].update(remapped_rows=[0, 1, 1, 0], recovery_action=1)
        for host in ("glost", "gmin"):
            gpus[host].devices[1]["lost"] = True
        hosts["greset"]["relaunch_gpu_reset_allowed"] = True
        hosts["gmin"]["job_launch_min_gpus"] = 2
        for gpu in gpus.values():
            gpu.save()
        inventory = tmp_path / "inventory.json"
        inventory.write_text(json.dumps({"all": {"hosts": nodes, "children": {"jobs": {"hosts": hosts}}}}), encoding="utf-8")
        try:
            run = run_playbook(PLAYBOOK, inventory=str(inventory), timeout=300, extra_vars={"relaunch_hosts": "jobs"})
            found = {host: run.summary(host) for host in HOSTS}
            resets = {host: (Path(str(gpu.state_path) + ".resets").read_text(encoding="utf-8").split()
                             if Path(str(gpu.state_path) + ".resets").exists() else []) for host, gpu in gpus.items()}
            environs = {host: environ(found[host]["job"]["pid"]) for host in ("gok", "greset", "gmin", "gct")
                        if found[host]["relaunched"]}
            uuids = {host: [device["uuid"] for device in gpu.devices] for host, gpu in gpus.items()}
            # Run again on the two that run: the job on fewer GPUs is healthy with the spec it was launched with
            # (the probe reads the gate's CUDA_VISIBLE_DEVICES from the record), so nothing is restarted.
            again = run_playbook(PLAYBOOK, inventory=str(inventory), timeout=300, extra_args=["--limit", "gok,gmin"])
        finally:
            run_playbook([{"name": "stop", "hosts": "jobs", "gather_facts": False, "tasks": [
                {"name": "Stop", "gpuops.relaunch.train_launch": {
                    "name": "{{ job_launch_name }}", "state": "stopped", "state_dir": "{{ job_launch_state_dir }}"}}]}],
                inventory=str(inventory))
            for host in HOSTS:
                end_recorded_runs(hosts[host]["job_launch_state_dir"])

    # Two hosts refused: the playbook fails them after its fleet summary.
    assert run.rc != 0, run.stdout[-3000:]
    ok, reset, noreset, lost, fewer = (found[host] for host in HOSTS[:5])

    assert ok["relaunched"] is True and ok["gpu_gate"]["outcome"] == "launch" and ok["gpu_gate"]["bad"] == [], ok["failed"]
    assert "CUDA_VISIBLE_DEVICES" not in environs["gok"]

    assert resets["greset"] == ["1"], resets
    assert reset["relaunched"] is True and reset["gpu_gate"]["outcome"] == "launch", reset
    assert [(r["index"], r["done"]) for r in reset["gpu_gate"]["reset"]] == [(1, True)]
    assert reset["gpu_gate"]["quarantined"] == [] and "CUDA_VISIBLE_DEVICES" not in environs["greset"]

    assert resets["gnoreset"] == [] and noreset["relaunched"] is False and noreset["status"] == "refused", noreset
    assert noreset["action"] == "refused" and noreset["failed"] is None
    assert noreset["gpu_gate"]["escalation"] == "gpu_reset" and noreset["gpu_gate"]["quarantined"] == [uuids["gnoreset"][1]]
    [bad] = noreset["gpu_gate"]["bad"]
    assert (bad["index"], bad["recovery_action"], bad["remapped_rows"]["pending"]) == (1, "gpu_reset", True)
    record = json.loads((Path(hosts["gnoreset"]["job_launch_state_dir"]) / "gpu-quarantine.json").read_text())
    assert list(record["gpus"]) == [uuids["gnoreset"][1]]
    assert oct((Path(hosts["gnoreset"]["job_launch_state_dir"]) / "gpu-quarantine.json").stat().st_mode & 0o777) == "0o600"

    assert lost["status"] == "refused" and lost["gpu_gate"]["escalation"] == "host_reboot", lost
    [bad] = lost["gpu_gate"]["bad"]
    assert bad["index"] == 1 and bad["escalation"] == "host_reboot" and any("lost" in why for why in bad["reasons"]), bad
    assert lost["after"]["recent_relaunches"] == lost["relaunch_guard"]["recent"]
    assert not (Path(hosts["glost"]["job_launch_state_dir"]) / hosts["glost"]["job_launch_name"] / "relaunches.json").exists()
    assert "glost: not relaunching. The GPUs need host_reboot" in run.stdout + run.stderr

    assert fewer["relaunched"] is True and fewer["gpu_gate"]["visible"] == [uuids["gmin"][0], uuids["gmin"][2]], fewer["failed"]
    assert environs["gmin"]["CUDA_VISIBLE_DEVICES"] == f"{uuids['gmin'][0]},{uuids['gmin'][2]}"

    assert again.rc == 0, again.stdout[-3000:]
    for host in ("gok", "gmin"):
        assert again.summary(host)["status"] == "unchanged" and again.summary(host)["job"]["pid"] == found[host]["job"]["pid"]

    # The container's GPU was reset on its node, by UUID (the node's stand-in nvidia-smi recorded it), then launched.
    container, held = found["gct"], found["gheld"]
    assert resets["gct"] == [uuids["gct"][1]], (resets, container)
    assert container["relaunched"] is True and container["gpu_gate"]["outcome"] == "launch", (container["failed"], container["gpu_gate"])
    assert [(r["uuid"], r["done"]) for r in container["gpu_gate"]["reset"]] == [(uuids["gct"][1], True)]
    assert container["gpu_gate"]["quarantined"] == [] and "CUDA_VISIBLE_DEVICES" not in environs["gct"]
    # With a holder on the node: nothing reset, refused naming the holder and the node, the GPU quarantined.
    assert resets["gheld"] == [] and held["status"] == "refused" and held["relaunched"] is False, held
    assert f"{holder.pid} (nvml)" in held["gpu_gate"]["why"] and "gnode2" in held["gpu_gate"]["why"], held["gpu_gate"]["why"]
    assert [(r["uuid"], r["done"]) for r in held["gpu_gate"]["reset"]] == [(uuids["gheld"][1], False)]
    assert held["gpu_gate"]["quarantined"] == [uuids["gheld"][1]]
