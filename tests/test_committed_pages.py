"""Every figure on a committed logbook page is the one its result gives: each page (or section) is rendered again from
the results it cites, with today's renderers, and must come out as committed. A figure retyped by hand, a result
replaced without its page, or a renderer changed without `--page` to write the page again fails here, naming the
command that rewrites it."""

from __future__ import annotations

import difflib
import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks import bench, logbook
from benchmarks.gpu_page import render_gpu_page

ROOT = Path(__file__).resolve().parent.parent
LOGBOOK = ROOT / "logbook"


def _sections(page: str) -> dict[str, str]:
    """A page's `## ` sections by title, as bench.write_section keeps them."""
    return {part.split("\n", 1)[0][3:].strip(): part.rstrip("\n") + "\n"
            for part in re.split(r"(?m)^(?=## )", page)[1:]}


def _differences(committed: str, rendered: str) -> str:
    return "\n".join(list(difflib.unified_diff(committed.splitlines(), rendered.splitlines(), "committed",
                                               "rendered", lineterm=""))[:30])


SUITES_WITH_RESULTS = sorted(suite for suite in bench.SUITES if any(bench.RESULTS.glob(f"bench-{suite}-*.json")))


def test_every_benchmark_suite_has_a_result_and_a_page():
    assert set(SUITES_WITH_RESULTS) == set(bench.SUITES), set(bench.SUITES) - set(SUITES_WITH_RESULTS)


@pytest.mark.parametrize("suite", SUITES_WITH_RESULTS)
def test_a_suites_section_is_what_its_newest_result_renders(suite, tmp_path):
    path = bench.newest_result(suite)
    rendered = bench.render(suite, json.loads(path.read_text()), path, tmp_path)  # plots go to the scratch folder
    page = bench.page_of(suite).read_text()
    committed = page if suite == "scale" else _sections(page).get(suite, "")  # scale's result is a whole page
    assert committed.rstrip("\n") == rendered.rstrip("\n"), (
        f"{bench.page_of(suite).relative_to(ROOT)} ({suite}) is not what {path.name} renders: run"
        f" python -m benchmarks.bench {suite} --page\n{_differences(committed, rendered)}")


def test_the_baselines_page_is_what_the_run_results_render(tmp_path):
    out = tmp_path / "logbook"  # the committed layout, so that the page's links come out the same
    shutil.copytree(LOGBOOK / "results", out / "results")
    command = "python -m benchmarks.logbook build --results logbook/results --out logbook"
    pages = logbook.build([out / "results"], out, None, command)
    assert pages
    for page in pages:
        committed = (LOGBOOK / page.name).read_text()
        assert committed == page.read_text(), f"logbook/{page.name}: run {command}\n" + _differences(
            committed, page.read_text())


def test_the_gpu_page_is_what_its_result_renders(tmp_path, monkeypatch):
    results = sorted((LOGBOOK / "gpu-results").glob("gpu-proof-*.json"))
    committed = (LOGBOOK / "gpu.md").read_text()
    cited = [path for path in results if f"({path.name})" in committed or f"/{path.name})" in committed]
    assert len(cited) == 1, [path.name for path in results]
    shutil.copytree(LOGBOOK / "gpu-results", tmp_path / "logbook" / "gpu-results")
    monkeypatch.chdir(tmp_path)  # the page names its result and folder as the command that wrote it did
    page = render_gpu_page(json.loads(cited[0].read_text()), Path("logbook"), Path("logbook/gpu-results"))
    assert committed == page.read_text(), (f"logbook/gpu.md: run python -m benchmarks.gpu_page"
                                           f" logbook/gpu-results/{cited[0].name} --out logbook\n"
                                           + _differences(committed, page.read_text()))
