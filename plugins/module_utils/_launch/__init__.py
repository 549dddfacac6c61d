# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""train_launch's code, one job to a file. A task runs judge -> plan and decision -> executor, and
control.py builds its result from the three.

What the job is and what it says:
    spec.py        what to launch (the job spec, its hash) and the checks on the options
    records.py     the job's state directory: what was launched, what runs, how the last run ended
    jobfiles.py    those files as the module and the supervisor both read and write them
    health.py      the rule that names a run's health: running, stalled, finished, crashed, missing, stopped
    judge.py       reads the records and the process table now and applies health.py (read-only)

What to do (pure, no I/O):
    guard.py       the crash-loop guard: whether a relaunch after a failure is allowed, and its refusal
    decision.py    the policy: relaunch, leave alone or refused, and whether a start resumes
    plan.py        what a start task does: nothing, start, restart or refuse, and what it would touch

Doing it:
    executor.py    the only changes: incident record, history, stop, rotation, removal, launch, proof
    incident.py    the evidence written before anything is signalled
    tree.py        stopping a run: its whole process tree, proven member by member
    backends.py    the per-job supervisor or a systemd unit, behind one interface
    supervisor.py  the supervisor program itself, and how it is daemonized
    systemd.py     the systemd backend's unit and its exit status
    readiness.py   the proof of start (uptime, log, ready line)
    logs.py        the log's rotation and tail
    sharing.py     refuses a log another live job writes
    live.py        the live health textfile the node keeps current without Ansible

control.py         train_launch's entry point: the states, the lock, the result
"""
