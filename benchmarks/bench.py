"""Benchmarks whose numbers land in the logbook: python -m benchmarks.bench SUITE [--smoke | --page].

Each suite starts real roles (coordinator/start.py, peers/join.py) as processes on loopback (benchmarks.harness) and
measures them from what they write for programs: their events, the coordinator's metrics store and run results, never
their console lines. It keeps a bench result, logbook/bench-results/bench-SUITE-<time>.json (the suite, the command,
the machine, versions, commit and date, and what it measured), and writes its section of logbook/benchmarks.md, or
its page, from it. --page measures nothing: it writes the section or page again from the suite's newest result.

Suites here: join (time from `peers/join.py` start to the swarm's state loaded, and to its first local step);
throughput (samples/s of single, DDP and a swarm on equal hardware, and the swarm's time outside compute); links (DDP
and both swarm modes between two network namespaces over a veth shaped to 1 Gbit/s, 100 and 20 Mbit/s);
communication (loopback bytes per sample and accuracy with no compression, fp16 and 8-bit); convergence (validation
top-1 against samples seen for single, DDP and the swarm); churn (peers leaving and joining); monitor (the
coordinator's look); relay (what leading the rounds of peers behind NAT costs the coordinator); attacks (one
malicious peer in four under each defence, in logbook/reliability.md); scale (what each peer costs as the swarm
grows, and joiner storms, extrapolated: benchmarks.scale, the whole of logbook/scale.md).

A suite is a function (work folder, smoke) -> JSON-able result and a function (result, environment, page folder) ->
its Markdown, in a module of its own (benchmarks.join, .throughput, .links, .communication, .convergence, .churn,
.monitor, .relay, .attacks, .scale with .scale_fit and .scale_page) on top of benchmarks.harness and
benchmarks.report, registered in SUITES: a section ("## SUITE") of its page, or a whole page ("# ..."). The
environment it gets also names the command that measured it and the result's path.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from benchmarks.churn import churn_section, churn_suite
from benchmarks.communication import communication_section, communication_suite
from benchmarks.convergence import convergence_section, convergence_suite
from benchmarks.attacks import attacks_section, attacks_suite
from benchmarks.harness import ROOT, git_commit
from benchmarks import report
from benchmarks.report import RESULTS, newest_result  # noqa: F401 (the tests read results through bench)
from benchmarks.join import join_section, join_suite
from benchmarks.links import links_section, links_suite
from benchmarks.monitor import monitor_section, monitor_suite
from benchmarks.relay import relay_section, relay_suite
from benchmarks.scale import scale_suite
from benchmarks.scale_page import scale_page
from benchmarks.throughput import throughput_section, throughput_suite

PAGE = ROOT / "logbook" / "benchmarks.md"


def environment() -> dict:
    """Where a measurement ran: date, commit, machine and versions (each page's or section's opening line)."""
    import hivemind
    import torch

    return dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=git_commit(short=True),
                machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                python=platform.python_version(), torch=torch.__version__, hivemind=hivemind.__version__)


SUITES = {
    "join": (join_suite, join_section),
    "throughput": (throughput_suite, throughput_section),
    "links": (links_suite, links_section),
    "communication": (communication_suite, communication_section),
    "convergence": (convergence_suite, convergence_section),
    "churn": (churn_suite, churn_section),
    "monitor": (monitor_suite, monitor_section),
    "relay": (relay_suite, relay_section),
    "attacks": (attacks_suite, attacks_section),
    "scale": (scale_suite, scale_page),
}
# the suites whose Markdown lands elsewhere than logbook/benchmarks.md: attacks beside the faults (tests/test_faults.py
# writes the rest of that page), scale a whole page of its own
PAGES = {"attacks": "reliability.md", "scale": "scale.md"}
# the suites whose pages also read another suite's newest result, by that suite: the scale page's relay section
READ_BY = {"relay": ("scale",)}


def page_of(suite: str) -> Path:
    """The logbook page a suite's Markdown lands in: PAGES, or logbook/benchmarks.md."""
    return PAGE.parent / PAGES.get(suite, PAGE.name)


def write_section(name: str, section: str, page: Optional[Path] = None) -> None:
    """Write suite `name`'s Markdown into its page (or into `page`: the tests that write a section of the reliability
    page). A whole page (from a level-1 heading, "# ") replaces the page. A section ("## name") replaces that suite's
    section of the page (each section says which commit measured it); what comes before the first section and the
    other sections stay as they are."""
    page = page or page_of(name)
    if section.startswith("# "):
        page.write_text(section)
        return
    header = ("# Benchmarks\n\nEach section is written by `python -m benchmarks.bench SUITE` and says which commit,"
              " machine and versions measured it.\n\n")
    sections = {}
    if page.exists():
        header, *parts = re.split(r"(?m)^(?=## )", page.read_text())
        header = header.rstrip("\n") + "\n\n"
        for part in parts:
            sections[part.split("\n", 1)[0][3:].strip()] = part.rstrip("\n") + "\n\n"
    sections[name] = section.rstrip("\n") + "\n\n"
    page.write_text(header + "".join(sections[key] for key in sorted(sections)).rstrip("\n") + "\n")


def render(suite: str, bench_result: dict, path: Path, out: Path) -> str:
    """Suite `suite`'s section or page from its bench result, kept at `path`; its plots are written into `out`. The
    renderer gets the result's environment with the command that measured it (results older than that field: the
    plain command) and the result's path (`result_file`)."""
    env = dict(bench_result["environment"], command=bench_result.get("command", f"python -m benchmarks.bench {suite}"),
               result_file=_shown(path))
    return SUITES[suite][1](bench_result["result"], env, out)


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", choices=sorted(SUITES))
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--smoke", action="store_true",
                      help="the smallest run (for the tests): prints its result and Markdown, writes nothing")
    what.add_argument("--page", action="store_true",
                      help="measure nothing: the suite's section or page again from its newest result")
    args = parser.parse_args(argv)
    page = page_of(args.suite)
    if args.page:
        path = newest_result(args.suite)
        write_section(args.suite, render(args.suite, json.loads(path.read_text()), path, page.parent))
        print(f"Wrote {_shown(page)} ({args.suite}) from {_shown(path)}")
        return 0
    command = f"python -m benchmarks.bench {args.suite}" + (" --smoke" if args.smoke else "")
    env = environment()
    work = Path(tempfile.mkdtemp(prefix=f"bench-{args.suite}-"))
    # on a failure the roles' logs stay in `work`: the error names them
    result = SUITES[args.suite][0](work, smoke=args.smoke)
    bench_result = dict(suite=args.suite, command=command, environment=env, result=result)
    print(json.dumps(bench_result, indent=1))
    if args.smoke:  # the result, the page and its plots go to the scratch folder, printed, then thrown away
        path = work / f"bench-{args.suite}-smoke.json"
        path.write_text(json.dumps(bench_result, indent=1) + "\n")
        print(render(args.suite, bench_result, path, work))
        shutil.rmtree(work)
        return 0
    shutil.rmtree(work)
    report.RESULTS.mkdir(parents=True, exist_ok=True)
    path = report.RESULTS / f"bench-{args.suite}-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}.json"
    path.write_text(json.dumps(bench_result, indent=1) + "\n")
    write_section(args.suite, render(args.suite, bench_result, path, page.parent))
    print(f"Wrote {_shown(page)} ({args.suite}) and {_shown(path)}")
    for reader in READ_BY.get(args.suite, ()):  # a page that quotes this result, written again from its own
        main([reader, "--page"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
