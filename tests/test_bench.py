"""The benchmark suites run (a smoke-sized run of each) and write their section of the logbook page."""

import subprocess
import sys

from conftest import ROOT
from hivetrain import bench


def test_join_suite_smoke():
    done = subprocess.run([sys.executable, "-m", "hivetrain.bench", "join", "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "joiner 0: state loaded after" in done.stdout
    assert '"median_first_step_s"' in done.stdout


def test_a_suite_rewrites_only_its_own_section(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "PAGE", tmp_path / "benchmarks.md")
    bench.write_section("join", "## join\n\nfirst\n")
    bench.write_section("scale", "## scale\n\nS\n")
    bench.write_section("join", "## join\n\nsecond\n")
    page = (tmp_path / "benchmarks.md").read_text()
    assert page.startswith("# Benchmarks") and "second" in page and "first" not in page and "S\n" in page
    assert page.index("## join") < page.index("## scale")
