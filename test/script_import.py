"""Importing a script that is not in a package (benchmark/*.py, test/accuracy/*.py) by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def import_script(relative_path: str) -> ModuleType:
    """Execute the repository file at `relative_path` as a fresh module `_script_<stem>` and
    return it (its `if __name__ == "__main__"` block does not run). Its folder is first on the
    path while it runs, as under `python <path>` (benchmark/*.py import their folder's `common`).
    The module is registered in sys.modules, where dataclasses look up their annotations."""
    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(f"_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module
