"""The dashboard in a real browser: Debian's chromium, headless, driven by Playwright (the `dev` extra), for the
browser test and scripts/screenshot.py. Playwright downloads no browser of its own."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

CHROMIUM = "/usr/bin/chromium"  # installed by scripts/install-system-test-deps.sh


@contextmanager
def dashboard_page(url: str, width: int = 1400, height: int = 1800) -> Iterator:
    """A page open at `url`, as tall as the dashboard so that a full-page screenshot shows it whole."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                             args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.goto(url)
            yield page
        finally:
            browser.close()
