"""The house keeps its rules: docs/architecture.md's floors and rooms, checked against every import in the source.

(a) the rooms' import graph has no cycle; (b) no import runs up the house (a room imports only rooms on its
own floor or below, the floors being the table in docs/architecture.md); (c) only models/ imports
transformer_lens or nnsight; (d) no module is over 600 lines. Today's exceptions are listed by name below:
a new one fails, and so does a listed one that is gone, so the lists stay true. The last tests feed the
checks a made-up house, to show that each one can fail.
"""

from __future__ import annotations

import pytest

import architecture_imports as ai

# Imports that run up the house today, (importing module, imported module): none.
KNOWN_UPWARD: set[tuple[str, str]] = set()

# Imports of transformer_lens or nnsight outside models/ today, (importing module, imported module): none.
KNOWN_BACKEND_OUTSIDE_MODELS: set[tuple[str, str]] = set()

# Modules over 600 lines today (paths under src/entoscope).
KNOWN_LONG: set[str] = set()


@pytest.fixture(scope="module")
def house():
    imports = ai.all_imports()
    rooms = ai.rooms_of()
    floors = ai.floors_from_doc(ai.ARCHITECTURE.read_text(encoding="utf-8"))
    return imports, rooms, floors


def _edges_of(cycle: list[str], imports: list[ai.Import], rooms: set[str]) -> list[str]:
    """The imports that make each step of a cycle of rooms (module:line -> module)."""
    out = []
    for a, b in zip(cycle, cycle[1:]):
        out += [f"{i.importer}:{i.line} -> {i.imported}" for i in imports
                if ai.room(i.importer, rooms) == a and ai.room(i.imported, rooms) == b]
    return out


def test_every_room_is_on_one_floor_of_the_doc(house):
    _, rooms, floors = house
    left_out, stale = sorted(rooms - set(floors)), sorted(set(floors) - rooms)
    assert not left_out, f"rooms that docs/architecture.md's floors table leaves out: {left_out}"
    assert not stale, f"the floors table names rooms src/entoscope lacks: {stale}"


def test_the_rooms_import_no_cycle(house):
    imports, rooms, _ = house
    kept = [i for i in imports if (i.importer, i.imported) not in KNOWN_UPWARD]
    cycle = ai.find_cycle(ai.room_graph(kept, rooms))
    assert cycle is None, f"the rooms import in a cycle {' -> '.join(cycle)}: {_edges_of(cycle, kept, rooms)}"


def test_no_import_runs_up_the_house(house):
    imports, rooms, floors = house
    ai.check_against_known(ai.upward_imports(imports, floors, rooms), KNOWN_UPWARD,
                           "imports into a room on a higher floor (docs/architecture.md, Floors)")


def test_only_models_imports_transformer_lens_or_nnsight(house):
    imports, rooms, _ = house
    ai.check_against_known(ai.backend_imports_outside(imports, rooms), KNOWN_BACKEND_OUTSIDE_MODELS,
                           "imports of transformer_lens / nnsight outside models/ (docs/architecture.md, rule 1)")


def test_no_module_is_over_600_lines():
    ai.check_against_known(ai.long_files(ai.line_counts()), KNOWN_LONG, f"modules over {ai.MAX_LINES} lines")


def test_the_reader_sees_imports_inside_functions_and_relative_ones():
    """The reader against imports written out by hand: models/features.py imports the catalog inside a
    function, relatively (`from .dictionaries.catalog import get_dictionary`)."""
    files = ai.module_files()
    found = {i.imported for i in ai.imports_of("entoscope.models.features", files["entoscope.models.features"], files)}
    assert "entoscope.models.dictionaries.catalog" in found
    assert "entoscope.errors" in found  # a top-level `from ..errors import ...`
    assert ai._absolute("entoscope.models.features", False, 2, "dictionaries.catalog") == \
        "entoscope.dictionaries.catalog"
    assert ai._absolute("entoscope.models", True, 1, "names") == "entoscope.models.names"  # in models/__init__.py
    assert ai._absolute("entoscope.cli", False, 1, None) == "entoscope"  # from . import __version__


# ---------------------------------------------------------------------------------------------- each check can fail
ROOMS = {"low", "mid", "high", "models"}
FLOORS = {ai.ROOT: 0, "low": 0, "models": 1, "mid": 2, "high": 3}


def _imp(importer: str, imported: str) -> ai.Import:
    """An import of the made-up house: importer under entoscope, imported as written (entoscope's own: `.x`)."""
    return ai.Import(f"entoscope.{importer}", f"entoscope{imported}" if imported.startswith(".") else imported, 1)


def test_a_cycle_is_found():
    made_up = [_imp("low", ".mid.x"), _imp("mid.x", ".high"), _imp("high", ".low")]
    assert ai.find_cycle(ai.room_graph(made_up, ROOMS)) == ["high", "low", "mid", "high"]
    assert ai.find_cycle(ai.room_graph(made_up[:2], ROOMS)) is None


def test_an_upward_import_is_found():
    made_up = [_imp("high.a", ".mid.b"), _imp("mid.b", ".high.c"), _imp("mid.b", ".mid.d"), _imp("low", "entoscope")]
    assert ai.upward_imports(made_up, FLOORS, ROOMS) == {("entoscope.mid.b", "entoscope.high.c")}


def test_a_backend_import_outside_models_is_found():
    made_up = [_imp("models.tl", "transformer_lens.hook_points"), _imp("high.op", "nnsight"),
               _imp("mid.x", "torch")]
    assert ai.backend_imports_outside(made_up, ROOMS) == {("entoscope.high.op", "nnsight")}


def test_a_long_file_is_found():
    assert ai.long_files({"a.py": 600, "b/c.py": 601}) == {"b/c.py"}


def test_a_new_case_and_a_vanished_known_one_both_fail():
    ai.check_against_known({"x"}, {"x"}, "cases")
    with pytest.raises(AssertionError, match="new cases"):
        ai.check_against_known({"x", "y"}, {"x"}, "cases")
    with pytest.raises(AssertionError, match="no longer found"):
        ai.check_against_known(set(), {"x"}, "cases")


def test_the_floors_table_is_read_and_refused_when_broken():
    doc = ("# A\n\n## Floors\n\n| floor | rooms | what |\n|---|---|---|\n| 1 | `mid/`, `top.py` | x |\n"
           "| 0 | `low/` | y |\n\n## Rules\n| 9 | `not_a_floor` | z |\n")
    assert ai.floors_from_doc(doc) == {"mid": 1, "top": 1, "low": 0}
    with pytest.raises(AssertionError, match="two floors"):
        ai.floors_from_doc(doc.replace("`low/`", "`mid/`"))
    with pytest.raises(AssertionError, match="no '## Floors'"):
        ai.floors_from_doc("# A\n")
