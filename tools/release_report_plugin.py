"""A pytest plugin for tools/newest_releases.py: writes the run's failures and deprecation warnings as JSON.

Loaded with ``-p release_report_plugin`` (tools/ on PYTHONPATH); the file is ``NMST_RELEASE_REPORT``. Under
pytest-xdist the controller receives every worker's reports and warnings, and writes the file alone.
"""

from __future__ import annotations

import json
import os

DEPRECATIONS = ("DeprecationWarning", "PendingDeprecationWarning", "FutureWarning")
_failures: list[dict] = []
_warnings: list[dict] = []


def pytest_runtest_logreport(report) -> None:
    if report.failed:
        lines = [line for line in report.longreprtext.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("E ")]
        _failures.append(dict(test=report.nodeid, when=report.when,
                              message=(errors or lines or [""])[-1].removeprefix("E ").strip()[:500]))


def pytest_warning_recorded(warning_message, when, nodeid, location) -> None:
    category = warning_message.category.__name__
    if category in DEPRECATIONS:
        _warnings.append(dict(category=category, message=str(warning_message.message).splitlines()[0][:300],
                              where=f"{_short(warning_message.filename)}:{warning_message.lineno}",
                              test=nodeid))


def _short(filename: str) -> str:
    """A warning's file: from the package down for an installed package, else relative to the checkout."""
    head, sep, tail = filename.rpartition("site-packages" + os.sep)
    return tail if sep else os.path.relpath(filename)


def pytest_sessionfinish(session, exitstatus) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller writes
        return
    path = os.environ.get("NMST_RELEASE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(dict(exitstatus=int(exitstatus), failures=_failures, warnings=_warnings), f)
