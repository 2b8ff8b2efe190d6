"""docs/troubleshooting.md quotes error texts as the source writes them, so that a user can find
their message there and a reworded message cannot leave a stale entry behind.

Convention: every entry of the page is a level-3 heading (`### `) naming a situation, followed
directly by one or more quote lines (`> `) that hold the error texts it covers, each in
backticks. Each quoted text must occur verbatim in ferrovod's source (src/ and bindings/,
outside Rust's `#[cfg(test)]` modules, so that a test's old copy of a message does not keep its
entry alive). Backticks elsewhere (headings, bodies: settings, commands) are not checked.
Plain pytest, no MPI."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "troubleshooting.md"
SOURCE_DIRS = ("src", "bindings")
SOURCE_SUFFIXES = {".rs", ".py", ".cc", ".c", ".h", ".cpp"}

# a Rust file's unit tests, from here to the end of the file (where this repository keeps them)
_RUST_TESTS = re.compile(r"^#\[cfg\(test\)\]\s*\n\s*mod tests\b", re.MULTILINE)


def entries(text):
    """(line number, heading, [fragments]) of every entry: each `### ` heading and the texts in
    backticks on the `> ` lines that follow it (blank lines between are skipped)."""
    found = []
    fence = False
    current = None
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
            current = None
            continue
        if fence:
            continue
        if line.startswith("### "):
            current = (number, line[4:].strip(), [])
            found.append(current)
            quoting = True
        elif current is not None and quoting:
            if line.startswith(">"):
                current[2].extend(re.findall(r"`([^`]+)`", line))
            elif line.strip() or current[2]:
                quoting = False
    return found


def source_text(root=ROOT):
    """The text of every source file under src/ and bindings/, Rust test modules left out."""
    parts = []
    for top in SOURCE_DIRS:
        for path in sorted((root / top).rglob("*")):
            if path.suffix not in SOURCE_SUFFIXES or not path.is_file():
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            if path.suffix == ".rs":
                m = _RUST_TESTS.search(text)
                if m:
                    text = text[: m.start()]
            parts.append(text)
    return "\n".join(parts)


def missing(fragments, corpus):
    """The fragments that do not occur verbatim in `corpus`."""
    return [f for f in fragments if f not in corpus]


def test_every_entry_quotes_error_text():
    listed = entries(DOC.read_text(encoding="utf-8"))
    assert len(listed) >= 30, "only %d entries" % len(listed)
    bare = ["line %d: %s" % (n, h) for n, h, frags in listed if not frags]
    assert not bare, "entries without a backticked error fragment:\n" + "\n".join(bare)


def test_every_quoted_fragment_is_in_the_source():
    corpus = source_text()
    stale = []
    for number, heading, frags in entries(DOC.read_text(encoding="utf-8")):
        stale += ["line %d: `%s`" % (number, f) for f in missing(frags, corpus)]
    assert not stale, ("docs/troubleshooting.md quotes error texts the source no longer has "
                       "(reworded or removed? update the entry):\n" + "\n".join(stale))


def test_no_entry_is_listed_twice():
    headings = [h for _, h, _ in entries(DOC.read_text(encoding="utf-8"))]
    twice = sorted({h for h in headings if headings.count(h) > 1})
    assert not twice, twice


def test_the_check_reports_a_made_up_fragment():
    corpus = source_text()
    made_up = "Ferrovod has detected a frobnicated quux in the flux capacitor"
    known = "Horovod has not been initialized; use hvd.init()."
    assert missing([made_up, known], corpus) == [made_up]
    page = ("# T\n\n### A made-up error\n\n> `%s` ·\n> `%s`\n\nText with `HOROVOD_CYCLE_TIME`.\n"
            "> `a later quote is not the entry's`\n\n```\n### `not an entry`\n```\n"
            "### No quote\n\nBody with `backticks`.\n" % (made_up, known))
    assert entries(page) == [(3, "A made-up error", [made_up, known]), (14, "No quote", [])]
    stale = [f for _, _, frags in entries(page) for f in missing(frags, corpus)]
    assert stale == [made_up]


def test_rust_unit_tests_do_not_count_as_source(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "bindings").mkdir()
    (tmp_path / "src" / "a.rs").write_text(
        'fn f() -> &str { "kept text" }\n\n#[cfg(test)]\nmod tests {\n    "old text";\n}\n')
    corpus = source_text(tmp_path)
    assert missing(["kept text", "old text"], corpus) == ["old text"]
