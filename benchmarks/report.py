"""How a benchmark section reports: where the suites' records are kept, the line naming the command that measured
a section, and each target's verdict."""

from pathlib import Path

from benchmarks.harness import ROOT

# not run records: logbook/records holds only those, which the logbook reads
RECORDS = ROOT / "logbook" / "bench-records"


def newest_record(suite: str) -> Path:
    """The newest record of `suite` in RECORDS (their names sort by the time they were written)."""
    records = sorted(RECORDS.glob(f"bench-{suite}-*.json"))
    if not records:
        raise SystemExit(f"no record of {suite} in {RECORDS}: run python -m benchmarks.bench {suite} first")
    return records[-1]


def verdict(met: bool, what: str) -> str:
    return f"{'**Met**' if met else '**Not met**'} ({what})."


def measured_by(env: dict) -> str:
    """The line every section opens with: `env` as render() gives it, with the command that measured the suite."""
    return (f"`{env['command']}` on {env['date']}, commit {env['commit']} ({env['machine']}; Python {env['python']},"
            f" torch {env['torch']}, hivemind {env['hivemind']}).")
