"""The rulebook's start check (extensions/eda/plugins/event_source/playbook_ready.py): the collection is looked
up as the rulebook's playbook runs will look it up, from a private directory with the rulebook's environment.
The whole rulebook refusing to start is tests/integration/test_event_chain.py's."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SOURCE = REPO / "extensions" / "eda" / "plugins" / "event_source" / "playbook_ready.py"


@pytest.fixture(name="ready")
def ready_fixture():
    spec = importlib.util.spec_from_file_location("playbook_ready", SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_found_through_ansible_config_from_any_directory(ready, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ANSIBLE_CONFIG", str(REPO / "ansible.cfg"))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    monkeypatch.chdir(tmp_path)
    assert ready.problem() is None


def test_a_checkout_without_ansible_config_is_named_with_what_to_set(ready, monkeypatch, tmp_path) -> None:
    """The checkout's ansible.cfg finds the collection from the checkout itself, not where the runs happen."""
    for name in ("ANSIBLE_CONFIG", "ANSIBLE_COLLECTIONS_PATH", "ANSIBLE_COLLECTIONS_PATHS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ansible/collections of this machine's
    monkeypatch.chdir(REPO)
    found = ready.problem()
    assert found is not None and f"the ansible.cfg of {REPO} is not read" in found and "set ANSIBLE_CONFIG" in found
    # As a source: an error, which ends ansible-rulebook (a source that returned would end it too).
    with pytest.raises(RuntimeError, match="is not found where the rulebook's playbook runs"):
        asyncio.run(ready.main(asyncio.Queue(), {}))


def test_without_ansible_galaxy_it_says_so(ready, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "ansible-galaxy is not on PATH" in ready.problem()
