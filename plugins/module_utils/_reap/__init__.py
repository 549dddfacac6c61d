# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""zombie_reap's and zombie_facts' code: look, plan, act.

    assessment.py  what the last run left behind (zombies, D-state threads, GPU holders) and the
                   escalation it needs - facts, read-only
    other_jobs.py  the processes of other train_launch jobs, which a selection leaves alone
    plan.py        the reap plan: which process gets which signal, when and why - pure, signals nothing
    executor.py    carries the plan out through the signal gate and says what is left
"""
