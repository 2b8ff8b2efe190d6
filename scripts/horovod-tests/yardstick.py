"""pytest plugin for scripts/horovod-tests.sh: records each test's outcome and its subtests'
(TensorFlow's graph/eager subtests, parameterized cases) and writes them, one JSON object per
test, to FERROVOD_YARDSTICK_OUT + ".rank<N>.jsonl" (one file per rank). A test whose every subtest
was skipped passes in pytest's count although it ran nothing; the table shows those apart."""

import json
import os

_tests = {}


def _entry(nodeid):
    return _tests.setdefault(nodeid, {"outcome": None, "subtests": {}})


def _reason(report):
    """The failure's first line (the exception and its message)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash else str(report.longrepr)
    return text.strip().splitlines()[0] if text.strip() else "?"


def pytest_collectreport(report):
    if report.failed:  # the file does not import: no test of it runs
        _entry(report.nodeid).update(outcome="error", reason="collection: " + _reason(report))


def pytest_runtest_logreport(report):
    test = _entry(report.nodeid)
    if hasattr(report, "context"):  # a subtest's report (pytest >= 9)
        outcome = "failed" if report.failed else report.outcome
        test["subtests"][outcome] = test["subtests"].get(outcome, 0) + 1
        if report.failed and "reason" not in test:
            test["reason"] = "subtest %s: %s" % (report.context.msg, _reason(report))
        return
    if report.failed:
        test["outcome"] = "failed" if report.when == "call" else "error"
        test["reason"] = _reason(report)
    elif report.skipped and test["outcome"] not in ("failed", "error"):
        test["outcome"] = "skipped"
    elif report.when == "call" and test["outcome"] is None:
        test["outcome"] = "passed"


def pytest_sessionfinish(session, exitstatus):
    prefix = os.environ.get("FERROVOD_YARDSTICK_OUT")
    if not prefix:
        return
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
    with open("%s.rank%s.jsonl" % (prefix, rank), "w") as out:
        for nodeid, test in _tests.items():
            out.write(json.dumps({"test": nodeid, **test}) + "\n")
