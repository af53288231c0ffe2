"""bench/ on the import path, for the scripts of this folder: each starts with `from _path import harness`.

(The same few lines in each of bench/'s folders: a script run as `python bench/<role>/<name>.py` finds the modules of
its own folder only.)
"""

import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[1])
if BENCH not in sys.path:
    sys.path.insert(1, BENCH)  # after the script's own folder

import harness  # noqa: E402,F401  (bench/harness.py)
