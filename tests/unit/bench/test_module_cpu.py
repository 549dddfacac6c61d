"""bench/fleet_relaunch.py: the modules' share of the CPU, as the targets' wrapper interpreter records it
(bash's `times` of a real bash that ran a real child; no timing is asserted)."""

from __future__ import annotations

import subprocess

from bench.fleet_relaunch import module_cpu_dir, take_module_cpu


def test_each_run_counts_its_waited_children_once_and_the_files_go(tmp_path):
    module_cpu_dir(tmp_path).mkdir()
    # The shell's own line first, then its children's: only the children's is the module's.
    (module_cpu_dir(tmp_path) / "a").write_text("0m9.000s 0m9.000s\n0m0.250s 0m0.050s\n", encoding="utf-8")
    (module_cpu_dir(tmp_path) / "b").write_text("0m0.001s 0m0.000s\n1m0.500s 0m0.000s\n", encoding="utf-8")
    assert abs(take_module_cpu(tmp_path) - 60.8) < 1e-9
    assert not list(module_cpu_dir(tmp_path).iterdir()) and take_module_cpu(tmp_path) == 0.0


def test_what_bash_times_writes_is_read(tmp_path):
    module_cpu_dir(tmp_path).mkdir()
    out = module_cpu_dir(tmp_path) / "run"
    subprocess.run(["bash", "-c", f"python3 -c 'sum(range(3 * 10 ** 6))'; times > {out}"], check=True)
    assert take_module_cpu(tmp_path) > 0.0
    assert take_module_cpu(tmp_path) == 0.0
