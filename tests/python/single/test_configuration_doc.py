"""docs/configuration.md is the one list of ferrovod's environment variables; these checks keep
it true to the code. Plain pytest, no MPI.

Conventions of the page that the checks rely on:
- every variable has a row in a Markdown table, its name in backticks in the first column;
- the tables of settings have the columns variable, default, values, scope, effect;
- a numeric default is the first number of its cell, a range is written "LOW to HIGH" (numbers
  may be written 2^N); a flag's default is 0 or 1; a choice's values are in backticks;
- the launcher's table has the column "read by ferrovod" (yes or no);
- the variables for tests and benchmarks are in the section "Tests and benchmarks".

Each check is a function of the page's text (and of facts parsed from the source) that returns
a list of problems, so the self-tests at the end can feed it a broken page and expect a
complaint."""

import ast
import functools
import math
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "configuration.md"
THIS = pathlib.Path(__file__).resolve()

# the project's own variables
NAME = re.compile(r"\b(?:HOROVOD|FERROVOD|PERSEUS)_[A-Z0-9_]*[A-Z0-9]\b")
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?:\^(\d+))?(?![\w.])")
TESTS_SECTION = "Tests and benchmarks"

# a Rust file's unit tests, from here to the end of the file (where this repository keeps them)
_RUST_TESTS = re.compile(r"^#\[cfg\(test\)\]\s*\n\s*mod tests\b", re.MULTILINE)


# --- reading source --------------------------------------------------------------------------


def read(rel):
    return (ROOT / rel).read_text(encoding="utf-8")


def rust_strings(text):
    """The string literals of Rust source `text`, comments left out."""
    out, i, n = [], 0, len(text)
    ident = lambda k: k >= 0 and (text[k].isalnum() or text[k] == "_")  # noqa: E731
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif text[i] == "r" and not (ident(i - 1) and text[i - 1] != "b") and re.match(r'r#*"', text[i:]):
            hashes = re.match(r"r(#*)\"", text[i:]).group(1)
            start = i + 2 + len(hashes)
            end = text.find('"' + hashes, start)
            end = n if end < 0 else end
            out.append(text[start:end])
            i = end + 1 + len(hashes)
        elif text[i] == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i + 1:j])
            i = j + 1
        elif text[i] == "'":
            # a char literal ('x', '\n', '\u{..}') or a lifetime ('a)
            if text.startswith("\\", i + 1):
                j = text.find("'", i + 3)
                i = n if j < 0 else j + 1
            elif i + 2 < n and text[i + 2] == "'":
                i += 3
            else:
                i += 1
        else:
            i += 1
    return out


def python_strings(text):
    """The string constants of Python source `text`, bare string statements (docstrings) left
    out."""
    tree = ast.parse(text)
    bare = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in bare]


def rust_files():
    return sorted((ROOT / "src").rglob("*.rs"))


def python_files():
    paths = sorted((ROOT / "bindings").rglob("*.py")) + sorted((ROOT / "bindings").glob("*.pth"))
    return [p for p in paths if "__pycache__" not in p.parts and ".egg-info" not in str(p)]


@functools.lru_cache(maxsize=None)
def code_strings():
    """{path relative to the root: [string literals]} of the library (src/, unit-test modules
    left out) and the Python packages and launcher (bindings/)."""
    found = {}
    for path in rust_files():
        text = path.read_text(encoding="utf-8")
        m = _RUST_TESTS.search(text)
        found[str(path.relative_to(ROOT))] = rust_strings(text[: m.start()] if m else text)
    for path in python_files():
        found[str(path.relative_to(ROOT))] = python_strings(path.read_text(encoding="utf-8"))
    return found


def names_in(strings):
    return {n for s in strings for n in NAME.findall(s)}


def words_in(strings):
    return {w for s in strings for w in WORD.findall(s)}


@functools.lru_cache(maxsize=None)
def code_names():
    """The project's variable names the code uses (in string literals, outside comments)."""
    return frozenset(names_in(s for strings in code_strings().values() for s in strings))


@functools.lru_cache(maxsize=None)
def wide_corpus():
    """Every word of the code, scripts, tests and fuzz targets (raw text, this file left out):
    where the variables of tests and benchmarks live."""
    words = set()
    tops = ["src", "bindings", "scripts", "tests", "fuzz/fuzz_targets", "build.rs", "setup.py"]
    for top in tops:
        base = ROOT / top
        paths = [base] if base.is_file() else sorted(base.rglob("*"))
        for path in paths:
            if (not path.is_file() or path.resolve() == THIS or "__pycache__" in path.parts
                    or path.suffix not in {".rs", ".py", ".pth", ".sh", ".c", ".cc", ".h", ""}):
                continue
            try:
                words |= set(WORD.findall(path.read_text(encoding="utf-8")))
            except UnicodeDecodeError:
                continue
    return frozenset(words)


def block(text, start):
    """The text between the brace or bracket at or after `start` and its match."""
    opening = re.compile(r"[\[{(]").search(text, start).start()
    pairs = {"{": "}", "[": "]", "(": ")"}
    depth, i = 0, opening
    while i < len(text):
        c = text[i]
        if c == '"':
            i += 1
            while text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c in pairs:
            depth += 1
        elif c in pairs.values():
            depth -= 1
            if depth == 0:
                return text[opening + 1:i]
        i += 1
    raise ValueError("unbalanced from %d" % start)


def split_top(text, sep=","):
    """`text` split at `sep` outside brackets and strings."""
    parts, depth, cur, i = [], 0, [], 0
    while i < len(text):
        c = text[i]
        if c == '"':
            j = i + 1
            while text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            cur.append(text[i:j + 1])
            i = j + 1
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == sep and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def fn_body(text, signature):
    """The body of the function whose signature starts with `signature`."""
    at = text.index(signature)
    return block(text, text.index("{", at))


def rust_consts(*texts):
    """{NAME: expression} of every `const NAME: T = expression;`."""
    found = {}
    for text in texts:
        for m in re.finditer(r"\bconst\s+([A-Z][A-Z0-9_]*)\s*:\s*[^=]+=\s*([^;]+);", text):
            found[m.group(1)] = m.group(2).strip()
    return found


def rust_lets(body):
    """{name: expression} of the `let` statements in `body` (at its top level)."""
    found = {}
    for stmt in split_top(body, ";"):
        # a statement may follow a block (`if .. { .. }`) that has no `;` of its own
        m = re.search(r"(?:^|\})\s*let\s+(?:mut\s+)?(\w+)\s*=\s*(.*)$", stmt.strip(), re.DOTALL)
        if m:
            found[m.group(1)] = m.group(2).strip()
    return found


def evaluate(expr, names):
    """The value of a Rust constant expression of numbers, `<<`, `*`, `/`, `+`, `-`, `as` casts
    and the names in `names` (each itself an expression)."""
    expr = re.sub(r"\bas\s+(?:f64|f32|usize|u64|u32|i64|i32)\b", "", expr)
    expr = re.sub(r"\b(?:crate|self|super)::(?:\w+::)*", "", expr)
    expr = re.sub(r"(?<=\d)_(?=\d)", "", expr)

    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp):
            a, b = value(node.left), value(node.right)
            ops = {ast.LShift: lambda: a << b, ast.Mult: lambda: a * b, ast.Div: lambda: a / b,
                   ast.Add: lambda: a + b, ast.Sub: lambda: a - b}
            return ops[type(node.op)]()
        if isinstance(node, ast.Name) and node.id in names:
            return evaluate(names[node.id], names)
        raise ValueError("cannot evaluate %r" % expr)

    return value(ast.parse(expr.strip(), mode="eval"))


# --- facts from the source -------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def settings_source():
    return read("src/config.rs"), read("src/message.rs")


def from_lookup_body(config_rs):
    return fn_body(config_rs, "pub fn from_lookup")


def config_fields(config_rs):
    """{field of Config: the variables from_lookup reads for it}. A field's expression may use a
    `let` of from_lookup's or a function of config.rs; their reads count too."""
    body = from_lookup_body(config_rs)
    lets = rust_lets(body)
    literal = block(body, body.index("Config {"))
    read_call = re.compile(r'\bsrc\.\w+\(\s*"([A-Z][A-Z0-9_]*)"')

    def reads(expr, seen=()):
        found = set(read_call.findall(expr))
        bare = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
        # a local: a name not after `.` or `::` and not before `!`, `(` or `::`
        for word in set(re.findall(r"(?<![\w.:])([a-z_]\w*)\b(?!\s*(?:!|\(|::))", bare)) - set(seen):
            if word in lets:
                found |= reads(lets[word], seen + (word,))
        # a function of config.rs called by its plain name
        for word in set(re.findall(r"(?<![\w.:])([a-z_]\w*)\s*\(", bare)) - set(seen):
            if re.search(r"\bfn\s+%s\s*\(" % word, config_rs):
                found |= reads(fn_body(config_rs, "fn %s(" % word), seen + (word,))
        return found

    fields = {}
    for entry in split_top(literal):
        m = re.match(r"(\w+)\s*:\s*(.*)$", entry, re.DOTALL)
        if m:
            fields[m.group(1)] = reads(m.group(2))
        elif re.fullmatch(r"\w+", entry):  # shorthand `field,`
            fields[entry] = reads(entry)
    return fields


def agreed_variables(config_rs, job_rs):
    """The variables behind the settings rank 0 broadcasts at init: the `cfg.<field>`s of the
    `mine` array in `JobSettings::from_rank0`, mapped to what from_lookup reads for them."""
    body = fn_body(job_rs, "pub fn from_rank0")
    mine = block(body, body.index("let mine"))
    fields = list(dict.fromkeys(re.findall(r"\bcfg\.(\w+)", mine)))
    by_field = config_fields(config_rs)
    unmapped = [f for f in fields if not by_field.get(f)]
    if not fields or unmapped:
        raise AssertionError("cannot map the agreed fields %s to variables" % (unmapped or "(none found)"))
    return set().union(*(by_field[f] for f in fields))


def numeric_settings(config_rs, message_rs):
    """{variable: (default or None, low, high)} for every `src.num`, `src.opt_num` and
    `src.duration` read in from_lookup, evaluated from the literals and constants there. A
    default that is not a constant expression is None (not checked); a setting whose range is
    not one is left out."""
    body = from_lookup_body(config_rs)
    names = dict(rust_consts(config_rs, message_rs))
    names.update(rust_lets(body))

    def default_of(expr):
        inner = re.match(r"src\.num\(", expr)
        if inner:  # another variable's setting as the default: its default
            return default_of(split_top(block(expr, inner.end() - 1))[1])
        try:
            return evaluate(expr, names)
        except ValueError:
            return None

    found = {}
    for m in re.finditer(r"\bsrc\.(num|opt_num|duration)\(", body):
        args = split_top(block(body, m.end() - 1))
        key = args[0].strip('"')
        try:
            if m.group(1) == "num":
                found[key] = (default_of(args[1]), evaluate(args[2], names), evaluate(args[3], names))
            elif m.group(1) == "opt_num":
                found[key] = (None, evaluate(args[1], names), evaluate(args[2], names))
            else:
                unit, most = evaluate(args[2], names), evaluate(args[3], names)
                found[key] = (default_of(args[1]), 0, min(most, evaluate("MAX_SECONDS", names) / unit))
        except ValueError:
            continue
    return found


def flag_defaults(config_rs):
    """{variable: 0 or 1} for the flags from_lookup reads with `src.bool` (1 where an unset
    variable counts as on); flags whose unset value means "decide at run time" are left out."""
    body = from_lookup_body(config_rs)
    found = {}
    for key in re.findall(r'\bsrc\.bool\(\s*"([A-Z][A-Z0-9_]*)"', body):
        if re.search(r'src\.str\(\s*"%s"\s*\)\s*\.map\(' % key, body):
            continue
        found[key] = 1 if re.search(r'src\.str\(\s*"%s"\s*\)\s*\.is_none\(\)\s*\|\|' % key, body) else 0
    return found


def choice_settings(config_rs, message_rs):
    """{variable: (default, {accepted values})} for the settings parsed from names."""
    def method(text, owner, signature):
        return fn_body(text[text.index("impl %s {" % owner):], signature)

    def parse_arms(text, owner):
        return set(re.findall(r'"(\w+)"\s*=>', method(text, owner, "pub fn parse")))

    body = from_lookup_body(config_rs)
    found = {}
    for key, owner in (("FERROVOD_NEGOTIATION", "NegotiationMode"), ("FERROVOD_ALGORITHM", "AlgorithmChoice")):
        field = body[body.index('src.str("%s")' % key):]
        default = re.search(r"None\s*=>\s*%s::(\w+)" % owner, field).group(1).lower()
        found[key] = (default, parse_arms(config_rs, owner))
    names = set(re.findall(r'Compression::\w+(?:\(_\))?\s*=>\s*"(\w+)"', method(message_rs, "Compression", "pub fn name")))
    default = re.search(r"\(None,\s*None\)\s*=>\s*Compression::(\w+)", fn_body(config_rs, "fn compression_from"))
    found["FERROVOD_COMPRESSION"] = (default.group(1).lower(), names)
    perseus = set(re.findall(r'"(\w+)"\s*=>\s*Some', method(message_rs, "Compression", "pub fn from_perseus")))
    found["PERSEUS_ALLREDUCE_DTYPE"] = (None, perseus)
    return found


def const_value(rel, name):
    text = read(rel)
    return evaluate(rust_consts(text)[name], rust_consts(text))


def python_default_bucket_bytes():
    """FERROVOD_TORCH_BUCKET_BYTES's default: what `_bucket_bytes` returns for an unset value."""
    tree = ast.parse(read("bindings/torch/optimizer.py"))
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_bucket_bytes")
    ret = next(n for n in ast.walk(fn) if isinstance(n, ast.Return) and isinstance(n.value, (ast.BinOp, ast.Constant)))
    return evaluate(ast.unparse(ret.value), {})


def launcher_variables():
    """The project's variables that the launcher's `tuning_env` can set."""
    tree = ast.parse(read("bindings/horovod/runner/launch.py"))
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "tuning_env")
    return {c.value for c in ast.walk(fn) if isinstance(c, ast.Constant) and isinstance(c.value, str)
            and NAME.fullmatch(c.value)}


# --- reading the page ------------------------------------------------------------------------


class Row:
    def __init__(self, section, cells, line):
        self.section, self.cells, self.line = section, cells, line
        first = next(iter(cells.values()), "")
        self.names = re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", first)

    def cell(self, column):
        return self.cells.get(column, "")


def split_row(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def rows(doc):
    """Every table row of the page, with its section and its cells by column name. A row whose
    cell count differs from its header's is a problem, raised at once."""
    found, section, lines, i = [], "", doc.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("## "):
            section = lines[i][3:].strip()
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|\s*:?-", lines[i + 1]):
            header = [h.lower() for h in split_row(lines[i])]
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = split_row(lines[i])
                if len(cells) != len(header):
                    raise AssertionError("line %d: %d cells under a header of %d" % (i + 1, len(cells), len(header)))
                found.append(Row(section, dict(zip(header, cells)), i + 1))
                i += 1
            continue
        i += 1
    return found


def setting_rows(doc):
    """{variable: row} over the tables with a scope column."""
    found = {}
    for row in rows(doc):
        if "scope" in row.cells:
            for name in row.names:
                found.setdefault(name, row)
    return found


def numbers(cell):
    """The numbers of a cell, `2^N` read as a power of two."""
    return [float(base) ** int(exp) if exp else float(base) for base, exp in NUMBER.findall(cell)]


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


# --- the checks: each returns a list of problems ---------------------------------------------


def undocumented(doc, used):
    """Variables the code uses that no table row names."""
    listed = {n for row in rows(doc) for n in row.names}
    return sorted("%s is used by the code but has no row" % n for n in used - listed)


def stale(doc, code_words, wide_words):
    """Names on the page that the code no longer has: those of the tests' section anywhere in
    the code, scripts and tests; every other row's in the library's or the packages' code."""
    problems = []
    for row in rows(doc):
        corpus = wide_words if row.section == TESTS_SECTION else code_words
        problems += ["line %d: %s is not in the code" % (row.line, n) for n in row.names if n not in corpus]
    problems += ["%s is mentioned but not in the code, scripts or tests" % n
                 for n in sorted(set(NAME.findall(doc))) if n not in wide_words]
    return problems


def scope_mismatches(doc, agreed):
    """Rows whose scope says "agreed" where rank 0's value is not taken, and the reverse."""
    scoped = setting_rows(doc)
    problems = []
    for name in sorted(agreed):
        row = scoped.get(name)
        if row is None:
            problems.append("%s is agreed in the code but has no row with a scope" % name)
        elif not row.cell("scope").lower().startswith("agreed"):
            problems.append("line %d: %s is agreed in the code, the page says %r" % (row.line, name, row.cell("scope")))
    for name, row in sorted(scoped.items()):
        if row.cell("scope").lower().startswith("agreed") and name not in agreed:
            problems.append("line %d: %s is documented as agreed, but rank 0 does not send it" % (row.line, name))
    return problems


def value_mismatches(doc, numeric, flags, choices, exact):
    """Defaults and ranges on the page that differ from the code's.
    numeric: {variable: (default or None, low, high)}; flags: {variable: 0 or 1};
    choices: {variable: (default or None, {values})}; exact: [(variable, value)] where the value
    must be one of the numbers in the default cell."""
    scoped = setting_rows(doc)
    problems = []

    def row_of(name):
        row = scoped.get(name)
        if row is None:
            problems.append("%s has no row with a default" % name)
        return row

    for name, (default, low, high) in sorted(numeric.items()):
        row = row_of(name)
        if row is None:
            continue
        got = numbers(row.cell("default"))
        if default is not None and (not got or not close(got[0], default)):
            problems.append("line %d: %s default %s, code %s" % (row.line, name, row.cell("default"), default))
        m = re.search(r"(\d[\d.]*(?:\^\d+)?)\s+to\s+(\d[\d.]*(?:\^\d+)?)", row.cell("values"))
        bounds = numbers(m.group(1)) + numbers(m.group(2)) if m else []
        if len(bounds) != 2 or not (close(bounds[0], low) and close(bounds[1], high)):
            problems.append("line %d: %s range %r, code %s to %s" % (row.line, name, row.cell("values"), low, high))
    for name, default in sorted(flags.items()):
        row = row_of(name)
        got = numbers(row.cell("default")) if row else []
        if row and (not got or got[0] != default):
            problems.append("line %d: %s default %r, code %d" % (row.line, name, row.cell("default"), default))
    for name, (default, values) in sorted(choices.items()):
        row = row_of(name)
        if row is None:
            continue
        listed = set(re.findall(r"`([^`]+)`", row.cell("values")))
        if listed != values:
            problems.append("line %d: %s values %s, code %s" % (row.line, name, sorted(listed), sorted(values)))
        shown = re.findall(r"`([^`]+)`", row.cell("default"))
        if default is not None and shown[:1] != [default]:
            problems.append("line %d: %s default %r, code %s" % (row.line, name, row.cell("default"), default))
    for name, value in exact:
        row = row_of(name)
        if row is None:
            continue
        cell = row.cell("default")
        ok = value in cell if isinstance(value, str) else any(close(v, value) for v in numbers(cell))
        if not ok:
            problems.append("line %d: %s default %r lacks the code's %s" % (row.line, name, cell, value))
    return problems


def launcher_mismatches(doc, launched, strings_by_file):
    """The launcher's table against `tuning_env`: the same variables, and "read by ferrovod"
    true to the code (a variable is read where it occurs outside the launcher)."""
    table = {}
    for row in rows(doc):
        if "read by ferrovod" in row.cells and row.cell("read by ferrovod") in ("yes", "no"):
            for name in row.names:
                table[name] = (row, row.cell("read by ferrovod") == "yes")
    problems = ["%s is set by the launcher but not in its table" % n for n in sorted(launched - set(table))]
    problems += ["%s is in the launcher's table but the launcher does not set it" % n
                 for n in sorted(set(table) - launched)]
    launcher = "bindings/horovod/runner/launch.py"
    elsewhere = names_in(s for path, strings in strings_by_file.items() if path != launcher for s in strings)
    for name, (row, read_by) in sorted(table.items()):
        if read_by != (name in elsewhere):
            problems.append("line %d: %s read by ferrovod: the page says %s, the code %s"
                            % (row.line, name, "yes" if read_by else "no", "yes" if name in elsewhere else "no"))
    return problems


# --- the tests -------------------------------------------------------------------------------


def doc_text():
    return DOC.read_text(encoding="utf-8")


def code_facts():
    config_rs, message_rs = settings_source()
    numeric = numeric_settings(config_rs, message_rs)
    exact = [
        ("FERROVOD_FUSION_DIRECT_BYTES", const_value("src/fusion/planner.rs", "HOST_DIRECT_BYTES")),
        ("FERROVOD_RING_MIN_BYTES", const_value("src/collective/cost.rs", "RING_ACROSS_NODES_BYTES")),
        ("FERROVOD_COMPRESSION_MIN_BYTES", const_value("src/compress/mod.rs", "MIXED_MIN_BYTES")),
        ("FERROVOD_TORCH_BUCKET_BYTES", python_default_bucket_bytes()),
        ("OMPI_MCA_btl_tcp_flags", rust_consts(read("src/transport/mpi/setup.rs"))["OMPI_TCP_FLAGS"].strip('"')),
    ]
    return numeric, flag_defaults(config_rs), choice_settings(config_rs, message_rs), exact


def test_every_variable_the_code_uses_has_a_row():
    used = code_names()
    assert len(used) >= 40 and "HOROVOD_FUSION_THRESHOLD" in used and "FERROVOD_TORCH_TAKEOVER" in used
    assert undocumented(doc_text(), used) == []


def test_every_documented_variable_is_in_the_code():
    code_words = words_in(s for strings in code_strings().values() for s in strings)
    assert stale(doc_text(), code_words, wide_corpus()) == []


def test_agreed_scope_matches_what_rank_0_sends():
    agreed = agreed_variables(settings_source()[0], read("src/runtime/job.rs"))
    assert len(agreed) >= 10 and "HOROVOD_FUSION_THRESHOLD" in agreed
    assert scope_mismatches(doc_text(), agreed) == []


def test_defaults_and_ranges_match_the_code():
    numeric, flags, choices, exact = code_facts()
    assert len(numeric) >= 15 and len(flags) >= 8 and numeric["HOROVOD_CACHE_CAPACITY"][0] == 1024
    assert value_mismatches(doc_text(), numeric, flags, choices, exact) == []


def test_launcher_table_matches_the_launcher():
    launched = launcher_variables()
    assert len(launched) >= 15
    assert launcher_mismatches(doc_text(), launched, code_strings()) == []


# --- self-tests: each check fails on a broken page or a changed source -----------------------


def replace_once(text, old, new):
    assert text.count(old) >= 1, old
    return text.replace(old, new, 1)


def row_line(doc, name):
    return next(line for line in doc.splitlines() if line.startswith("| `%s`" % name))


def test_a_missing_row_is_found():
    doc = doc_text()
    broken = replace_once(doc, row_line(doc, "HOROVOD_CACHE_CAPACITY") + "\n", "")
    broken = broken.replace("`HOROVOD_CACHE_CAPACITY`", "")
    assert any("HOROVOD_CACHE_CAPACITY" in p for p in undocumented(broken, code_names()))
    # a variable of the Python packages too
    broken = doc.replace(row_line(doc, "FERROVOD_TORCH_BUCKET_BYTES") + "\n", "")
    assert any("FERROVOD_TORCH_BUCKET_BYTES" in p for p in undocumented(broken, code_names()))


def test_a_removed_variable_is_found():
    doc = doc_text()
    code_words = words_in(s for strings in code_strings().values() for s in strings)
    row = "| `FERROVOD_NO_SUCH_SETTING` | 1 | 1 to 2 | per rank | nothing |\n"
    broken = replace_once(doc, row_line(doc, "FERROVOD_POLL") + "\n", row_line(doc, "FERROVOD_POLL") + "\n" + row)
    assert any("FERROVOD_NO_SUCH_SETTING" in p for p in stale(broken, code_words, wide_corpus()))
    # a test variable that no script reads any more
    row = "| `FERROVOD_TEST_NO_SUCH` | unset | nothing | nothing |\n"
    broken = replace_once(doc, row_line(doc, "FUZZ_SECONDS") + "\n", row_line(doc, "FUZZ_SECONDS") + "\n" + row)
    assert any("FERROVOD_TEST_NO_SUCH" in p for p in stale(broken, code_words, wide_corpus()))


def test_a_wrong_scope_is_found():
    doc = doc_text()
    job_rs = read("src/runtime/job.rs")
    config_rs = settings_source()[0]
    agreed = agreed_variables(config_rs, job_rs)
    line = row_line(doc, "FERROVOD_GPU_GRAPHS")
    broken = replace_once(doc, line, line.replace("| agreed |", "| per rank |"))
    assert any("FERROVOD_GPU_GRAPHS" in p for p in scope_mismatches(broken, agreed))
    line = row_line(doc, "HOROVOD_CYCLE_TIME")
    broken = replace_once(doc, line, line.replace("| per rank |", "| agreed |"))
    assert any("HOROVOD_CYCLE_TIME" in p for p in scope_mismatches(broken, agreed))
    # the source side: a setting no longer sent by rank 0 must leave "agreed"
    changed = replace_once(job_rs, "usize::from(cfg.nan_check),", "")
    assert any("PERSEUS_ALLREDUCE_NANCHECK" in p for p in scope_mismatches(doc, agreed_variables(config_rs, changed)))


def test_a_wrong_default_or_range_is_found():
    doc = doc_text()
    numeric, flags, choices, exact = code_facts()

    def complaints(old_line_of, old, new):
        line = row_line(doc, old_line_of)
        broken = replace_once(doc, line, replace_once(line, old, new))
        return [p for p in value_mismatches(broken, numeric, flags, choices, exact) if old_line_of in p]

    assert complaints("HOROVOD_CACHE_CAPACITY", "| 1024 |", "| 1025 |")
    assert complaints("HOROVOD_CACHE_CAPACITY", "0 to 2^20", "0 to 2^21")
    assert complaints("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "| 600 |", "| 0 |")
    assert complaints("FERROVOD_CHANNELS", "1 to 64", "1 to 32")
    assert complaints("FERROVOD_MPI_MAX_COUNT", "16 to", "1 to")
    assert complaints("FERROVOD_GPU_GRAPHS", "| 1 |", "| 0 |")
    assert complaints("FERROVOD_NEGOTIATION", "`online` |", "`offline` |")
    assert complaints("FERROVOD_COMPRESSION", ", `u8`", "")
    assert complaints("FERROVOD_COMPRESSION_MIN_BYTES", "32768", "65536")
    assert complaints("FERROVOD_TORCH_BUCKET_BYTES", "26214400", "16777216")
    assert complaints("FERROVOD_RING_MIN_BYTES", "4194304", "8388608")
    # the source side: a changed literal in from_lookup is seen
    config_rs, message_rs = settings_source()
    changed = replace_once(config_rs, '"HOROVOD_CACHE_CAPACITY", 1024,', '"HOROVOD_CACHE_CAPACITY", 2048,')
    assert numeric_settings(changed, message_rs)["HOROVOD_CACHE_CAPACITY"][0] == 2048
    problems = value_mismatches(doc, numeric_settings(changed, message_rs), flags, choices, exact)
    assert any("HOROVOD_CACHE_CAPACITY" in p for p in problems)


def test_a_wrong_launcher_row_is_found():
    doc = doc_text()
    launched = launcher_variables()
    line = row_line(doc, "HOROVOD_THREAD_AFFINITY")
    broken = replace_once(doc, line, line.replace("| no |", "| yes |"))
    assert any("HOROVOD_THREAD_AFFINITY" in p for p in launcher_mismatches(broken, launched, code_strings()))
    broken = doc.replace(row_line(doc, "HOROVOD_TORUS_ALLREDUCE") + "\n", "")
    assert any("HOROVOD_TORUS_ALLREDUCE" in p for p in launcher_mismatches(broken, launched, code_strings()))


def test_fields_map_to_their_own_variables():
    fields = config_fields(settings_source()[0])
    assert fields["negotiation"] == {"FERROVOD_NEGOTIATION"}
    assert fields["stall_warn"] == {"HOROVOD_STALL_CHECK_TIME_SECONDS"}
    assert fields["stall_shutdown"] == {"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"}
    assert fields["channels"] == {"FERROVOD_CHANNELS", "PERSEUS_ALLREDUCE_STREAMS"}
    assert fields["compression"] == {"FERROVOD_COMPRESSION", "PERSEUS_ALLREDUCE_DTYPE"}
    assert fields["algorithm"] == {"FERROVOD_ALGORITHM", "HOROVOD_HIERARCHICAL_ALLREDUCE"}


def test_source_readers_skip_comments():
    rust = ('let a = "X_ONE"; // "HOROVOD_IN_COMMENT"\n'
            '/* "FERROVOD_IN_BLOCK" */ let c = \'"\'; let b = r#"FERROVOD_RAW"#;')
    assert names_in(rust_strings(rust)) == {"FERROVOD_RAW"}
    assert rust_strings(rust)[0] == "X_ONE"
    py = '"""FERROVOD_DOC"""\nimport os  # HOROVOD_COMMENT\nos.environ.get("HOROVOD_READ")\n'
    assert names_in(python_strings(py)) == {"HOROVOD_READ"}
