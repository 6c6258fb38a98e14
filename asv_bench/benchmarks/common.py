"""The asv suite's fixtures: this checkout's kvbench/bench/fixtures.py (the gates' fixtures too).

Loaded by path, not imported: asv imports the suite against the kvbench of every commit it builds,
and commits from before the fixtures moved into kvbench have no such module (nor the newest
fixtures); by path, every commit runs the same ones. APPEND ONLY, NEVER CHANGE: see that file.
"""
import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "kvbench" / "bench" / "fixtures.py"
_spec = importlib.util.spec_from_file_location("kvbench_asv_fixtures", _PATH)
_fixtures = sys.modules.get(_spec.name)
if _fixtures is None:
    _fixtures = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _fixtures
    try:
        _spec.loader.exec_module(_fixtures)
    except BaseException:
        del sys.modules[_spec.name]
        raise
# `from . import common` and `from .common import X` get the fixtures module itself (its state,
# such as the loaded traces, is shared by every benchmark file).
sys.modules[__name__] = _fixtures
