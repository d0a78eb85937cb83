"""The manual stays true: README.md and docs/*.md link only to files that exist, their Python snippets compile, the
snippets marked ``<!-- runnable -->`` run, docs/settings.md is what ``python -m lightning_pipe.config --markdown``
prints, and every generated page and block is what ``python -m tools.docs`` writes from the code today. (The
``python recipes/gpt/train.py ...`` overrides they show are composed in test_configs.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_pipe.config import settings_markdown
from lightning_pipe.schedules import available_schedules
from tools import docs as generated

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"(?P<mark><!-- runnable -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def snippets(doc: Path) -> list[tuple[str, str, bool]]:
    """(language, body, runnable) of every fenced block."""
    return [(m["lang"], m["body"], bool(m["mark"])) for m in FENCE.finditer(doc.read_text())]


def name(doc: Path) -> str:
    return doc.relative_to(REPO).as_posix()


@pytest.mark.parametrize("doc", DOCS, ids=name)
def test_relative_links_resolve(doc: Path) -> None:
    text = FENCE.sub("", doc.read_text())  # (code is not a link)
    broken = []
    for match in LINK.finditer(text):
        target = match["target"].split("#", 1)[0]
        if not target or re.match(r"^[a-z]+:", target):  # an anchor in the same page, or a URL
            continue
        if not (doc.parent / target).exists():
            broken.append(match["target"])
    assert not broken, f"{name(doc)} links to missing files: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=name)
def test_python_snippets_compile(doc: Path) -> None:
    for i, (lang, body, _) in enumerate(snippets(doc)):
        if lang == "python":
            compile(body, f"{name(doc)} snippet {i}", "exec")


RUNNABLE = [(doc, i, lang, body) for doc in DOCS for i, (lang, body, run) in enumerate(snippets(doc)) if run]


def commands(body: str) -> list[str]:
    """A shell snippet's commands: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    return [line for line in (raw.split(" #", 1)[0].strip() for raw in joined.splitlines())
            if line and not line.startswith("#")]


def test_some_snippets_are_runnable() -> None:
    assert {lang for *_, lang, _ in RUNNABLE} == {"bash", "python"}, RUNNABLE


@pytest.mark.parametrize(("doc", "index", "lang", "body"), RUNNABLE, ids=lambda v: name(v) if isinstance(v, Path) else "")
def test_runnable_snippets_run(doc: Path, index: int, lang: str, body: str, tmp_path: Path) -> None:
    """In a scratch directory (with an empty docs/), on this interpreter, the repository on the path."""
    (tmp_path / "docs").mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    if lang == "python":
        runs = [[sys.executable, "-c", body]]
    else:
        assert lang == "bash", f"{name(doc)} snippet {index}: runnable snippets are bash or python"
        runs = [["bash", "-c", re.sub(r"^python\b", f'"{sys.executable}"', cmd)] for cmd in commands(body)]
    for run in runs:
        done = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{name(doc)} snippet {index}: {run[-1]}\n{done.stdout}\n{done.stderr}"
    if "docs/settings.md" in body:  # the documented regeneration gives the checked-in page
        assert (tmp_path / "docs" / "settings.md").read_text() == (REPO / "docs" / "settings.md").read_text()


def test_settings_page_is_current() -> None:
    page = REPO / "docs" / "settings.md"
    assert page.read_text() == settings_markdown(), (
        "docs/settings.md is stale: run `python -m lightning_pipe.config --markdown > docs/settings.md`")


def test_generated_pages_and_blocks_are_current() -> None:
    """The layout map (docs/development.md), the schedule table (docs/schedules.md), the measurement tables
    (docs/measurements.md) and the settings page, each against what the code and the records give now."""
    stale = generated.stale()
    assert not stale, f"stale generated docs: {stale}; run `python -m tools.docs`"


def test_generated_blocks_have_a_generator_and_the_expected_places() -> None:
    names = {m["name"] for page in generated.pages() for m in generated.BLOCK.finditer(page.read_text())}
    assert {"layout", "schedules"} <= names, names
    for name in names:
        generated.block(name)  # an unknown name stops with the block's name


def test_readme_names_every_schedule_and_links_the_one_table() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Schedules"):readme.index("\n## ", readme.index("## Schedules") + 3)]
    missing = [name for name in available_schedules() if f"`{name}`" not in section]
    assert not missing, f"README's Schedules section does not name {missing}"
    assert "| `schedule` |" not in readme, "the schedule table lives in docs/schedules.md only (generated)"
    assert "(docs/schedules.md)" in section


def test_readme_stays_short_and_shows_the_two_commands() -> None:
    readme = (REPO / "README.md").read_text()
    assert readme.count("\n") <= 250
    assert "make train" in readme and "make test" in readme
