"""pytest setup: import the package from this tree (python/), and shared helpers."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PYDIR = os.path.dirname(HERE)
REPO = os.path.dirname(PYDIR)
if PYDIR not in sys.path:
    sys.path.insert(0, PYDIR)


def build_tool(name: str) -> str:
    """Path of a helper built by `make pylib` (build/NAME)."""
    return os.path.join(REPO, "build", name)
