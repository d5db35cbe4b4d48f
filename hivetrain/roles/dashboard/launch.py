"""Start the dashboard: `hivetrain-dashboard --store runs/demo/metrics.sqlite` (or `make dashboard STORE=...` in a
clone). The short form of

    streamlit run hivetrain/roles/dashboard/app.py --server.address 127.0.0.1 --browser.gatherUsageStats false \
        -- --store PATH

with the settings that keep Streamlit on this machine and quiet: no usage statistics, no browser opened, loopback
unless --host says otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

APP = Path(__file__).resolve().parent / "app.py"


def streamlit_command(store: str, host: str, port: int, results: str | None = None, refresh: int | None = None,
                      python: str = sys.executable) -> list[str]:
    command = [python, "-m", "streamlit", "run", str(APP), "--server.address", host, "--server.port", str(port),
               "--server.headless", "true", "--browser.gatherUsageStats", "false",
               "--client.toolbarMode", "viewer",  # no "Deploy" button: this is a monitor, not a development server
               "--", "--store", str(store)]
    if results is not None:
        command += ["--results", str(results)]
    if refresh is not None:
        command += ["--refresh", str(refresh)]
    return command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hivetrain-dashboard",
                                     description="Show a run's metrics store in the browser.")
    parser.add_argument("--store", default="runs/demo/metrics.sqlite",
                        help="the coordinator's metrics store (default: %(default)s, the one make demo writes;"
                             " it may not exist yet)")
    parser.add_argument("--results", default=None, help="baseline run results to compare with (default: logbook/results)")
    parser.add_argument("--refresh", type=int, default=None, help="seconds between refreshes (default: 5; 0: off)")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default: %(default)s: this machine only)")
    parser.add_argument("--port", type=int, default=8501, help="port to serve on (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from hivetrain import require_extra

    require_extra("dashboard", "streamlit", "pandas", "altair")
    print(f"Dashboard: http://{args.host}:{args.port} (Ctrl-C stops it)", flush=True)
    command = streamlit_command(args.store, args.host, args.port, args.results, args.refresh)
    # Become Streamlit (no child process): Ctrl-C and SIGTERM reach it directly and nothing is left behind.
    os.execv(command[0], command)


if __name__ == "__main__":
    sys.exit(main())
