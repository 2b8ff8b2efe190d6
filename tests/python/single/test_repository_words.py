"""The repository speaks to its readers, not about how it was developed: no tracked text file
names the project's own work sessions or issues by number or ordinal (a reader cannot look up
such a reference). Name what the reader can find instead: a section of BENCHMARKS.md by its
topic, a commit hash, or nothing.

Allowed: Horovod's own issues, written as links (`https://github.com/horovod/horovod/issues/N`,
with the same number on the line), and the word session in code (`tf.compat.v1.Session`,
`session=None`, `pytest_sessionfinish`), which the pattern does not match. Plain pytest, no MPI;
git runs from the repository root."""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[3]

_ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|previous|last|next"
# the word session or issue (singular or plural) before a number, or after an ordinal
PATTERN = re.compile(
    r"\b(?:sessions? #?(?P<session>[0-9])|issues? #?(?P<issue>[0-9]+)|(?:%s) sessions?\b)"
    % _ORDINALS,
    re.IGNORECASE,
)


def _allowed(line, match):
    """Whether `match` on `line` is one of the allowed forms."""
    if match.group("issue") is not None:
        # Horovod's issue, linked: the line holds its address with the same number
        number = match.group("issue")
        if re.search(r"github\.com/horovod/horovod/issues/%s\b" % number, line):
            return True
    # the word inside a code identifier (a.Session 1, session_3) is not prose
    start = match.start()
    return start > 0 and line[start - 1] in "._"


def findings(text):
    """(line number, line) of each line of `text` that names a session or issue."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if any(not _allowed(line, m) for m in PATTERN.finditer(line)):
            found.append((number, line.strip()))
    return found


def tracked_text_files():
    """The paths (relative to the root) of the tracked files that are text: present, not
    symbolic links, without NUL bytes, and UTF-8."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    files = []
    for raw in out.stdout.split(b"\0"):
        if not raw:
            continue
        rel = raw.decode("utf-8", "surrogateescape")
        path = ROOT / rel
        if path.is_symlink() or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        files.append((rel, text))
    return files


def test_no_tracked_file_names_the_projects_sessions_or_issues():
    bad = []
    for rel, text in tracked_text_files():
        bad += ["%s:%d: %s" % (rel, n, line[:160]) for n, line in findings(text)]
    assert not bad, ("%d line(s) name the project's own sessions or issues; name a BENCHMARKS.md "
                     "section by its topic, a commit, or nothing:\n" % len(bad)) + "\n".join(bad)


def test_the_pattern_finds_what_it_should_and_allows_the_rest():
    s, i = "sess" + "ion", "iss" + "ue"  # spelled apart so that this file passes its own test
    flagged = [
        "see BENCHMARKS.md, %s 22" % s,
        "(%s 20) measured" % i.capitalize(),
        "fixed in %s #7" % i,
        "%ss 18 and 19" % i,
        "%ss 20 and 21" % s,
        "as the previous %s found" % s,
        "The Third %s" % s.upper(),
        "Horovod %s 2496 (no link)" % i,
        "[Horovod %s 2496](https://github.com/horovod/horovod/issues/2495)" % i,
    ]
    allowed = [
        "[Horovod %s 2496](https://github.com/horovod/horovod/issues/2496)" % i,
        "https://github.com/horovod/horovod/issues/2496",
        "with tf.compat.v1.%s() as sess:" % s.capitalize(),
        "def broadcast_object(obj, root_rank=0, %s=None):" % s,
        "def pytest_%sfinish(%s, exitstatus):" % (s, s),
        "a training %s of 3 hours" % s,
        "every rank %ss the same NCCL calls" % i,
        "tissue 5",
        "%s_3 = 1" % s,
    ]
    for line in flagged:
        assert findings(line) == [(1, line)], line
    for line in allowed:
        assert findings(line) == [], line
    assert findings("ok\n%s 5 here\nok" % s) == [(2, "%s 5 here" % s)]


def test_binary_and_untracked_files_are_left_out():
    rels = {rel for rel, _ in tracked_text_files()}
    assert {"Cargo.toml", "src/error.rs", "docs/horovod-tests.md"} <= rels
    # a fuzzing seed is binary (NUL bytes); build outputs are not tracked
    assert "fuzz/seeds/wire/plan-with-joined-ranks" not in rels
    assert not any(rel.startswith(("target/", ".venv/")) for rel in rels)
