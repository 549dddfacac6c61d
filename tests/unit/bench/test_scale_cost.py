"""bench/scale_cost.py: the fleet cost model's arithmetic on fixed inputs (no timing)."""

from __future__ import annotations

import pytest

from bench.scale_cost import Inputs, model

INPUTS = Inputs(
    noop_cpu_per_host=0.5,
    first_cpu_per_host=2.0,
    noop_cpu_one=4.0,
    first_cpu_one=9.0,
    noop_wall_one=1.5,
    noop_wall_per_host=0.25,
    failure_rate=0.01,
    node_core_per_job=0.00033,
)


def test_polling_cycle_is_the_fixed_run_plus_a_no_op_per_further_host():
    out = model(INPUTS, 1000)
    assert out.poll_cpu_s == pytest.approx(4.0 + 999 * 0.5)  # 503.5
    assert out.poll_wall_s == pytest.approx(1.5 + 999 * 0.25)  # 251.25
    assert out.poll_cores == pytest.approx(503.5 / 600)
    assert out.poll_forks == 3  # ceil(1000 * 1.5 / 600) = ceil(2.5)


def test_event_path_runs_one_single_host_relaunch_per_failure():
    out = model(INPUTS, 10_000)
    assert out.failures == pytest.approx(100)
    assert out.event_cpu_s == pytest.approx(900)  # 100 x the 1-host first relaunch, not the per-extra-host figure
    assert out.event_cores == pytest.approx(1.5)
    assert out.node_cores == pytest.approx(3.3)
    assert out.poll_cores == pytest.approx((4.0 + 9999 * 0.5) / 600)
    assert out.poll_forks == 25
    # the watchdog relaunches the same 100 failures inside its one run: a first relaunch per extra host each
    assert out.poll_failed_cpu_s == pytest.approx(out.poll_cpu_s + 100 * (2.0 - 0.5))


def test_a_shorter_period_needs_more_cores_and_forks():
    out = model(INPUTS, 1000, period_s=60)
    assert out.poll_cores == pytest.approx(503.5 / 60)
    assert out.poll_forks == 25
    assert model(INPUTS, 1).poll_forks == 1


@pytest.mark.parametrize("hosts, period", [(0, 600), (10, 0)])
def test_bad_size_or_period_is_refused(hosts, period):
    with pytest.raises(ValueError, match="hosts must be at least 1"):
        model(INPUTS, hosts, period)
