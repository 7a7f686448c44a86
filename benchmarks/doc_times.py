"""The run times README.md and docs/ state, each with the run and machine behind it.

``python benchmarks/doc_times.py`` renders ``benchmarks/doc_times.json`` (one record per measured
run: the command, wall and CPU seconds, the machine and its load) into the "Documented run times"
section of ``benchmarks/RESULTS.md``, which every stated time links to (tests/test_docs_claims.py
checks the links). ``--run NAME -- COMMAND …`` times a command first (wall clock, the children's
user + system CPU, load average before and after) and adds or replaces the record NAME.

Records not measured by this script name where they were measured (``source``) and keep that
run's own description of the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from _results import update_section

HERE = Path(__file__).resolve().parent
RECORDS = HERE / "doc_times.json"


def _load() -> list[dict]:
    return json.loads(RECORDS.read_text()) if RECORDS.exists() else []


def measure(name: str, command: list[str], claim: str) -> dict:
    """Run ``command`` once; its wall clock, CPU (children) and the load around it."""
    load0 = os.getloadavg()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(command, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    load1 = os.getloadavg()
    return {
        "name": name,
        "claim": claim,
        "command": " ".join(command),
        "exit": proc.returncode,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "machine": f"{os.cpu_count()} CPU cores · {platform.machine()} · Python "
        f"{platform.python_version()}",
        "load": f"{load0[0]:.1f} before, {load1[0]:.1f} after (1-min load average)",
        "date": time.strftime("%Y-%m-%d"),
        "source": "benchmarks/doc_times.py --run",
    }


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "–"
    return f"{s:.0f} s ({s / 60:.1f} min)" if s >= 90 else f"{s:.0f} s"


def render(records: list[dict]) -> str:
    lines = [
        "## Documented run times",
        "",
        "Written by `python benchmarks/doc_times.py` from `benchmarks/doc_times.json`: every time",
        "README.md and docs/ state, the run behind it and the machine it ran on.",
        "",
        "| stated where | claim | command | wall | CPU | machine, load | measured by |",
        "| --- | --- | --- | ---: | ---: | --- | --- |",
    ]
    for r in records:
        lines.append(
            f"| {r['where']} | {r['claim']} | `{r['command']}` | {_fmt_s(r.get('wall_s'))} | "
            f"{_fmt_s(r.get('cpu_s'))} | {r['machine']}; {r.get('load', 'load not recorded')} | "
            f"{r['source']} ({r['date']}) |"
        )
    notes = [r["note"] for r in records if r.get("note")]
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", metavar="NAME", help="time a command and record it as NAME")
    ap.add_argument("--where", default="", help="the page that states the time")
    ap.add_argument("--claim", default="", help="the statement, as the page words it")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND … (with --run)")
    args = ap.parse_args(argv)
    records = _load()
    if args.run:
        cmd = [c for c in args.command if c != "--"]
        if not cmd:
            ap.error("--run needs -- COMMAND")
        rec = measure(args.run, cmd, args.claim)
        rec["where"] = args.where
        records = [r for r in records if r["name"] != args.run] + [rec]
        RECORDS.write_text(json.dumps(records, indent=2, ensure_ascii=False) + "\n")
    update_section("doc_times", render(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
