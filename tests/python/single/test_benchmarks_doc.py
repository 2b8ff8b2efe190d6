"""BENCHMARKS.md stays a reference: every figure of its current-figures table names a date and a
commit that exists, every plot it shows exists, and every recorded result it is drawn from names
its machine, date, commit and command."""

import glob
import json
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def text():
    with open(os.path.join(ROOT, "BENCHMARKS.md")) as f:
        return f.read()


def current_rows(doc):
    """The rows of the table under '## Current figures' (header and rule left out)."""
    section = doc.split("## Current figures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]


def problems_of_rows(rows, commit_exists):
    out = []
    for cells in rows:
        if len(cells) < 6:
            out.append("short row: %s" % cells)
            continue
        date, commit = cells[4], cells[5]
        if not re.fullmatch(r"20\d\d-\d\d-\d\d", date):
            out.append("%s: no date (%r)" % (cells[0], date))
        if not re.fullmatch(r"[0-9a-f]{7,40}", commit) or not commit_exists(commit):
            out.append("%s: no commit of this repository (%r)" % (cells[0], commit))
    return out


def commit_exists(commit):
    return subprocess.run(["git", "cat-file", "-e", commit + "^{commit}"], cwd=ROOT,
                          capture_output=True).returncode == 0


def test_every_current_figure_names_a_date_and_a_commit():
    rows = current_rows(text())
    assert len(rows) >= 20
    assert problems_of_rows(rows, commit_exists) == []


def test_a_row_without_a_commit_is_found():
    rows = [["`x`", "1.0", "what", "machine", "2026-11-28", "deadbeefcafe"],
            ["`y`", "1.0", "what", "machine", "", "19c3413"]]
    found = problems_of_rows(rows, lambda c: c != "deadbeefcafe")
    assert len(found) == 2 and "no commit" in found[0] and "no date" in found[1]


def test_plots_exist_and_results_name_their_provenance():
    for path in re.findall(r"\]\((benchmarks/plots/[^)]+\.png)\)", text()):
        assert os.path.isfile(os.path.join(ROOT, path)), path
    results = glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.json"))
    assert results
    for path in results:
        with open(path) as f:
            doc = json.load(f)
        for key in ("benchmark", "machine", "date", "commit", "command", "rows"):
            assert doc.get(key), (path, key)
        assert commit_exists(doc["commit"]), (path, doc["commit"])
