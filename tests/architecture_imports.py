"""The house's imports, read from the source, and the checks tests/test_architecture.py makes on them.

Every module under src/entoscope is parsed with `ast` (no module is imported): every `import` and
`from ... import` statement, wherever it stands (inside functions and `if TYPE_CHECKING:` too), relative
ones resolved to absolute names, and `importlib.import_module("name")` with a constant name. A room is a
top-level subpackage (`models`) or module (`sites`) of entoscope; the package's own `__init__.py` is the
room `__init__`. Floors are read from the table under "## Floors" in docs/architecture.md.

The check functions take plain data (an import graph, floors, line counts), so the tests can feed them a
made-up house and see them fail.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "src" / "entoscope"
ARCHITECTURE = REPO / "docs" / "architecture.md"
ROOT = "__init__"  # the room of entoscope/__init__.py (and of a name imported from the package itself)
BACKENDS = ("transformer_lens", "nnsight")
MAX_LINES = 600


@dataclass(frozen=True)
class Import:
    """One module importing another: dotted names (entoscope.models.features -> entoscope.dictionaries.catalog)."""

    importer: str
    imported: str
    line: int


# ---------------------------------------------------------------------------------------------- reading the source
def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> its file, for every .py file under the package."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name `from <level dots><name> import ...` means inside `module`."""
    if not level:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _constant_import_module(node: ast.Call) -> str | None:
    """The module of `importlib.import_module("name")` / `import_module("name")` with an absolute constant name."""
    f = node.func
    called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if called != "import_module" or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and not arg.value.startswith("."):
        return arg.value
    return None


def imports_of(module: str, path: Path, known_modules: Iterable[str]) -> list[Import]:
    """Every import in one module's source. `from X import a` imports X, and X.a where that is a module."""
    known = set(known_modules)
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node.level, node.module)
            names = [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
        elif isinstance(node, ast.Call):
            target = _constant_import_module(node)
            names = [target] if target else []
        out += [Import(module, n, node.lineno) for n in names if n]
    return out


def all_imports(package: Path = PACKAGE) -> list[Import]:
    files = module_files(package)
    return [imp for module, path in files.items() for imp in imports_of(module, path, files)]


def rooms_of(package: Path = PACKAGE) -> set[str]:
    """The package's rooms: its top-level modules and the subpackages (folders) holding Python files."""
    top = {p.relative_to(package).parts[0] for p in package.rglob("*.py")}
    return {t.removesuffix(".py") for t in top}


def room(dotted: str, rooms: set[str], package: str = "entoscope") -> str | None:
    """The room a dotted name is in (None: outside the package). A name the package itself defines
    (`from entoscope import __version__`) is in the room __init__."""
    parts = dotted.split(".")
    if parts[0] != package:
        return None
    return parts[1] if len(parts) > 1 and parts[1] in rooms else ROOT


def room_graph(imports: Iterable[Import], rooms: set[str]) -> dict[str, set[str]]:
    """Room -> the other rooms it imports."""
    graph: dict[str, set[str]] = {r: set() for r in rooms}
    for imp in imports:
        a, b = room(imp.importer, rooms), room(imp.imported, rooms)
        if a is not None and b is not None and a != b:
            graph[a].add(b)
    return graph


def line_counts(package: Path = PACKAGE) -> dict[str, int]:
    """Path relative to the package (models/cached.py) -> its number of lines."""
    return {p.relative_to(package).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
            for p in sorted(package.rglob("*.py"))}


# ---------------------------------------------------------------------------------------------- reading the doc
_ROW = re.compile(r"^\|\s*(\d+)\s*\|([^|]*)\|")


def floors_from_doc(text: str) -> dict[str, int]:
    """Room -> floor, from the table under "## Floors" (| floor | `models/`, `sites.py`, ... | what |)."""
    section = text.split("\n## Floors", 1)
    assert len(section) == 2, "docs/architecture.md has no '## Floors' section"
    body = section[1].split("\n## ", 1)[0]
    floors: dict[str, int] = {}
    for line in body.splitlines():
        m = _ROW.match(line.strip())
        if not m:
            continue
        for cell in m.group(2).split(","):
            name = cell.strip().strip("`").removesuffix("/").removesuffix(".py")
            assert name not in floors, f"docs/architecture.md puts {name!r} on two floors"
            floors[name] = int(m.group(1))
    assert floors, "docs/architecture.md's '## Floors' section has no table rows"
    return floors


# ---------------------------------------------------------------------------------------------- the checks
def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (depth-first search, in sorted order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def upward_imports(imports: Iterable[Import], floors: dict[str, int], rooms: set[str]) -> set[tuple[str, str]]:
    """(importer, imported) of every import from a room into a room on a higher floor."""
    out = set()
    for imp in imports:
        a, b = room(imp.importer, rooms), room(imp.imported, rooms)
        if a is not None and b is not None and floors[b] > floors[a]:
            out.add((imp.importer, imp.imported))
    return out


def backend_imports_outside(imports: Iterable[Import], rooms: set[str],
                            allowed: str = "models") -> set[tuple[str, str]]:
    """(importer, imported) of every import of transformer_lens or nnsight from a room other than `allowed`."""
    return {(imp.importer, imp.imported) for imp in imports
            if imp.imported.split(".")[0] in BACKENDS and room(imp.importer, rooms) != allowed}


def long_files(lines: dict[str, int], limit: int = MAX_LINES) -> set[str]:
    return {path for path, n in lines.items() if n > limit}


def check_against_known(found: set, known: set, what: str) -> None:
    """What is found is exactly what is known: a new case fails, and so does a known one that is gone (remove
    it from the list, so the list stays true)."""
    new, gone = sorted(found - known), sorted(known - found)
    problems = ([f"new {what}: {new}"] if new else []) + \
        ([f"listed as known {what} but no longer found (remove them from the list): {gone}"] if gone else [])
    assert not problems, "; ".join(problems)
