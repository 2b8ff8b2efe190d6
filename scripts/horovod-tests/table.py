"""Prints scripts/horovod-tests.sh's table (Markdown) from the per-rank results that its pytest
plugin wrote, then the tests that failed. Exits 1 if a run left no result on some rank."""

import json
import pathlib
import sys

COLUMNS = ["tests", "passed", "of which ran nothing", "skipped", "failed",
           "subtests passed", "subtests skipped", "subtests failed"]


def counts(tests):
    c = dict.fromkeys(COLUMNS, 0)
    c["tests"] = len(tests)
    for t in tests:
        outcome, sub = t["outcome"], t["subtests"]
        if outcome == "passed":
            c["passed"] += 1
            if sub and set(sub) == {"skipped"}:
                c["of which ran nothing"] += 1
        elif outcome == "skipped":
            c["skipped"] += 1
        else:
            c["failed"] += 1
        for kind in ("passed", "skipped", "failed"):
            c["subtests " + kind] += sub.get(kind, 0)
    return c


def main():
    work = pathlib.Path(sys.argv[1])
    modes = [a.split("=", 1)[1] for a in sys.argv[2:] if a.startswith("--keras=")]
    files = [a for a in sys.argv[2:] if not a.startswith("--")]
    print("| file | Keras | " + " | ".join(COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    failures, missing = [], []
    for f in files:
        for mode in modes:
            run = "%s.keras%s" % (f[:-3], mode)
            ranks = []
            for rank in (0, 1):
                path = work / "results" / ("%s.rank%d.jsonl" % (run, rank))
                if path.exists():
                    ranks.append([json.loads(line) for line in path.read_text().splitlines()])
                else:
                    ranks.append(None)
                    missing.append("%s (Keras %s) left no result on rank %d: see %s" % (
                        f, mode, rank, work / "logs" / run / "1" / ("rank.%d" % rank)))
            per_rank = [counts(t) if t is not None else None for t in ranks]
            cells = []
            for col in COLUMNS:
                values = [c[col] if c else "-" for c in per_rank]
                cells.append(str(values[0]) if values[0] == values[1] else "%s / %s" % tuple(values))
            print("| `%s` | %s | %s |" % (f, mode, " | ".join(cells)))
            failed = {}
            for rank, tests in enumerate(ranks):
                for t in tests or []:
                    if t["outcome"] in ("failed", "error") or t["subtests"].get("failed"):
                        entry = failed.setdefault(t["test"], [[], t.get("reason", "a subtest failed")])
                        entry[0].append(str(rank))
            for name, (on, reason) in failed.items():
                failures.append("%s (Keras %s, rank %s) — %s" % (name, mode, ", ".join(on), reason))
    print("\nA test that passed with every subtest skipped ran nothing (\"of which ran nothing\").")
    print("Where the ranks differ a cell shows rank 0 / rank 1.")
    for line in failures:
        print("failed: " + line)
    for line in missing:
        print(line)
    sys.exit(1 if missing else 0)


if __name__ == "__main__":
    main()
