"""The order of the test files for xdist's workers (tests/conftest.py): the files of
SLOW_FIRST first, in its order, then the rest by their number of tests, fewest first; each
file's tests stay together and in order."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tests.conftest import SLOW_FIRST, pytest_collection_modifyitems

REPO = Path(__file__).resolve().parents[1]


def test_every_slow_file_exists():
    assert len(set(SLOW_FIRST)) == len(SLOW_FIRST)
    assert [p for p in SLOW_FIRST if not (REPO / p).is_file()] == []


def test_the_slow_files_go_first_and_each_file_stays_together():
    first, second = SLOW_FIRST[:2]
    names = ["tests/a.py::x", "tests/b.py::x", "tests/b.py::y", f"{second}::x", f"{first}::x", f"{first}::y",
             "tests/a.py::y", "tests/a.py::z"]
    names = sorted(names, key=lambda n: n.split("::")[0])  # as collected: file by file
    items = [SimpleNamespace(nodeid=n) for n in names]
    pytest_collection_modifyitems(None, None, items)
    assert [i.nodeid for i in items] == [f"{first}::x", f"{first}::y", f"{second}::x", "tests/b.py::x",
                                         "tests/b.py::y", "tests/a.py::x", "tests/a.py::y", "tests/a.py::z"]
