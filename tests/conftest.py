"""Shared pytest set-up: make tests/harness importable and module_utils importable by FQCN."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COLLECTIONS = REPO / ".build" / "collections"

# `import ansible_collections.gpuops.relaunch.plugins.module_utils...` resolves through the link
# the Makefile creates; tests.harness through the repository root.
for path in (str(COLLECTIONS), str(REPO)):
    if path not in sys.path:
        sys.path.insert(0, path)
