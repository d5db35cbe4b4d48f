"""The dashboard end to end in a real browser: a coordinator, two peers and the dashboard on 127.0.0.1, Debian's
chromium driven by Playwright, until the page shows both peers and a validation point. (The README's picture comes
from scripts/screenshot.py, the same way over `make demo`'s swarm.)"""

import os
import re
import time
import urllib.request

from conftest import start_coordinator
from s3server import free_ports

from hivetrain.roles.dashboard.browser import CHROMIUM, dashboard_page


def _wait_healthy(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                if response.read() == b"ok":
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"the dashboard at {url} did not become healthy in {timeout} s")
        time.sleep(0.5)


def _metric(page, label: str) -> str:
    """The value a st.metric shows under `label`, as the browser renders it."""
    return page.evaluate("""label => {
        for (const metric of document.querySelectorAll('[data-testid="stMetric"]')) {
            const name = metric.querySelector('[data-testid="stMetricLabel"]');
            if (name && name.innerText.trim() === label)
                return metric.querySelector('[data-testid="stMetricValue"]').innerText.trim();
        }
        return null;
    }""", label)


def test_dashboard_shows_the_live_swarm_in_a_browser(spawn, tmp_path):
    assert os.access(CHROMIUM, os.X_OK), "chromium is missing: run scripts/install-system-test-deps.sh as root"
    _, addresses = start_coordinator(spawn, tmp_path, "--preset", "demo")
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    spawn("dashboard", "-m", "hivetrain.roles.dashboard.launch",
          "--store", str(tmp_path / "coordinator" / "metrics.sqlite"),
          "--port", str(port), "--refresh", "2", "--results", str(tmp_path / "no-results"))
    for name in ("alice", "bob"):
        spawn(name, "peers/join.py", "--host", "127.0.0.1", "--initial-peers", *addresses, "--name", name,
              "--threads", "1", "--min-peers", "2", "--stop-at-epoch", "40")
    _wait_healthy(url, timeout=60)
    with dashboard_page(url) as page:
        deadline = time.monotonic() + 240
        # "–" until the coordinator has validated once, then a percentage
        while not (_metric(page, "Alive peers") == "2" and (_metric(page, "Best top-1") or "").endswith("%")):
            assert time.monotonic() < deadline, page.inner_text("body")[-2000:]
            page.wait_for_timeout(1000)  # the page refreshes itself every 2 s
        # Both peers, by name, and the validation curve are on the page.
        page.wait_for_selector('[data-testid="stVegaLiteChart"]')
        assert re.search(r"Best top-1 \d+\.\d+% at swarm epoch \d+", page.inner_text("body"))
        shot = tmp_path / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
