"""How a benchmark section reports: where the suites' results are kept, the line naming the command that measured
a section, and each target's verdict."""

from pathlib import Path

from benchmarks.harness import ROOT

# not run results: logbook/results holds only those, which the logbook reads
RESULTS = ROOT / "logbook" / "bench-results"


def newest_result(suite: str) -> Path:
    """The newest result of `suite` in RESULTS (their names sort by the time they were written)."""
    results = sorted(RESULTS.glob(f"bench-{suite}-*.json"))
    if not results:
        raise SystemExit(f"no result of {suite} in {RESULTS}: run python -m benchmarks.bench {suite} first")
    return results[-1]


def verdict(met: bool, what: str) -> str:
    return f"{'**Met**' if met else '**Not met**'} ({what})."


def measured_by(env: dict) -> str:
    """The line every section opens with: `env` as render() gives it, with the command that measured the suite."""
    return (f"`{env['command']}` on {env['date']}, commit {env['commit']} ({env['machine']}; Python {env['python']},"
            f" torch {env['torch']}, hivemind {env['hivemind']}).")
