"""What users read describes the library as it is: its behaviour, its limits, its cost, the bugs it guards against and
the measurements behind its numbers. The project's own working vocabulary (its milestones, who tested what on which
borrowed machine, what the code did before some change) means nothing to them; history belongs in CHANGELOG.md and
dated figures in docs/measurements.md. Checked on the docs, the README, the package, the benchmarks, the tests and the
recipes, line by line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCOPE = ["README.md", "docs/**/*.md", "lightning_pipe/**/*.py", "bench/**/*.py", "tests/**/*.py", "recipes/**/*.py",
         "recipes/**/*.md"]
EXEMPT = {"tests/unit/test_vocabulary.py"}  # the list below

# (pattern, what to write instead); case-insensitive, whole words
BANNED = [
    (r"\bstops? \d+\b", "the project's milestones: say what changed, or date a measurement in docs/measurements.md"),
    (r"\b(this|that|earlier|a later|the next) stop\b", "the project's milestones"),
    (r"\boutside testers?\b", "who found it: describe the input or the failure"),
    (r"\blent\b", "whose machine: say which machine (one H200, torch 2.11 ...)"),
    (r"(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bbeen )(?<!\bwas )(?<!\bwere )\bused to\b",
     "what the code did before: describe what it does (history: CHANGELOG.md)"),
    (r"\b(before|after|since) this (change|work|branch|fix|commit)\b", "history: CHANGELOG.md"),
    (r"\bas before\b", "history: say what the behaviour is"),
    (r"\bsince the [\d.]+ pin\b", "history: CHANGELOG.md"),
    (r"\bthe bench lock\b", "a measurement's load belongs in its docs/measurements.md row"),
    (r"\bthis branch\b", "history: CHANGELOG.md"),
]
# the project's issue numbers mean nothing where users read (tests may cite the tracker)
USER_FACING = ("README.md", "docs/", "lightning_pipe/")
BANNED_FOR_USERS = [(r"\bissues? #?\d+", "the project's tracker: describe the behaviour or the bug")]


def files() -> list[Path]:
    found = {p for pattern in SCOPE for p in REPO.glob(pattern) if p.is_file()}
    return sorted(p for p in found if p.relative_to(REPO).as_posix() not in EXEMPT
                  and ".venv" not in p.parts and "__pycache__" not in p.parts)


def violations(path: Path) -> list[str]:
    rel = path.relative_to(REPO).as_posix()
    rules = BANNED + (BANNED_FOR_USERS if rel.startswith(USER_FACING) else [])
    found = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        for pattern, instead in rules:
            match = re.search(pattern, line, re.IGNORECASE)
            if match:
                found.append(f"{rel}:{number}: '{match.group(0)}' ({instead})")
    return found


def test_the_scope_is_found() -> None:
    names = {p.relative_to(REPO).as_posix() for p in files()}
    assert {"README.md", "docs/performance.md", "lightning_pipe/runtime/engine.py", "bench/common.py"} <= names


@pytest.mark.parametrize(("pattern", "text", "hit"), [
    (BANNED[0][0], "measured at stop 20", True),
    (BANNED[0][0], "the run stops", False),
    (BANNED[4][0], "torch's stages used to keep every output", True),
    (BANNED[4][0], "the tensor is used to compute the loss", False),
    (BANNED[2][0], "(an outside tester)", True),
    (BANNED_FOR_USERS[0][0], "fixed in issue #24", True),
])
def test_the_patterns_match_what_they_mean(pattern: str, text: str, hit: bool) -> None:
    assert bool(re.search(pattern, text, re.IGNORECASE)) is hit


def test_no_working_vocabulary_where_users_read() -> None:
    found = [v for path in files() for v in violations(path)]
    assert not found, "the project's working vocabulary, where users read it:\n" + "\n".join(found)
