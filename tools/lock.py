# Copyright: gpuops.relaunch contributors
# GNU General Public License v3.0+ (see LICENSE or https://www.gnu.org/licenses/gpl-3.0.txt)
"""Regenerate the locks: every distribution each venv of `make test` installs, pinned exactly.

`make lock` runs this. Each lock is made in a fresh venv of its own interpreter and written as
`pip freeze` of that install, below the lock file's own header comment:

- requirements/constraints.txt: the tests' and the demo's venv (.venv), from requirements/test.txt
  on the interpreter that runs this script (the Makefile's python3);
- requirements/matrix-<core>.txt: each support-matrix venv (tools/matrix.py), from
  ansible-core==<core>.* on that entry's interpreter.

By default the current pins are kept (`-c` the lock itself) and only what is missing is resolved, so a
new requirement adds its own dependency tree and changes nothing else; `--upgrade` resolves everything
anew from the ranges. A lock that leaves out a transitive dependency lets a fresh clone install a newer
release than the one tested (cryptography 51 once broke a fresh `make test` that way).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from matrix import ENTRIES  # noqa: E402  pylint: disable=wrong-import-position

# The installers themselves: a venv brings them, the lock does not pin them.
NOT_LOCKED = {"pip", "setuptools", "wheel"}


def _canonical(pin: str) -> str:
    """A pin's distribution name as PEP 503 compares names (the lock is sorted by it)."""
    return re.sub(r"[-_.]+", "-", pin.split("==", 1)[0]).lower()


def header_of(lock: Path) -> str:
    """The lock file's leading comment block (it says what the lock is for), kept as written."""
    lines = []
    for line in lock.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines) + "\n" if lines else ""


def freeze(interpreter: str, requirements: list[str], lock: Path, upgrade: bool) -> str:
    """`pip freeze` of a fresh venv of `interpreter` with `requirements` installed (pip's own arguments)."""
    with tempfile.TemporaryDirectory(prefix="gpuops-lock-") as work:
        venv = Path(work) / "venv"
        subprocess.run([interpreter, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
        keep = [] if upgrade or not lock.exists() else ["-c", str(lock)]
        subprocess.run([*pip, "install", "-q", *keep, *requirements], check=True)
        frozen = subprocess.run([*pip, "freeze", "--all"], check=True, capture_output=True, text=True).stdout
    pins = [line for line in frozen.splitlines()
            if line and line.split("==", 1)[0].lower() not in NOT_LOCKED]
    return "\n".join(sorted(pins, key=_canonical)) + "\n"


def write_lock(lock: Path, pins: str) -> bool:
    """Write the lock (header kept); whether it changed."""
    text = header_of(lock) + pins
    if lock.exists() and lock.read_text(encoding="utf-8") == text:
        return False
    lock.write_text(text, encoding="utf-8")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--upgrade", action="store_true", help="resolve every pin anew from the ranges")
    parser.add_argument("--skip-matrix", action="store_true", help="lock only requirements/constraints.txt")
    args = parser.parse_args(argv)
    locks = [(REPO / "requirements" / "constraints.txt", sys.executable,
              ["-r", str(REPO / "requirements" / "test.txt")])]
    if not args.skip_matrix:
        locks += [(entry.requirements, str(entry.interpreter), [f"ansible-core=={entry.core}.*"]) for entry in ENTRIES]
    for lock, interpreter, requirements in locks:
        changed = write_lock(lock, freeze(interpreter, requirements, lock, args.upgrade))
        print(f"{lock.relative_to(REPO)}: {'updated' if changed else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
