"""The GPU proof's ceilings: what the card does with no data loading and no swarm, measured in the proof's own run.

    python -m benchmarks.gpu_ceiling --batch-size 1024 --precision bf16-mixed
    python -m benchmarks.gpu_ceiling --device cpu --batch-size 2 --img-size 32 --matmul-size 256 --seconds 1  # tests

1. the card's bf16 matrix rate: an N x N x N bf16 matrix product on random data (never zeros, which run faster),
   timed with CUDA events after a warm-up, the median of several repeats; the MFU denominator;
2. the pure-compute training ceiling: the mission's training step (ViT-B/32 of the cifar10-vit-b32 preset, AdamW as
   the module makes it, autocast, cross-entropy) on one batch of random images already on the device, so the figure
   holds no loader, no host-to-device copy and no swarm; samples/s over whole steps after a warm-up;
3. MFU: the ceiling's model FLOPs per second (3 x 2 x the model's forward multiply-accumulates per image, counted by
   torch.utils.flop_counter on one image) over the measured matrix rate.

The last line printed is the result as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Optional

PRESET = "cifar10-vit-b32"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_ceiling",
                                     description=__doc__.split("\n\n")[0].replace("\n", " "),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--batch-size", type=int, required=True, help="samples per training step")
    parser.add_argument("--precision", choices=("32", "bf16-mixed", "16-mixed"), default="bf16-mixed")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--img-size", type=int, default=None, help="image size (default: the preset's, 224)")
    parser.add_argument("--matmul-size", type=int, default=8192, help="N of the N x N x N bf16 matrix product")
    parser.add_argument("--warmup-steps", type=int, default=5, help="untimed training steps first")
    parser.add_argument("--seconds", type=float, default=8.0, help="length of the timed training window")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model first")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.matmul_size < 1 or args.seconds <= 0 or args.warmup_steps < 0:
        parser.error("--batch-size and --matmul-size must be at least 1, --seconds more than 0")
    return args


def matmul_rate(device, size: int, repeats: int = 10) -> float:
    """FLOP/s of a bf16 size^3 matrix product on random data: the median of `repeats` timed products."""
    import torch

    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        times.append(_timed(device, lambda: a @ b))
    return 2 * size ** 3 / statistics.median(times)


def _timed(device, work) -> float:
    """Seconds one call of `work` takes on `device` (CUDA events on a GPU, the host clock on a CPU)."""
    import torch

    if device.type != "cuda":
        started = time.perf_counter()
        work()
        return time.perf_counter() - started
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000


def forward_macs_per_image(model, img_size: int) -> int:
    """Multiply-accumulates of one image's forward pass, as torch's FLOP counter counts them (FLOPs / 2)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    parameter = next(model.parameters())
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.zeros(1, 3, img_size, img_size, device=parameter.device))
    return counter.get_total_flops() // 2


def measure(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    from hivetrain.config import get_preset
    from hivetrain.model import autocast_dtype, create_model
    from hivetrain.optimizer import make_optimizer

    device = torch.device(args.device)
    config = get_preset(PRESET)
    # random weights: the step costs the same, and nothing is fetched from the hub
    model_config = dataclasses.replace(config.model, pretrained=False, img_size=args.img_size or config.model.img_size)
    model = create_model(model_config, seed=config.seed).to(device)
    macs = forward_macs_per_image(model, model_config.img_size)
    optimizer, _ = make_optimizer(model, config.optim)
    step_model = torch.compile(model) if args.compile else model
    dtype = autocast_dtype(args.precision)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "16-mixed")
    generator = torch.Generator(device=device).manual_seed(0)
    images = torch.randn(args.batch_size, 3, model_config.img_size, model_config.img_size, device=device,
                         generator=generator)
    labels = torch.randint(0, model_config.num_classes, (args.batch_size,), device=device, generator=generator)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(step_model(images), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(args.warmup_steps):
        step()
    synchronize()
    steps, started = 0, time.perf_counter()
    while steps == 0 or time.perf_counter() - started < args.seconds:
        step()
        steps += 1
        if steps % 4 == 0:
            synchronize()
    synchronize()
    seconds = time.perf_counter() - started
    samples_per_s = steps * args.batch_size / seconds
    rate = matmul_rate(device, args.matmul_size)
    flops_per_sample = 3 * 2 * macs  # forward, and backward at twice the forward
    return dict(batch_size=args.batch_size, precision=args.precision, img_size=model_config.img_size,
                compile=args.compile, steps=steps, seconds=round(seconds, 3), samples_per_s=round(samples_per_s, 1),
                forward_macs_per_image=macs, train_flops_per_image=flops_per_sample,
                matmul_size=args.matmul_size, bf16_matmul_flops=rate,
                mfu=round(samples_per_s * flops_per_sample / rate, 4),
                peak_memory_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    print(json.dumps(measure(args)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
