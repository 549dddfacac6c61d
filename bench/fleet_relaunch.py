"""Benchmark: `playbooks/relaunch.yml` on a fleet of 16 containers against 1 container, same run.

Issue 12 item 5: a relaunch of 16 containers should take at most 3x the wall time of a relaunch of
one. Each "container" is a PID namespace whose init never reaps (``unshare --pid --fork
--mount-proc sleep infinity``, as the Molecule scenarios' shared create makes it), reached with the
``community.docker.nsenter`` connection through its init's host pid. Every container is a host of
its own with its own demo job: a copy of ``playbooks/files/demo_train.py`` in a per-host directory
(so process_cleanup's selector matches that host's job only), its own log and state directory,
``gpu_drain_gpus_required: false`` and ``container_reset_allowed: false``.

Each round, alternating the sizes so both see the same machine state, times the real
``ansible-playbook playbooks/relaunch.yml`` (forks = 16 through ANSIBLE_FORKS) for

* first   the jobs do not run (stopped beforehand with train_launch state=stopped, not timed):
          the probe, stop, clean-up, drain and a launch with its proof of start on every host
* no-op   right after: every job runs with its spec, so nothing changes

once on the first container alone and once on all of them (the floor and the no-op, a few seconds each,
three times a round: a sample's noise divided by the extra hosts is a large part of a floor of a few
hundredths of a CPU second), and prints medians, the ratios
(N containers against 1; goals: at most 3x for a first relaunch, 2x for a no-op), the CPU time the
runs used (controller and the module processes it waited for; with few cores that CPU, not the
forks, bounds the ratio), the CPU seconds each extra host costs ((CPU of N - CPU of 1) / (N - 1);
goals: at most 1.5 for a relaunched host, 0.3 for a healthy one), the tasks each host ran (the play
recap's ok + skipped) and the first relaunch's phases from the hosts' summaries. It asserts no times. It checks that every first
run relaunched every host and every no-op run relaunched none. Needs root (unshare, nsenter), as
the Molecule scenarios do.

Against the floor of the same run, one ``ansible.builtin.ping`` per host, it splits the CPU per extra
host into the controller's (ansible-playbook, its workers, the connection's processes) and the
modules' (the targets' interpreter is a wrapper that records the CPU of each module process and what
it waited for, bash's ``times``): on a fleet the modules run on the nodes, so the goals against the
floor (a no-op at most 1.5x, a first relaunch at most 4x) are the controller's; both parts and their
sum are printed.

Last, the cost of 1,000 and 10,000 hosts, modelled (bench/scale_cost.py) from this run's medians: one
watchdog cycle's CPU and wall, the cores and forks it needs within 10 minutes, and the event path's
(one 1-host run per failed host, at an assumed --failure-rate; the node's live health at
--node-core-per-job, measured by bench/live_health_cpu.py). It prints the inputs with the outputs.

Clean-up, also after a failure or Ctrl-C: the jobs are stopped through the train_launch module
(state=stopped), then each namespace is ended by SIGKILL to its recorded init pid, only while that
pid still has the recorded start time (the kernel ends everything inside); nothing else is
signalled.

    .venv/bin/python bench/fleet_relaunch.py [--containers 16] [--repeat 3] [--quick] [--failure-rate 0.01]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / ".build" / "collections"))
sys.path.insert(0, str(REPO))

# pylint: disable=wrong-import-position
from bench.scale_cost import PERIOD_S, Inputs, model  # noqa: E402
from tests.harness.pidns import PidNamespace, nsenter_vars, start_pid_namespace  # noqa: E402
from tests.harness.playbook import SUMMARY_TASKS  # noqa: E402  (the tasks that summarize a host)

PLAYBOOK = REPO / "playbooks" / "relaunch.yml"
BIN = Path(sys.executable).parent
PYTHON = "/usr/bin/python3"  # the targets' interpreter, inside the namespaces
FORKS = 16
# Runs per round of the floor and of the no-op relaunch (a first relaunch: one; it needs the jobs stopped first).
SHORT_SAMPLES = 3
PHASES = ("stop", "cleanup", "drain", "container_reset", "launch")


class Fleet:
    """N PID namespaces, one host and one demo job each, and the inventories that name them."""

    def __init__(self, work: Path, count: int) -> None:
        self.work = work
        self.count = count
        self.namespaces: list[PidNamespace] = []
        self.hosts: dict[str, dict[str, Any]] = {}
        self.interpreter = PYTHON

    def start(self) -> None:
        module_cpu_dir(self.work).mkdir()
        # The targets' interpreter: /usr/bin/python3, and then the CPU that process and the children it
        # waited for used (bash's `times`, second line), in a file of its own, so that the controller's
        # share can be told from the modules' (which a fleet's nodes pay). A job the module starts is
        # not its waited child (the supervisor detaches), so the jobs are not counted here either.
        wrapper = self.work / "python3-cpu"
        # (mktemp names the file: $$ is a pid of the host's own PID namespace, the same in several.)
        wrapper.write_text(f'#!/bin/bash\n{PYTHON} "$@"\nrc=$?\ntimes > "$(mktemp -p {module_cpu_dir(self.work)})"\n'
                           'exit $rc\n', encoding="utf-8")
        wrapper.chmod(0o755)
        self.interpreter = str(wrapper)
        for index in range(self.count):
            namespace = start_pid_namespace()
            self.namespaces.append(namespace)  # recorded before anything else, so clean-up finds it
            host = f"ct{index:02d}"
            self.hosts[host] = self.host_vars(host, namespace)

    def host_vars(self, host: str, namespace: PidNamespace) -> dict[str, Any]:
        home = self.work / host
        (home / "files").mkdir(parents=True)
        (home / "logs").mkdir()
        script = home / "files" / "demo_train.py"
        shutil.copy(REPO / "playbooks" / "files" / "demo_train.py", script)
        return dict(
            nsenter_vars(namespace.init_pid),
            ansible_python_interpreter=self.interpreter,
            job_launch_name=f"fleet-bench-{host}",
            job_launch_command=[PYTHON, str(script)],
            job_launch_log_path=str(home / "logs" / "train.log"),
            job_launch_state_dir=str(home / "state"),
            job_launch_ready_regex="^step 1 ",
            job_launch_min_uptime=1,
            job_launch_startup_timeout=180,
            job_launch_term_timeout=30,
            process_cleanup_match=[f"{script}\\b".replace(".", "\\.")],
            process_cleanup_term_timeout=5,
            gpu_drain_gpus_required=False,
            gpu_drain_timeout=20,
            container_reset_allowed=False,
        )

    def inventory(self, size: int) -> str:
        """An inventory of the first `size` hosts (written once per size)."""
        path = self.work / f"inventory-{size}.json"
        if not path.exists():
            hosts = dict(list(self.hosts.items())[:size])
            path.write_text(json.dumps({"all": {"hosts": hosts}}, indent=1), encoding="utf-8")
        return str(path)

    def end(self) -> list[str]:
        """SIGKILL each recorded init (only while its start time still matches) and wait for it."""
        problems = []
        for namespace in self.namespaces:
            namespace.kill()
            if namespace.alive():
                problems.append(f"namespace init {namespace.init_pid} is still there")
        return problems


def module_cpu_dir(work: Path) -> Path:
    """Where the targets' interpreter leaves the CPU of each module run (see Fleet.start)."""
    return work / "module-cpu"


def take_module_cpu(work: Path) -> float:
    """The CPU seconds of the module runs since the last call (their files are removed)."""
    total = 0.0
    directory = module_cpu_dir(work)
    if not directory.is_dir():
        return total
    for path in directory.iterdir():
        lines = path.read_text(encoding="utf-8").split("\n")
        path.unlink()
        # bash's `times`: the shell's own "0m0.002s 0m0.001s", then its waited children's.
        for field in lines[1].split() if len(lines) > 1 else ():
            minutes, seconds = field.rstrip("s").split("m")
            total += int(minutes) * 60 + float(seconds)
    return total


def playbook(args: list[str], work: Path, name: str) -> tuple[float, float, float, subprocess.CompletedProcess]:
    """Run ansible-playbook ARGS; return its wall seconds, the CPU seconds of it and the processes
    it waited for (controller, workers, nsenter and the modules), the modules' share of that CPU, and
    the finished process."""
    env = dict(
        os.environ,
        ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
        ANSIBLE_FORKS=str(FORKS),
        ANSIBLE_STDOUT_CALLBACK="ansible.posix.json",
        ANSIBLE_LOCAL_TEMP=str(work / "local-tmp" / name),
        ANSIBLE_NOCOLOR="1",
        PATH=f"{BIN}:{os.environ.get('PATH', '')}",
    )
    take_module_cpu(work)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([str(BIN / "ansible-playbook"), *args], cwd=str(REPO), env=env,
                          capture_output=True, text=True, check=False, timeout=1800)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    modules = take_module_cpu(work)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: ansible-playbook exited with {done.returncode}\n"
                           f"{done.stdout[-6000:]}\n{done.stderr[-3000:]}")
    return wall, cpu, modules, done


def summaries(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each host's relaunch summary, from the json callback's output."""
    found: dict[str, dict[str, Any]] = {}
    for play in report["plays"]:
        for task in play["tasks"]:
            if task["task"]["name"].split(" : ")[-1] in SUMMARY_TASKS:
                for host, result in task["hosts"].items():
                    summary = (result.get("ansible_facts") or {}).get("relaunch_summary")
                    if summary is not None:
                        found[host] = summary
    return found


def tasks_per_host(report: dict[str, Any]) -> int:
    """The most tasks any host ran (the recap's ok, which counts changed, plus skipped)."""
    return max(counts["ok"] + counts["skipped"] for counts in report["stats"].values())


def relaunch(fleet: Fleet, size: int, kind: str) -> tuple[float, float, float, list[dict[str, float]], int]:
    """Time one relaunch of the first `size` hosts and check that it did what `kind` says; also
    return each host's phase seconds from its summary and the most tasks a host ran."""
    wall, cpu, modules, done = playbook(["-i", fleet.inventory(size), str(PLAYBOOK)], fleet.work, f"{kind}-{size}")
    report = json.loads(done.stdout)
    found = summaries(report)
    if sorted(found) != sorted(list(fleet.hosts)[:size]):
        raise RuntimeError(f"{kind} relaunch of {size}: summaries for {sorted(found)}")
    want = kind == "first"
    wrong = {host: (s["relaunched"], s["why"]) for host, s in found.items() if bool(s["relaunched"]) != want}
    if wrong:
        raise RuntimeError(f"{kind} relaunch of {size}: expected relaunched={want}, got {wrong}")
    return (wall, cpu, modules, [{phase: float(seconds) for phase, seconds in s["seconds"].items()} for s in found.values()],
            tasks_per_host(report))


def reach(fleet: Fleet, size: int) -> tuple[float, float, float]:
    """The floor: one play of one ``ansible.builtin.ping`` on the first `size` hosts (a worker, the
    connection, one small module run per host). A relaunch costs at least one module run per host."""
    play = fleet.work / "ping.json"
    if not play.exists():
        play.write_text(json.dumps([{"name": "Reach every host once", "hosts": "all", "gather_facts": False,
                                     "tasks": [{"name": "Ping", "ansible.builtin.ping": {}}]}]), encoding="utf-8")
    wall, cpu, modules, _done = playbook(["-i", fleet.inventory(size), str(play)], fleet.work, f"ping-{size}")
    return wall, cpu, modules


def stop_jobs(fleet: Fleet, name: str) -> None:
    """Stop every host's job with train_launch state=stopped (not timed)."""
    play = fleet.work / "stop.json"
    if not play.exists():
        play.write_text(json.dumps([{
            "name": "Stop the benchmark's jobs", "hosts": "all", "gather_facts": False,
            "tasks": [{"name": "Stop", "gpuops.relaunch.train_launch": {
                "name": "{{ job_launch_name }}", "state": "stopped", "state_dir": "{{ job_launch_state_dir }}",
                "term_timeout": 10}}],
        }]), encoding="utf-8")
    playbook(["-i", fleet.inventory(fleet.count), str(play)], fleet.work, name)


def median(values: list[float]) -> float:
    return statistics.median(values)


def report_phases(sizes: tuple[int, int], phases: dict) -> None:
    """Per phase of the first relaunches: the median over hosts and rounds, and the slowest host."""
    print("\nfirst relaunch by phase (the summary's seconds: each module's own elapsed time on the target), "
          "median over hosts and rounds / slowest host:")
    for size in sizes:
        seen = {name for entry in phases.get(size, []) for name in entry}
        names = [name for name in PHASES if name in seen] + sorted(seen - set(PHASES))
        parts = [f"{name} {median([e[name] for e in phases[size] if name in e]):.2f}/"
                 f"{max(e[name] for e in phases[size] if name in e):.2f}" for name in names]
        print(f"  {size:2d} container(s): {', '.join(parts)} s")


# Goals per kind: the wall ratio of N containers against 1, and CPU seconds per extra host.
GOALS = {"first": (3.0, 1.5), "no-op": (2.0, 0.3)}
# Goals against the floor measured in the same run (one ansible.builtin.ping per host): CPU per extra host
# at most this many times the floor's, and the N-vs-1 wall ratio at most this many times the floor's own.
FLOOR_GOALS = {"no-op": (1.5, 1.3), "first": (4.0, 1.3)}


def report(sizes: tuple[int, int], walls: dict, cpus: dict, module_cpus: dict, tasks: dict, repeat: int) -> None:
    one, many = sizes
    cpus_online = os.cpu_count() or 1
    print(f"\nrelaunch.yml wall time, medians of {repeat} rounds (the floor and the no-op: {SHORT_SAMPLES} runs a round; "
          f"forks={FORKS}, community.docker.nsenter):")
    print(f"  {'':<8} {'1 container':>13} {f'{many} containers':>15} {'ratio':>7}   CPU s (1 / {many})"
          f"   CPU s per extra host   tasks per host")
    for kind in ("first", "no-op"):
        w1, wn = median(walls[kind, one]), median(walls[kind, many])
        c1, cn = median(cpus[kind, one]), median(cpus[kind, many])
        per_host = (cn - c1) / (many - 1)
        ratio_goal, cpu_goal = GOALS[kind]
        print(f"  {kind:<8} {w1:12.2f}s {wn:14.2f}s {wn / w1:6.2f}x   {c1:6.1f} / {cn:6.1f}   {per_host:20.2f}"
              f"   {max(tasks[kind]):14d}   (ratio {'meets' if wn / w1 <= ratio_goal else 'MISSES'} the goal of at most "
              f"{ratio_goal:g}x; CPU per extra host {'meets' if per_host <= cpu_goal else 'MISSES'} the goal of at most "
              f"{cpu_goal:g} s)")
        print(f"  {'':<8} every run: 1: {', '.join(f'{x:.2f}' for x in walls[kind, one])} s; "
              f"{many}: {', '.join(f'{x:.2f}' for x in walls[kind, many])} s")
    print(f"\nCPUs: {cpus_online} ({len(os.sched_getaffinity(0))} usable by this process); load average now "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}.")
    for kind in ("first", "no-op"):
        cn, wn = median(cpus[kind, many]), median(walls[kind, many])
        print(f"  {kind}: the {many}-container run used {cn:.1f} CPU s in {wn:.1f} s of wall time "
              f"({cn / wn:.2f} CPUs busy on average of {cpus_online}); its CPU alone needs at least "
              f"{cn / cpus_online:.1f} s here, {cn / cpus_online / median(walls[kind, one]):.2f}x the 1-container wall time.")

    def per_host(kind: str, figures: dict) -> float:
        return (median(figures[kind, many]) - median(figures[kind, one])) / (many - 1)
    controller = {key: [total - modules for total, modules in zip(cpus[key], module_cpus[key])] for key in cpus}
    floor = {part: per_host("ping", figures) for part, figures in
             (("all", cpus), ("controller", controller), ("modules", module_cpus))}
    ping_ratio = median(walls["ping", many]) / median(walls["ping", one])
    print(f"\nthe floor, one ansible.builtin.ping per host: {floor['all']:.2f} CPU s per extra host: the controller "
          f"{floor['controller']:.2f} (ansible-playbook, its workers, the connection's processes), the module on the "
          f"target {floor['modules']:.2f} ({many} vs 1: {ping_ratio:.2f}x wall).")
    for kind in ("no-op", "first"):
        parts = {part: per_host(kind, figures) for part, figures in
                 (("all", cpus), ("controller", controller), ("modules", module_cpus))}
        ratio = median(walls[kind, many]) / median(walls[kind, one])
        cost_goal, ratio_goal = FLOOR_GOALS[kind]
        judged = parts["controller"] / floor["controller"]
        print(f"  {kind}: the controller {parts['controller']:.2f} CPU s per extra host, {judged:.2f}x the floor's "
              f"({'meets' if judged <= cost_goal else 'MISSES'} the goal of at most {cost_goal:g}x); the modules on the "
              f"target {parts['modules']:.2f}, {parts['modules'] / floor['modules']:.2f}x ping's; both together "
              f"{parts['all']:.2f}, {parts['all'] / floor['all']:.2f}x; its {many}-vs-1 wall ratio is "
              f"{ratio / ping_ratio:.2f}x the floor's ({'meets' if ratio / ping_ratio <= ratio_goal else 'MISSES'} "
              f"the goal of at most {ratio_goal:g}x).")
    print("  The goals are the controller's: on a fleet each module runs on its own node, here on the same 2 cores.")
    print("  The ratio is bound by CPU on a machine with few cores: forks run in parallel only as far as"
          " there are cores for the controller's workers and the modules (CPU s above counts both;"
          " the jobs themselves are not counted).")


def report_scale(sizes: tuple[int, int], walls: dict, cpus: dict, module_cpus: dict, failure_rate: float,
                 node_core_per_job: float) -> None:
    """The cost of 1,000 and 10,000 hosts, modelled (bench/scale_cost.py) from this run's medians: the
    controller's share of the CPU (`cpus` less `module_cpus`); the modules run on the nodes."""
    one, many = sizes
    cpus = {key: [total - modules for total, modules in zip(cpus[key], module_cpus[key])] for key in cpus}
    inputs = Inputs(
        noop_cpu_per_host=(median(cpus["no-op", many]) - median(cpus["no-op", one])) / (many - 1),
        first_cpu_per_host=(median(cpus["first", many]) - median(cpus["first", one])) / (many - 1),
        noop_cpu_one=median(cpus["no-op", one]),
        first_cpu_one=median(cpus["first", one]),
        noop_wall_one=median(walls["no-op", one]),
        noop_wall_per_host=(median(walls["no-op", many]) - median(walls["no-op", one])) / (many - 1),
        failure_rate=failure_rate,
        node_core_per_job=node_core_per_job,
    )
    print(f"\nthe cost of 1,000 and 10,000 hosts (modelled from this run's figures, a period of {PERIOD_S / 60:g} minutes):")
    print(f"  measured here ({many} vs 1, medians; the controller's CPU): CPU s per extra healthy host (no-op) {inputs.noop_cpu_per_host:.2f}, "
          f"per extra relaunched host (first) {inputs.first_cpu_per_host:.2f}; a 1-host run {inputs.noop_cpu_one:.2f} "
          f"CPU s (no-op) and {inputs.first_cpu_one:.2f} (first: one alert's run); wall {inputs.noop_wall_one:.2f} s "
          f"for 1 host, {inputs.noop_wall_per_host:.3f} s per extra host at forks={FORKS} on {os.cpu_count()} CPUs.")
    print(f"  assumed: {failure_rate:.1%} of the hosts fail per period (pessimistic); the node's live health "
          f"{node_core_per_job:.3%} of a core per job (measured by bench/live_health_cpu.py, not in this run); "
          "Prometheus' own cost, the scrape of every node's exporter, is not measured here.")
    node_noop = (median(module_cpus["no-op", many]) - median(module_cpus["no-op", one])) / (many - 1)
    node_first = (median(module_cpus["first", many]) - median(module_cpus["first", one])) / (many - 1)
    print(f"  The CPU below is the controller's (ansible-playbook, its workers, the connection's processes); the modules "
          f"run on the nodes, {node_noop:.2f} CPU s on a healthy host's node per cycle and {node_first:.2f} on a "
          "relaunched one's. Cores across execution nodes help only with the inventory split between them (AWX job "
          "slicing): one ansible-playbook's main process is one process.")
    for hosts in (1_000, 10_000):
        out = model(inputs, hosts)
        print(f"  {hosts:6,d} hosts, polling: one watchdog cycle (all healthy) {out.poll_cpu_s:,.0f} CPU s, "
              f"{out.poll_wall_s:,.0f} s wall here; within {PERIOD_S:.0f} s it needs {out.poll_cores:.1f} cores "
              f"and at least {out.poll_forks} forks; with {out.failures:,.0f} failed hosts {out.poll_failed_cpu_s:,.0f} CPU s.")
        print(f"  {hosts:6,d} hosts, event path: {out.failures:,.0f} one-host runs per period, {out.event_cpu_s:,.0f} "
              f"CPU s, {out.event_cores:.2f} cores; the nodes' live health {out.node_cores:.2f} cores over the "
              "fleet (one job per host); plus Prometheus' scrape (not measured).")


def interrupted(_signum, _frame) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--containers", type=int, default=16, help="the fleet's size (default 16)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds; medians are reported (default 3)")
    parser.add_argument("--quick", action="store_true", help="one round (same as --repeat 1)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, inventories)")
    parser.add_argument("--failure-rate", type=float, default=0.01,
                        help="the model's assumption: the fraction of hosts that fail per 10 minutes (default 0.01)")
    parser.add_argument("--node-core-per-job", type=float, default=0.00033,
                        help="the model's input: the node's live health as a fraction of one core per job "
                             "(default 0.00033, measured by bench/live_health_cpu.py, docs guide_performance)")
    args = parser.parse_args()
    repeat = 1 if args.quick else args.repeat
    if args.containers < 2 or repeat < 1:
        parser.error("--containers must be at least 2 and --repeat at least 1")
    if not 0 <= args.failure_rate <= 1 or not 0 <= args.node_core_per_job <= 1:
        parser.error("--failure-rate and --node-core-per-job must be fractions between 0 and 1")
    sizes = (1, args.containers)

    # A SIGTERM ends the benchmark like Ctrl-C: through the clean-up below.
    signal.signal(signal.SIGTERM, interrupted)
    work = Path(tempfile.mkdtemp(prefix="gpuops-fleet-bench-"))
    fleet = Fleet(work, args.containers)
    walls: dict[tuple[str, int], list[float]] = {}
    cpus: dict[tuple[str, int], list[float]] = {}
    module_cpus: dict[tuple[str, int], list[float]] = {}  # the modules' share of cpus
    phases: dict[int, list[dict[str, float]]] = {}
    tasks: dict[str, list[int]] = {}
    began = time.monotonic()
    print(f"{args.containers} PID namespaces (init never reaps), work directory {work}; CPUs: {os.cpu_count()}; "
          f"load average at the start {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    try:
        fleet.start()
        for round_no in range(repeat):
            for size in sizes:
                # The short runs (the floor, the no-op: seconds each) are sampled SHORT_SAMPLES times a round: one
                # sample's noise, divided by the extra hosts, is a large part of a floor of a few hundredths.
                for _sample in range(SHORT_SAMPLES):
                    wall, cpu, modules = reach(fleet, size)
                    walls.setdefault(("ping", size), []).append(wall)
                    cpus.setdefault(("ping", size), []).append(cpu)
                    module_cpus.setdefault(("ping", size), []).append(modules)
                stop_jobs(fleet, f"stop-{round_no}-{size}")
                for kind in ["first"] + ["no-op"] * SHORT_SAMPLES:
                    wall, cpu, modules, seconds, ran = relaunch(fleet, size, kind)
                    tasks.setdefault(kind, []).append(ran)
                    if kind == "first":
                        phases.setdefault(size, []).extend(seconds)
                    walls.setdefault((kind, size), []).append(wall)
                    cpus.setdefault((kind, size), []).append(cpu)
                    module_cpus.setdefault((kind, size), []).append(modules)
                    print(f"  round {round_no + 1}/{repeat}: {kind:<5} relaunch of {size:2d} container(s): "
                          f"{wall:6.2f} s wall, {cpu:6.1f} CPU s (modules {modules:.1f})", flush=True)
    finally:
        problems = []
        if fleet.namespaces:
            try:
                stop_jobs(fleet, "stop-final")
            except (RuntimeError, subprocess.TimeoutExpired, OSError) as error:
                problems.append(f"stopping the jobs failed (the namespaces' end ends them): {error}")
        problems += fleet.end()
        if args.keep or problems:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
        for problem in problems:
            print(f"clean-up: {problem}", file=sys.stderr)
    report(sizes, walls, cpus, module_cpus, tasks, repeat)
    report_phases(sizes, phases)
    report_scale(sizes, walls, cpus, module_cpus, args.failure_rate, args.node_core_per_job)
    print(f"\nbenchmark took {time.monotonic() - began:.0f} s in all; everything it started has been ended.")


if __name__ == "__main__":
    main()
