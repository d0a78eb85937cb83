"""The generated parts of the manual, read from the live code: one command rewrites them, one test keeps them current.

* ``docs/settings.md``: the whole page, from ``PipelineConfig``'s field docstrings (``lightning_pipe.config``);
* the ``layout`` block (docs/development.md): the package's modules by import floor, each with its docstring's first
  sentence, the floors read from ``tests/unit/test_architecture.py`` (the rule the tests enforce);
* the ``schedules`` block (docs/schedules.md): every registered schedule from its ``ScheduleSpec``;
* the ``measurements:<benchmark>`` blocks (docs/measurements.md): each benchmark's recorded figures
  (``bench/records.json``, :mod:`bench.records`).

A block sits between ``<!-- BEGIN GENERATED name ... -->`` and ``<!-- END GENERATED name -->``; the text around it is
written by hand. ``tests/unit/test_docs.py`` fails when a page differs from what this module writes.

    python -m tools.docs           # rewrite every generated page and block
    python -m tools.docs --check   # list the stale ones (exit status 1), write nothing
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lightning_pipe"
BLOCK = re.compile(r"(?P<head><!-- BEGIN GENERATED (?P<name>[\w:.-]+)\b[^>]*-->\n)(?P<body>.*?)"
                   r"(?P<tail><!-- END GENERATED (?P=name) -->)", re.S)
SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bal)(?<!\bvs)[.!?](?=\s+[A-Z`(\[]|\s*$)")


def summary(docstring: str) -> str:
    """The first sentence of a docstring's first paragraph, as markdown (Sphinx roles and double backticks plain)."""
    first = " ".join(docstring.split("\n\n", 1)[0].split())
    end = SENTENCE_END.search(first)
    text = first[: end.end()] if end else first
    text = re.sub(r":\w+:`~[\w.]*?(\w+)`", r"`\1`", text)  # :class:`~a.b.C` -> `C`, as Sphinx shows it
    text = re.sub(r":\w+:`([^`]+)`", r"`\1`", text).replace("``", "`")
    return text.replace("|", "\\|")


def module_summaries() -> dict[str, str]:
    """``folder/module.py`` (or ``folder/`` for a package's ``__init__``) -> summary, from the source (no import)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        key = rel.removesuffix("__init__.py") or "__init__.py"
        doc = ast.get_docstring(ast.parse(path.read_text()))
        found[key] = summary(doc) if doc else "(no module docstring)"
    return found


def layout_map() -> str:
    """The package by floor, bottom first: each folder (its ``__init__`` docstring) and module."""
    from tests.unit.test_architecture import FLOORS

    modules = module_summaries()

    def folder(key: str) -> str:
        return key.split("/", 1)[0] if "/" in key else ("<root>" if key == "__init__.py" else key.removesuffix(".py"))

    unknown = sorted({folder(k) for k in modules} - set(FLOORS))
    if unknown:
        raise SystemExit(f"folders without a floor in tests/unit/test_architecture.py FLOORS: {unknown}")
    lines = ["| floor | module | what it holds |", "|---|---|---|"]
    for name in sorted(FLOORS, key=lambda n: (FLOORS[n], n.lstrip("_"))):
        keys = [k for k in modules if folder(k) == name]
        for key in sorted(keys):  # a folder's row ("x/") before its modules
            shown = f"**`{key}`**" if key.endswith("/") else f"`{key}`"
            lines.append(f"| {FLOORS[name]} | {shown} | {modules[key]} |")
    return "\n".join(lines) + "\n"


def _stages(spec: Any) -> str:
    if spec.placement == "given":
        return "as given"
    if spec.placement == "mirror":
        return "1 per pipeline (2 per rank)"
    allowed = spec.allowed_stages_per_rank
    if allowed is None:
        return f"v ≥ {spec.min_stages_per_rank} (default {spec.default_stages_per_rank})"
    return " or ".join(str(v) for v in allowed) if allowed != (2,) else "exactly 2"


def _placement(spec: Any) -> str:
    if spec.placement == "loop":
        return "rank r: stage r" if spec.allowed_stages_per_rank == (1,) else "loop: r, r+p, r+2p, …"
    return {"v": "V: r and 2p−1−r", "mirror": "mirror: r and p−1−r", "given": "as given"}[spec.placement]


def _needs(spec: Any) -> str:
    if spec.resolve is not None:
        if not spec.needs:
            raise SystemExit(f"schedule {spec.name!r} resolves its own plan: say what it needs in ScheduleSpec.needs")
        needs = spec.needs
    else:
        stages = "m ≥ 2p" if spec.allowed_stages_per_rank == (2,) else "m ≥ v·p"
        needs = {"none": "any m", "pipeline": "m ≥ p", "stages": stages}[spec.min_microbatches]
        if spec.rounds_divisible:
            needs += ", m a multiple of max(1, m // p)"
    if spec.split_backward:
        needs += "; split backward ([versions](versions.md))"
    return needs


def schedule_table() -> str:
    """Every registered schedule, from its spec: what it is, where its stages go, what it needs, its options."""
    from lightning_pipe.schedules import available_schedules, get_schedule_spec

    lines = ["| `schedule` | what | stages per rank | placement | needs | `schedule_options` | tensor parallel |",
             "|---|---|---|---|---|---|---|"]
    for name in available_schedules():
        spec = get_schedule_spec(name)
        options = ", ".join(f"`{o}`" for o in spec.options) or "—"
        what = spec.description.replace("|", "\\|")
        lines.append(f"| `{name}` | {what} | {_stages(spec)} | {_placement(spec)} | {_needs(spec)} | {options} | "
                     f"{'yes' if spec.tensor_parallel else 'no'} |")
    return "\n".join(lines) + "\n"


def measurement_table(benchmark: str) -> str:
    from bench.records import table

    return table(benchmark)


def block(name: str) -> str:
    """The generated body of block ``name``."""
    if name == "layout":
        return layout_map()
    if name == "schedules":
        return schedule_table()
    if name.startswith("measurements:"):
        return measurement_table(name.split(":", 1)[1])
    raise SystemExit(f"no generator for the block {name!r} (tools/docs.py)")


def render(text: str) -> str:
    """``text`` with every generated block rewritten."""
    return BLOCK.sub(lambda m: m["head"] + block(m["name"]) + m["tail"], text)


def _settings() -> str:
    from lightning_pipe.config import settings_markdown

    return settings_markdown()


WHOLE_PAGES: dict[str, Callable[[], str]] = {"docs/settings.md": _settings}


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def expected() -> dict[Path, str]:
    """Every page with generated content -> the text it should have."""
    out = {REPO / rel: make() for rel, make in WHOLE_PAGES.items()}
    for page in pages():
        if page not in out and BLOCK.search(page.read_text()):
            out[page] = render(page.read_text())
    return out


def stale() -> list[str]:
    """What differs from the code, one entry per page or block: ``docs/x.md`` or ``docs/x.md: block NAME``."""
    found = []
    for page, text in expected().items():
        rel = page.relative_to(REPO).as_posix()
        if page.read_text() == text:
            continue
        if rel in WHOLE_PAGES:
            found.append(rel)
            continue
        found += [f"{rel}: block {m['name']}" for m in BLOCK.finditer(page.read_text()) if m["body"] != block(m["name"])]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.docs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="list stale pages (exit status 1); write nothing")
    args = parser.parse_args(argv)
    if args.check:
        for entry in stale():
            print(f"stale: {entry}")
        return 1 if stale() else 0
    for page, text in expected().items():
        if page.read_text() != text:
            page.write_text(text)
            print(f"wrote {page.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
