"""docs/features.md's table and the feature matrix (tests/distributed/scenarios/features.py) say the same thing:
every feature the matrix runs has a row, every row names cases or tests that exist, and each row's verdict is what
its cases check (works at parity, refused with the rule, warns)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.distributed.scenarios.features import FEATURES, MATRIX, verdict

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"


def rows() -> list[tuple[str, str, list[str]]]:
    """(feature text, verdict, checked by) of every table row."""
    out = []
    for line in (REPO / "docs" / "features.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("feature", "---"):
            continue
        out.append((cells[0], cells[1], re.findall(r"`([a-z0-9_]+)`", cells[3])))
    return out


def test_every_row_names_what_checks_it_and_says_what_it_checks() -> None:
    table = rows()
    assert len(table) >= 40
    tests = "\n".join(p.read_text() for p in TESTS.rglob("test_*.py"))
    for feature, said, checked_by in table:
        assert checked_by, f"{feature}: no case"
        assert said in ("works", "refused", "warns"), (feature, said)
        for name in checked_by:
            if name.startswith("test_"):
                assert f"def {name}(" in tests, f"{feature}: no test {name}"
            else:
                assert name in FEATURES, f"{feature}: no case {name}"
                assert verdict(name) == said, f"{feature}: the table says {said}, the case checks {verdict(name)}"


def test_every_case_of_the_matrix_has_a_row() -> None:
    named = {name for _, _, checked_by in rows() for name in checked_by}
    assert {case.feature for case in MATRIX} <= named
    assert set(FEATURES) <= named  # every feature a scenario can run is in the table
