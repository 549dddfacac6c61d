"""The cost of a large fleet, modelled from per-host figures that bench/fleet_relaunch.py measures.

Two ways to keep N hosts' jobs running (docs/docsite/rst/guide_performance.rst, "The cost of 1,000 and
10,000 hosts"):

* polling: the watchdog runs playbooks/relaunch.yml over every host each cycle; a healthy host costs one
  no-op. One cycle costs the fixed CPU of a run plus a no-op per further host.
* the event path: the node keeps its job's health live, Prometheus scrapes it, and Ansible runs only for
  a failed host, one run per alert (the shipped rulebook runs each on the alerted job's hosts), so each
  failure costs a whole one-host first relaunch.

The model is linear because the bench finds nothing per host that grows with the fleet (the same CPU
per extra host with 64 hosts as with 16). It assumes enough forks and cores: forks bound the wall time
by latency (a host's chain of tasks takes about a one-host run's wall time, an upper bound since it
includes ansible-playbook's start), cores by CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PERIOD_S = 600.0  # the watchdog's cycle and the event path's accounting window: 10 minutes


@dataclass(frozen=True)
class Inputs:
    """Figures measured in one bench run, and the stated assumptions."""

    noop_cpu_per_host: float  # CPU s per extra healthy host (no-op relaunch)
    first_cpu_per_host: float  # CPU s per extra relaunched host (first relaunch)
    noop_cpu_one: float  # CPU s of a 1-host no-op run (ansible-playbook's fixed cost included)
    first_cpu_one: float  # CPU s of a 1-host first relaunch: what one alert's run costs
    noop_wall_one: float  # wall s of a 1-host no-op run: one host's latency through the play
    noop_wall_per_host: float  # wall s per extra healthy host at the bench's forks, on the bench's cores
    failure_rate: float  # fraction of the hosts that fail per period (an assumption, not measured)
    node_core_per_job: float  # fraction of one core the node's live health costs per job (measured elsewhere)


@dataclass(frozen=True)
class Outputs:
    """One period's cost for `hosts` hosts."""

    hosts: int
    poll_cpu_s: float  # controller CPU of one watchdog cycle over every host, all healthy
    poll_wall_s: float  # its wall time at the bench's forks, on the bench's cores
    poll_cores: float  # cores that finish that CPU within the period
    poll_forks: int  # forks that finish every host's latency within the period
    poll_failed_cpu_s: float  # the same cycle when `failures` of the hosts need a first relaunch
    failures: float  # failed hosts per period (hosts x failure_rate)
    event_cpu_s: float  # controller CPU per period on the event path: one 1-host run per failure
    event_cores: float
    node_cores: float  # the node side's live health, summed over the fleet (one job per host)


def model(inputs: Inputs, hosts: int, period_s: float = PERIOD_S) -> Outputs:
    """The cost of `hosts` hosts per period, linear in the measured per-host figures."""
    if hosts < 1 or period_s <= 0:
        raise ValueError(f"hosts must be at least 1 and period_s positive, got {hosts} and {period_s}")
    poll_cpu = inputs.noop_cpu_one + (hosts - 1) * inputs.noop_cpu_per_host
    failures = hosts * inputs.failure_rate
    event_cpu = failures * inputs.first_cpu_one
    return Outputs(
        hosts=hosts,
        poll_cpu_s=poll_cpu,
        poll_wall_s=inputs.noop_wall_one + (hosts - 1) * inputs.noop_wall_per_host,
        poll_cores=poll_cpu / period_s,
        poll_forks=max(1, math.ceil(hosts * inputs.noop_wall_one / period_s)),
        poll_failed_cpu_s=poll_cpu + failures * (inputs.first_cpu_per_host - inputs.noop_cpu_per_host),
        failures=failures,
        event_cpu_s=event_cpu,
        event_cores=event_cpu / period_s,
        node_cores=hosts * inputs.node_core_per_job,
    )
