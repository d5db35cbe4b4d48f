"""Find the largest per-device batch of a preset that fits, on its own: what baselines/run.py --batch-size auto does,
e.g. once on a node before launching with torchrun or SLURM.

    python -m baselines.batch_finder --preset cifar10-vit-b32 --device cuda --precision bf16-mixed

The search and its trials belong to the core (hivetrain/batch_size.py), which peers/join.py --batch-size auto uses too.
"""

from __future__ import annotations

import argparse
import sys

from hivetrain.batch_size import MAX_BATCH, TOLERANCE, BatchSearchError, TrialSpec, find_batch_size, parse_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m baselines.batch_finder",
        description="Find the largest per-device batch of a preset that fits (what baselines/run.py --batch-size auto"
                    " does), e.g. once on a node before launching with torchrun or SLURM.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--preset", required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", choices=("32", "bf16-mixed", "16-mixed"), default="32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of each trial")
    parser.add_argument("--data-dir", default=None, help="where datasets are stored (default: ~/.cache/hivetrain/data)")
    parser.add_argument("--no-dataset", action="store_true",
                        help="the run trains on generated data: do not load the preset's dataset (by default a trial"
                             " holds it in memory, as the run does)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per trial")
    parser.add_argument("--memory-budget", default=None,
                        help="peak memory a batch may use: RSS on a CPU (required there), allocated memory on a GPU")
    parser.add_argument("--start", type=int, default=32, help="first batch size tried")
    parser.add_argument("--cap", type=int, default=MAX_BATCH, help="never answer more than this")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE,
                        help="stop when the gap between fitting and failing sizes is this fraction of the answer")
    args = parser.parse_args(argv)
    from hivetrain.config import get_preset

    try:
        budget = parse_bytes(args.memory_budget) if args.memory_budget else None
        spec = TrialSpec(get_preset(args.preset), args.device, args.precision, args.threads, args.data_dir,
                         args.steps, load_dataset=not args.no_dataset)
        result = find_batch_size(spec, budget, start=args.start, cap=args.cap, tolerance=args.tolerance)
    except (ValueError, BatchSearchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"largest batch that fits: {result.batch_size}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
