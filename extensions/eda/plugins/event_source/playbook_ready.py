# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""An ansible-rulebook event source that sends nothing: it stops the rulebook at its start, saying what
is missing, where the rulebook's playbook runs would not find the collection.

ansible-rulebook's run_playbook copies the playbook into a private directory of its own and has
ansible-runner run ansible-playbook there: an ansible.cfg in the directory the rulebook was started
from (a checkout's, whose collections_path finds the rulebook itself) is not read there, and every run
then fails ("couldn't resolve module/action 'gpuops.relaunch.relaunch_fleet'") while Alertmanager gets
its 200. This source asks ``ansible-galaxy collection list`` from such a directory, with the rulebook's
environment (which ansible-runner passes on), before any alert can arrive.

    sources:
      - gpuops.relaunch.playbook_ready:
          collection: gpuops.relaunch    # the default
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
from typing import Any

DEFAULT_COLLECTION = "gpuops.relaunch"
LIST_TIMEOUT_S = 120


def problem(collection: str = DEFAULT_COLLECTION) -> str | None:
    """Why a playbook run in a private directory would not find `collection`, or None where it would."""
    galaxy = shutil.which("ansible-galaxy")
    if galaxy is None:
        return "ansible-galaxy is not on PATH: the rulebook's playbook runs need ansible-core in the rulebook's environment"
    with tempfile.TemporaryDirectory(prefix="gpuops-rulebook-check-") as elsewhere:
        try:
            listed = subprocess.run([galaxy, "collection", "list", collection, "--format", "json"], cwd=elsewhere,
                                    capture_output=True, text=True, timeout=LIST_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"cannot ask ansible-galaxy where {collection} is: {exc}"
    try:
        found = any(collection in (names or {}) for names in json.loads(listed.stdout or "{}").values())
    except (ValueError, AttributeError, TypeError):
        found = False
    if found:
        return None
    return (f"the collection {collection} is not found where the rulebook's playbook runs (ansible-runner runs "
            f"ansible-playbook in a private directory, where the ansible.cfg of {os.getcwd()} is not read), so every "
            "relaunch would fail: from a checkout set ANSIBLE_CONFIG to its ansible.cfg (or ANSIBLE_COLLECTIONS_PATH to "
            "the directory that holds ansible_collections), or install the collection (ansible-galaxy collection install)")


async def main(queue: asyncio.Queue, args: dict[str, Any]) -> None:  # pylint: disable=unused-argument
    """Stop the rulebook (an error ends every source) where the collection is not found; else wait for ever:
    a source that returns ends the rulebook too."""
    collection = str(args.get("collection") or DEFAULT_COLLECTION)
    found = await asyncio.get_running_loop().run_in_executor(None, problem, collection)
    if found is not None:
        raise RuntimeError(found)
    await asyncio.Event().wait()
