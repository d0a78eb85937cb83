"""Every ``[Note: X]`` reference resolves to exactly one definition: a reference in lightning_pipe/ to a note of
lightning_pipe/, a reference in tests/ to a note of lightning_pipe/ or of the test harness (tests/). Checked by reading
the source, no imports.

A definition is the note's name alone on its line (in a docstring, or a ``#`` comment), followed by the note's text
on the next line; any other ``[Note: X]`` is a reference. A reference may wrap across lines of a docstring or a
comment block.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIBRARY, TESTS = REPO / "lightning_pipe", REPO / "tests"
NOTE = re.compile(r"\[Note:\s+([^\]\[]{1,200}?)\]")
HEADING = re.compile(r'^\s*(#\s*|r?""")?\[Note: ([^\]]+)\]\s*$')


def _name(text: str) -> str:
    """A note's name with line breaks, comment markers and runs of spaces folded to single spaces."""
    return " ".join(re.sub(r"\n\s*#?", " ", text).split())


def notes_in(source: str) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """(definitions, references) of ``source``: note name -> the lines it appears on."""
    lines = source.splitlines()
    definitions: dict[str, list[int]] = defaultdict(list)
    heading_lines = set()
    for i, line in enumerate(lines):
        heading = HEADING.match(line)
        if heading is None or i + 1 >= len(lines):
            continue
        following = lines[i + 1].strip()
        continued = following.startswith("#") and len(following) > 1 if (heading.group(1) or "").startswith("#") \
            else bool(following)
        if continued:
            definitions[_name(heading.group(2))].append(i + 1)
            heading_lines.add(i + 1)
    references: dict[str, list[int]] = defaultdict(list)
    for match in NOTE.finditer(source):
        line = source.count("\n", 0, match.start()) + 1
        if line not in heading_lines:
            references[_name(match.group(1))].append(line)
    return definitions, references


def _scan(root: Path) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    definitions: dict[str, list[str]] = defaultdict(list)
    references: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        if path == Path(__file__).resolve():  # this file's examples are not notes
            continue
        defined, referenced = notes_in(path.read_text())
        where = path.relative_to(REPO)
        for name, at in defined.items():
            definitions[name] += [f"{where}:{n}" for n in at]
        for name, at in referenced.items():
            references[name] += [f"{where}:{n}" for n in at]
    return definitions, references


LIBRARY_DEFINITIONS, LIBRARY_REFERENCES = _scan(LIBRARY)
TEST_DEFINITIONS, TEST_REFERENCES = _scan(TESTS)


def test_each_note_is_defined_once() -> None:
    everywhere: dict[str, list[str]] = defaultdict(list)
    for definitions in (LIBRARY_DEFINITIONS, TEST_DEFINITIONS):
        for name, at in definitions.items():
            everywhere[name] += at
    twice = {name: at for name, at in everywhere.items() if len(at) > 1}
    assert not twice, f"notes defined more than once: {twice}"


def test_every_library_reference_resolves_in_the_library() -> None:
    loose = {name: at for name, at in LIBRARY_REFERENCES.items() if name not in LIBRARY_DEFINITIONS}
    assert not loose, f"[Note: ...] references with no definition in lightning_pipe/: {loose}"


def test_every_test_reference_resolves() -> None:
    known = set(LIBRARY_DEFINITIONS) | set(TEST_DEFINITIONS)
    loose = {name: at for name, at in TEST_REFERENCES.items() if name not in known}
    assert not loose, f"[Note: ...] references in tests/ with no definition: {loose}"


def test_the_note_reader_can_fail() -> None:
    source = ('"""Module.\n\n[Note: a rule]\nWhy the rule holds.\n"""\n\n'
              "# [Note: a comment note]\n# and its text.\nx = 1  # [Note: a rule], [Note: a\n# comment note]\n"
              "# [Note: not a definition]\ny = 2\n# see [Note: a rule] and [Note: missing ...]\n")
    defined, referenced = notes_in(source)
    assert dict(defined) == {"a rule": [3], "a comment note": [7]}
    assert dict(referenced) == {"a rule": [9, 13], "a comment note": [9], "not a definition": [11],
                                "missing ...": [13]}
