"""Shared by the SSD engine tests: no injected fault outlives the test that armed it."""

import pytest

from jaxascend.ssd import clear_faults


@pytest.fixture(autouse=True)
def _no_faults_left():
    yield
    clear_faults()
