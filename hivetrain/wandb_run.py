"""Weights & Biases beside TensorBoard, for teams that watch their training there: the --wandb-* flags, one W&B run per
coordinator or baseline, and `WandbScalars`, which takes TensorBoard's `add_scalar` calls so that the coordinator's
monitor writes to both the same way.

W&B is optional (the `wandb` extra) and never worth a run: a missing package is one warning line and no W&B; a missing
login or an unreachable server is one warning line and an offline run under the log folder, which `wandb sync`
uploads later. `WANDB_MODE=offline` logs offline from the start.
"""

from __future__ import annotations

import argparse
import logging
import threading
from pathlib import Path
from typing import Callable, Optional

from hivetrain import install_hint

logger = logging.getLogger(__name__)


def add_wandb_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        f"Weights & Biases (optional: {install_hint('wandb')}; WANDB_MODE=offline keeps the run on disk)")
    group.add_argument("--wandb-project", default=None, metavar="NAME",
                       help="also log to this W&B project (files under <log folder>/wandb)")
    group.add_argument("--wandb-entity", default=None, metavar="NAME", help="W&B team or user (default: your login's)")
    group.add_argument("--wandb-run-name", default=None, metavar="NAME", help="W&B run name (default: the run's name)")
    group.add_argument("--wandb-tags", nargs="+", default=None, metavar="TAG", help="W&B run tags")


def open_wandb_run(args: argparse.Namespace, log_dir: Path, name: str, config: dict, step_metric: str,
                   report: Callable[[str], None] = print):
    """The W&B run --wandb-project asks for (None without it, or when wandb is missing), its files in
    `log_dir`/wandb. Every metric is plotted against `step_metric`, which the caller logs with each of them."""
    if not args.wandb_project:
        return None
    try:
        import wandb
    except ImportError:
        logger.warning(f"W&B logging is off: the wandb package is missing ({install_hint('wandb')})")
        return None
    log_dir.mkdir(parents=True, exist_ok=True)
    logging.getLogger("wandb").propagate = False  # its own log is the run folder's debug.log, not the role's console
    # silent: wandb's banner and exit summary would bury the run's own lines; the line below says where it went
    init = dict(project=args.wandb_project, entity=args.wandb_entity, name=args.wandb_run_name or name,
                tags=args.wandb_tags, config=config, dir=str(log_dir), settings=wandb.Settings(silent=True))
    try:
        run = wandb.init(**init)
    except Exception as e:  # no login, a server that does not answer (after WANDB_INIT_TIMEOUT), a refused project
        problem = str(e).splitlines()[0] if str(e) else type(e).__name__
        try:
            run = wandb.init(**init, mode="offline")
        except Exception as offline_error:
            logger.warning(f"W&B logging is off: {problem}; offline: {offline_error}")
            return None
        logger.warning(f"W&B could not start online ({problem}): logging offline to {run.sync_dir}"
                       f" (`wandb sync` uploads it later)")
    else:
        report(f"W&B: offline run in {run.sync_dir} (`wandb sync` uploads it)" if run.offline
               else f"W&B: {run.url}")
    run.define_metric(step_metric)
    run.define_metric("*", step_metric=step_metric, step_sync=True)
    return run


class WandbScalars:
    """A W&B run behind the part of TensorBoard's SummaryWriter that the coordinator uses. A scalar's step (the swarm
    epoch) goes in as `step_metric`, not as W&B's own step: the validator logs an epoch behind the monitor's, and W&B
    drops any row whose step goes back."""

    def __init__(self, run, step_metric: str):
        self.run, self.step_metric = run, step_metric
        self._lock = threading.Lock()  # the monitor's loop and the validator's thread log at once; a row is one call

    def add_scalar(self, tag: str, value: float, step: int, walltime: Optional[float] = None) -> None:
        with self._lock:  # W&B stamps its own time: walltime is when it was logged anyway
            self.run.log({tag: value, self.step_metric: step})

    def add_text(self, tag: str, text: str, step: int) -> None:
        self.run.summary[tag] = text  # a string (the best checkpoint's URI) belongs in the run's summary

    def close(self) -> None:
        self.run.finish()
