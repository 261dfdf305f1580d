"""A pytest plugin: with ``DYNVOCAB_REQUIRE_DEMO=1`` (as ``.ci/run`` sets it) a skipped ``demo`` test fails.

CI installs the demo packages; a demo test that skips there means the end-to-end check silently did not run.
``conftest.py`` imports the hook; ``test_require_demo.py`` loads this module alone with ``-p require_demo``.
"""

from __future__ import annotations

import os

import pytest

REQUIRE_DEMO = "DYNVOCAB_REQUIRE_DEMO"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Turn the skip of a ``demo``-marked test into a failure when ``DYNVOCAB_REQUIRE_DEMO=1``."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get(REQUIRE_DEMO) == "1" and item.get_closest_marker("demo"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = f"demo test skipped, but {REQUIRE_DEMO}=1 requires it to run: {reason}"
