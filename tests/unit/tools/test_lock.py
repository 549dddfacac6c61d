"""requirements/constraints.txt is a lock: the venv the tests run in is exactly what it pins, and nothing
this venv's locked distributions depend on is left to the resolver (`make lock` regenerates it)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tools.lock import NOT_LOCKED, header_of

REQUIREMENTS = Path(__file__).resolve().parents[3] / "requirements"


def pins(lock: Path) -> dict[str, str]:
    found = {}
    for line in lock.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==", 1) if "==" in line else (line, "")
            assert version, f"{lock.name}: {line!r} is not an exact pin"
            found[canonicalize_name(name)] = version
    return found


def test_the_venv_is_what_the_lock_pins_and_the_lock_is_closed() -> None:
    locked = pins(REQUIREMENTS / "constraints.txt")
    missing: list[str] = []
    for name, version in locked.items():
        installed = metadata.distribution(name)
        assert installed.version == version, f"{name}: installed {installed.version}, locked {version}"
        for spec in installed.requires or []:
            requirement = Requirement(spec)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            dependency = canonicalize_name(requirement.name)
            if dependency not in locked and dependency not in NOT_LOCKED:
                missing.append(f"{dependency} (needed by {name})")
    assert not missing, "not in requirements/constraints.txt (run make lock): " + ", ".join(sorted(set(missing)))


def test_every_requirement_is_locked() -> None:
    locked = pins(REQUIREMENTS / "constraints.txt")
    for ranges in ("test.txt", "controller.txt"):
        for line in (REQUIREMENTS / ranges).read_text(encoding="utf-8").splitlines():
            line = line.split("#", 1)[0].strip()
            if line and not line.startswith("-"):
                assert canonicalize_name(Requirement(line).name) in locked, f"{ranges}: {line} is not locked"
    for matrix in REQUIREMENTS.glob("matrix-*.txt"):
        assert "ansible-core" in pins(matrix) and header_of(matrix).startswith("#")
