"""The documents that describe the code, checked against it.

- docs/LOCKING.md lists every mutex declared in csrc/ (by its name and the
  struct, class or function it is declared in, with its folder), and lists
  none that is gone;
- docs/ARCHITECTURE.md stays a map: at most 300 lines, and every path it
  names in backticks exists.

Reads files only (no torch, no build).
"""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"

# std::mutex, std::recursive_mutex, std::shared_mutex, std::timed_mutex,
# std::recursive_timed_mutex, std::shared_timed_mutex; c10:: and at:: ones.
_MUTEX = r"(?:std|c10|at)::(?:\w+_)?mutex\b"
# A declaration: `std::mutex m;`, `mutable std::mutex m_;`,
# `static std::mutex m;` (not `lock_guard<std::mutex>`, not `new std::mutex()`).
_DECLARATION = re.compile(_MUTEX + r"\s+(\w+)\s*(?:[;{=]|\(\s*\)\s*;)")
# A function that returns the lock it makes: `std::mutex& state_mutex() {`.
_ACCESSOR = re.compile(_MUTEX + r"\s*&\s*(\w+)\s*\(\s*\)\s*\{")
_KEYWORDS = {"if", "for", "while", "switch", "catch", "return", "sizeof", "decltype", "alignof", "noexcept",
             "static_assert", "defined", "__attribute__", "alignas"}


def _strip(text):
    """The source with comments and string and character literals blanked
    (lengths kept, so offsets still point at the same code)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + " " * (j - i - 2) + c if j - i >= 2 else text[i:j])
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _scopes(code):
    """For each `{` of `code`: (start, end, kind, name), kind one of
    'type' (struct, class, union), 'function', 'other'."""
    found, stack = [], []
    header_start = 0
    for i, c in enumerate(code):
        if c == "{":
            header = code[header_start:i]
            kind, name = "other", None
            m = re.search(r"\b(?:struct|class|union)\s+(?:alignas\([^)]*\)\s*)?(\w+)[^;(){}]*$", header)
            if m and not re.search(r"\benum\b", header):
                kind, name = "type", m.group(1)
            elif "namespace" in header.split():
                kind = "namespace"
            elif "(" in header and "[" not in header.split("(")[0]:
                for m in re.finditer(r"(~?\w+)\s*\(", header):
                    if m.group(1) not in _KEYWORDS:
                        kind, name = "function", m.group(1)
                        break
            stack.append([i, None, kind, name])
            header_start = i + 1
        elif c == "}":
            if stack:
                s = stack.pop()
                s[1] = i
                found.append(tuple(s))
            header_start = i + 1
        elif c == ";":
            header_start = i + 1
    return found


def _enclosing(scopes, pos):
    """The innermost struct/class name around `pos`, else the innermost
    function name, else None."""
    around = sorted((s for s in scopes if s[0] < pos and (s[1] is None or pos < s[1])), key=lambda s: -s[0])
    for kind in ("type", "function"):
        for s in around:
            if s[2] == kind:
                return s[3], kind
    return None, None


def declared_mutexes():
    """{(folder, key)}: every mutex declared in csrc/, keyed `Struct::name`
    (a member), `function::name` (a function's own lock), or `name` (a
    global, or a function that makes and returns its lock)."""
    found = {}
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in (".h", ".hpp", ".cpp", ".cc") or not path.is_file():
            continue
        folder = path.parent.relative_to(CSRC).as_posix()
        folder = "csrc" if folder == "." else folder
        code = _strip(path.read_text())
        scopes = _scopes(code)
        accessors = {m.group(1) for m in _ACCESSOR.finditer(code)}
        for name in accessors:
            found[(folder, name)] = path
        for m in _DECLARATION.finditer(code):
            scope, kind = _enclosing(scopes, m.start())
            if kind == "function" and scope in accessors:
                continue  # the lock an accessor returns: listed by the accessor's name
            key = f"{scope}::{m.group(1)}" if scope else m.group(1)
            found[(folder, key)] = path
    return found


def documented_locks(text):
    """{(folder, key)}: the rows of LOCKING.md's table of csrc's locks:
    `| `Key` | `folder/` | ...`."""
    rows = set()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not line.lstrip().startswith("|"):
            continue
        folder = re.fullmatch(r"`(\w+)/`", cells[1])
        if not folder:
            continue
        for key in re.findall(r"`([\w:~]+)`", cells[0]):
            rows.add((folder.group(1), key))
    return rows


def test_scanner_finds_the_kinds_of_declaration():
    code = _strip("""
        namespace a {
        struct S { std::mutex m; mutable std::recursive_mutex r_; };
        std::mutex& made() { static std::mutex m; return m; }
        void f() { static std::shared_mutex g; std::lock_guard<std::mutex> l(g); auto* p = new std::mutex(); }
        std::timed_mutex global_one;
        // std::mutex in_a_comment;
        }
    """)
    scopes = _scopes(code)
    keys = set()
    accessors = {m.group(1) for m in _ACCESSOR.finditer(code)}
    keys |= accessors
    for m in _DECLARATION.finditer(code):
        scope, kind = _enclosing(scopes, m.start())
        if kind == "function" and scope in accessors:
            continue
        keys.add(f"{scope}::{m.group(1)}" if scope else m.group(1))
    assert keys == {"S::m", "S::r_", "made", "f::g", "global_one"}


def test_every_lock_in_csrc_is_in_locking_md():
    declared = declared_mutexes()
    assert len(declared) >= 20, f"the scan found only {sorted(declared)}"
    documented = documented_locks((ROOT / "docs" / "LOCKING.md").read_text())
    missing = sorted(f"`{key}` in {folder}/ ({declared[(folder, key)].relative_to(ROOT)})"
                     for folder, key in set(declared) - documented)
    assert not missing, ("locks declared in csrc/ with no row in docs/LOCKING.md's table (add a row: "
                         "| `Struct::m` | `folder/` | file | what it guards | order |): " + ", ".join(missing))


def test_locking_md_lists_no_lock_that_is_gone():
    declared = set(declared_mutexes())
    documented = documented_locks((ROOT / "docs" / "LOCKING.md").read_text())
    gone = sorted(f"`{key}` ({folder}/)" for folder, key in documented - declared)
    assert not gone, "docs/LOCKING.md lists locks no longer declared in csrc/: " + ", ".join(gone)


def test_architecture_is_a_map():
    lines = (ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines()
    assert len(lines) <= 300, f"docs/ARCHITECTURE.md has {len(lines)} lines; the map keeps to 300 (detail goes to a topic document)"


_PATH_SUFFIXES = (".cpp", ".h", ".py", ".md", ".txt", ".cmake", ".sh", ".in", ".supp", ".c")


def _named_paths(text):
    """Backticked spans that are paths: a word with a slash, or a file name
    with a known suffix."""
    for span in re.findall(r"`([^`\n]+)`", text):
        if not re.fullmatch(r"[\w.\-/]+", span) or "::" in span:
            continue
        if "/" in span or span.endswith(_PATH_SUFFIXES):
            yield span


def _exists(span):
    span = span.rstrip("/")
    if "/" not in span:  # a bare file name: anywhere in the tree
        return any(p.name == span for p in ROOT.rglob(span) if ".git" not in p.parts)
    return any((base / span).exists() for base in (ROOT, CSRC))


def test_paths_named_by_the_map_exist():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    named = sorted(set(_named_paths(text)))
    assert len(named) >= 20, f"the map names only {named}"
    missing = [p for p in named if not _exists(p)]
    assert not missing, "docs/ARCHITECTURE.md names paths that do not exist: " + ", ".join(missing)


@pytest.mark.parametrize("doc", sorted(p.name for p in (ROOT / "docs").glob("*.md")) + ["README.md"])
def test_links_between_documents_resolve(doc):
    path = ROOT / "docs" / doc if doc != "README.md" else ROOT / "README.md"
    text = path.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(target)
            continue
        if anchor and dest.suffix == ".md":
            anchors = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                       for h in re.findall(r"^#+\s+(.*)$", dest.read_text(), flags=re.M)}
            if anchor not in anchors:
                broken.append(target)
    assert not broken, f"{doc}: links that do not resolve: {broken}"
