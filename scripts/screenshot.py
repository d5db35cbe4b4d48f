"""The README's dashboard picture, from a real run: `make demo`'s swarm (scripts/demo.py: a coordinator, two peers and
the dashboard on 127.0.0.1), photographed mid-run in Debian's chromium driven by Playwright once both peers have
contributed samples, their loss has fallen and the coordinator has validated the shared model a few times.

    python scripts/screenshot.py [--out logbook/demo-dashboard.png] [--validations 3] [--epochs 24]

Everything else it writes (the demo's logs, metrics store, checkpoints) goes under --workdir (runs/screenshot).
Needs `make install-dev` (Playwright) and chromium (scripts/install-system-test-deps.sh, as root).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def swarm_has_progressed(store: Path, validations: int) -> bool:
    """Both peers have contributed, the swarm's mean loss is below its first value, and `validations` points of the
    validation curve exist with top-1 above the first one."""
    from hivetrain.metrics_store import MetricsReader, StoreError

    try:
        with MetricsReader(store) as reader:
            peers, snapshots, points = reader.peers(), reader.snapshots(), reader.validations()
    except StoreError:  # not written yet
        return False
    losses = [s.mean_loss for s in snapshots if s.mean_loss is not None]
    return (len(peers) >= 2 and all(p.samples > 0 for p in peers) and len(losses) >= 2 and losses[-1] < losses[0]
            and len(points) >= validations and points[-1].top1 > points[0].top1)


def _dashboard_url(lines: list[str]) -> str | None:
    """Where the demo says its dashboard serves."""
    return next((m.group(1) for line in lines if (m := re.match(r"Dashboard: (http://\S+)", line))), None)


def _echo(demo: subprocess.Popen, lines: list[str]) -> None:
    for line in demo.stdout:
        lines.append(line)
        print(line, end="", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/screenshot.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "logbook" / "demo-dashboard.png",
                        help="the PNG to write (default: the README's picture, %(default)s)")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "screenshot",
                        help="the demo's logs, metrics store and checkpoints (default: %(default)s)")
    parser.add_argument("--validations", type=int, default=3,
                        help="validation points to wait for before the picture (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=24,
                        help="outer rounds the demo trains (default: %(default)s, three times make demo's 8, the"
                             " learning rate at its floor after the 8th): the peers are still training when the"
                             " picture is taken")
    parser.add_argument("--timeout", type=float, default=900, help="seconds to wait for all that (default: %(default)s)")
    args = parser.parse_args(argv)
    from hivetrain.roles.dashboard.browser import CHROMIUM, dashboard_page

    if not os.access(CHROMIUM, os.X_OK):
        parser.error(f"{CHROMIUM} is missing: run scripts/install-system-test-deps.sh as root")

    args.workdir.mkdir(parents=True, exist_ok=True)
    # The demo as `make demo` runs it, dashboard included (on a free port when 8501 is taken: it prints where). The
    # dashboard shows the store's path as given: relative to the repository when it lies inside.
    workdir = args.workdir.resolve()
    shown = workdir.relative_to(ROOT) if workdir.is_relative_to(ROOT) else workdir
    demo = subprocess.Popen([sys.executable, "scripts/demo.py", "--workdir", str(shown), "--epochs", str(args.epochs)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: list[str] = []
    threading.Thread(target=_echo, args=(demo, lines), daemon=True).start()
    try:
        deadline = time.monotonic() + args.timeout
        while not ((url := _dashboard_url(lines))
                   and swarm_has_progressed(workdir / "metrics.sqlite", args.validations)):
            if demo.poll() is not None or time.monotonic() > deadline:
                print(f"error: the demo {'ended' if demo.poll() is not None else 'ran past --timeout'} before the"
                      f" swarm had progressed enough; see {args.workdir}/", file=sys.stderr)
                return 1
            time.sleep(1)
        with dashboard_page(url) as page:
            page.wait_for_selector('[data-testid="stVegaLiteChart"]', timeout=60_000)
            page.wait_for_function("document.body.innerText.match(/Best top-1 \\d+\\.\\d+% at swarm epoch/)",
                                   timeout=60_000)
            page.wait_for_timeout(3000)  # the charts finish drawing
            args.out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.out), full_page=True)
        print(f"Screenshot: {args.out}", flush=True)
        return 0
    finally:
        if demo.poll() is None:  # the demo stops its coordinator, peers and dashboard on Ctrl-C
            demo.send_signal(signal.SIGINT)
            try:
                demo.wait(90)
            except subprocess.TimeoutExpired:
                demo.kill()


if __name__ == "__main__":
    sys.exit(main())
