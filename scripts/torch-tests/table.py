"""Merges the ranks' results of scripts/torch-tests/runner.py into one outcome per test and prints
a Markdown summary: counts, each failure with its first rank's message, skips grouped by reason,
and the tests that passed. A test fails if it failed on any rank; a test the job ended in (no
result from any rank, but started: current.<rank>) is a failure of its own kind."""

import collections
import glob
import json
import os
import sys


def merge(folder):
    by_test = collections.OrderedDict()
    for path in sorted(glob.glob(os.path.join(folder, "results.*.jsonl"))):
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    by_test.setdefault(r["test"], []).append(r)
    outcome = {}
    for test, rs in by_test.items():
        failed = [r for r in rs if r["outcome"] == "failed"]
        if failed:
            r = min(failed, key=lambda r: r["rank"])
            outcome[test] = ("failed", "rank %d: %s" % (r["rank"], r["why"]))
        elif all(r["outcome"] == "skipped" for r in rs):
            outcome[test] = ("skipped", rs[0]["why"])
        else:
            outcome[test] = ("passed", "")
    return outcome


def main(folder):
    outcome = merge(folder)
    counts = collections.Counter(o for o, _ in outcome.values())
    print("%d tests: %d passed, %d failed, %d skipped" % (
        len(outcome), counts["passed"], counts["failed"], counts["skipped"]))
    print()
    print("| failed | why |")
    print("| --- | --- |")
    for test, (o, why) in sorted(outcome.items()):
        if o == "failed":
            print("| `%s` | %s |" % (test, why.replace("|", "\\|").replace("\n", " ")[:300]))
    print()
    reasons = collections.defaultdict(list)
    for test, (o, why) in outcome.items():
        if o == "skipped":
            reasons[why].append(test)
    print("| skipped because | tests |")
    print("| --- | --- |")
    for why, tests in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
        print("| %s | %d |" % (why.replace("|", "\\|")[:200], len(tests)))
    print()
    print("Passed: " + ", ".join("`%s`" % t for t, (o, _) in sorted(outcome.items()) if o == "passed"))


if __name__ == "__main__":
    main(sys.argv[1])
