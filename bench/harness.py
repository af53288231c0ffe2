"""What the bench scripts share, starting with the import path.

Each script, run as `python bench/<role>/<name>.py`, imports this module by its first line of its own,
`from _path import harness` (bench/<role>/_path.py puts bench/ on the import path).

    ROOT, on_path("tests")                    the repository, and its folders whose set-ups the bench shares
                                              (tests/ghost_setups.py, examples/_transformer.py, ...) importable
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository


# ---------------------------------------------------------------------------------------------- import path


def on_path(*folders: str) -> None:
    """Puts these folders of the repository (names relative to ROOT; "." is ROOT itself, its lightning_dpaudit) first
    on the import path, each before the script's own folder: tests/recipes.py is the module `recipes`, not
    bench/validity/recipes.py."""
    for folder in folders:
        path = str(ROOT / folder)
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)
