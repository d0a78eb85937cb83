"""Recorded figures: ``bench/records.json`` holds every figure docs/measurements.md quotes, each with its commit, date,
machine, torch and load; the page's tables are generated from it (``python -m tools.docs``) and a test fails when a
table and its records differ.

    python -m bench record RUN.json [--figures a,b] [--note TEXT] [--load TEXT]

adds the figures of a run (``python -m bench NAME --json RUN.json`` or ``all --quick --json``) to the records.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.common import REPO

RECORDS = REPO / "bench" / "records.json"
FIELDS = ("benchmark", "figure", "value", "commit", "date", "cores", "cpu", "torch", "load", "settings", "note")


def load() -> list[dict[str, Any]]:
    records = json.loads(RECORDS.read_text())["records"] if RECORDS.exists() else []
    for r in records:
        missing = [f for f in FIELDS if f not in r]
        if missing:
            raise SystemExit(f"{RECORDS.name}: a record of {r.get('benchmark')}.{r.get('figure')} lacks {missing}")
    return records


def save(records: list[dict[str, Any]]) -> None:
    lines = ",\n".join("  " + json.dumps({f: r[f] for f in FIELDS}, ensure_ascii=False) for r in records)
    RECORDS.write_text('{"records": [\n' + lines + "\n]}\n")


def _cell(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if abs(value - round(value)) < 1e-9:
            return str(int(round(value)))
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3f}"
    return str(value).replace("|", "\\|") if value not in (None, "") else "—"


def table(benchmark: str) -> str:
    """docs/measurements.md's table for one benchmark: each figure's records, oldest first."""
    rows = [r for r in load() if r["benchmark"] == benchmark]
    if not rows:
        return "(no figures recorded yet)\n"
    order = {f: i for i, f in reversed(list(enumerate(r["figure"] for r in rows)))}
    rows.sort(key=lambda r: (order[r["figure"]], r["date"]))
    lines = ["| figure | value | commit | date | machine | torch | load | settings, notes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        machine = f"{r['cores']} cores, {r['cpu']}" if r["cores"] else r["cpu"]
        notes = "; ".join(_cell(x) for x in (r["settings"], r["note"]) if x)
        lines.append(f"| `{r['figure']}` | **{_cell(r['value'])}** | {_cell(r['commit'])} | {r['date']} | "
                     f"{_cell(machine)} | {_cell(r['torch'])} | {_cell(r['load'])} | {notes or '—'} |")
    return "\n".join(lines) + "\n"


def record_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench record", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a JSON file written by python -m bench ... --json")
    parser.add_argument("--figures", help="comma-separated figure names to record (default: every figure)")
    parser.add_argument("--note", default="", help="what a reader needs beside the number")
    parser.add_argument("--load", help="the load to state (default: the load average the run started at)")
    args = parser.parse_args(argv)
    run = json.loads(Path(args.run).read_text())
    env = run["environment"]
    wanted = set(args.figures.split(",")) if args.figures else None
    records = load()
    added = 0
    for name, entry in run["benchmarks"].items():
        argv = entry.get("argv", [])
        argv = [a for i, a in enumerate(argv) if a != "--json" and (i == 0 or argv[i - 1] != "--json")]
        settings = " ".join(argv) + (" (quick form)" if run.get("quick") else "")
        for figure, value in entry.get("figures", {}).items():
            if wanted is None or figure in wanted:
                records.append({"benchmark": name, "figure": figure, "value": value, "commit": env["commit"],
                                "date": env["date"], "cores": env["cores"], "cpu": env["cpu"], "torch": env["torch"],
                                "load": args.load or f"load {env['load']:.1f}", "settings": settings.strip(),
                                "note": args.note})
                added += 1
    save(records)
    print(f"{added} figures added to {RECORDS.relative_to(REPO)}; `python -m tools.docs` updates docs/measurements.md")
    return 0
