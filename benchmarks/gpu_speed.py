"""One speed measurement of the GPU proof: ViT-B/32 (timm's vit_base_patch32_224, random init, 10 classes) at 224 px
trained on synthetic CIFAR-10-shaped data at one batch and precision, on one device or with DDP on several GPUs of
this machine.

    python -m benchmarks.gpu_speed --precision bf16-mixed --batch-size 1024            # one GPU
    python -m benchmarks.gpu_speed --precision bf16-mixed --batch-size 1024 --devices 2
    python -m benchmarks.gpu_speed --precision bf16-mixed --batch-size 1024 --compile   # torch.compile the model

The training step is the batch finder's trial step (the preset's model and AdamW, autocast, cross-entropy), so the
batch the finder found is the batch measured here; 16-mixed adds a gradient scaler, as a real fp16 run needs. After
--warmup-steps, training is timed for at least --seconds (whole steps, the GPU synchronised at both ends); then one
pass over the validation split is timed. The last line printed is the result as JSON: samples/s of training and of
validation, steps, peak GPU memory of each rank (torch.cuda.max_memory_allocated since the process started, so the
model and optimizer state count, as in the batch finder), and the timed window's wall-clock start and end
(time.time()). Exit status 3 means CUDA ran out of memory at this batch; 4 that a single-device run failed otherwise
(a torch.compile that cannot compile, say), its last line JSON with the error in one line.

--ready-dir and --ready-count time several processes' windows together (the GPU proof's two plain processes sharing
one GPU): each, after its warm-up, marks itself ready in that folder and waits for the others, and all start timing at
the same wall-clock moment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Iterator, Optional

OOM_EXIT = 3  # as hivetrain.batch_size: this batch does not fit
FAILED_EXIT = 4  # a single-device run failed otherwise: its last line is JSON with the error in one line
READY_POLL_S = 0.05  # how often a process waiting for the others looks at --ready-dir
# Once every process is ready, the common start is the last one's ready time plus this: time enough for the others,
# which look every READY_POLL_S, to see that it is ready and be asleep until then.
START_MARGIN_S = 0.5
PRESET = "cifar10-vit-b32"  # the mission's model config (ViT-B/32, 224 px, 10 classes) and optimizer
PRECISIONS = ("32", "bf16-mixed", "16-mixed")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_speed",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="Run by python -m benchmarks.gpu_proof for each precision; on its own it measures one configuration."
               " --device cpu runs the same code on CPUs (gloo for DDP), as the tests do.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--precision", choices=PRECISIONS, required=True)
    parser.add_argument("--batch-size", type=int, required=True, help="samples per device per step")
    parser.add_argument("--devices", type=int, default=1, help="processes, one per GPU; 2 or more: DDP")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--train-samples", type=int, default=50_000, help="size of the synthetic training split")
    parser.add_argument("--val-samples", type=int, default=10_000,
                        help="size of the synthetic validation split (0: no validation pass)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic images and of the data order")
    parser.add_argument("--warmup-steps", type=int, default=5, help="untimed steps first (CUDA and cuBLAS warm-up)")
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="train at least this long after warm-up (and at least 2 steps)")
    parser.add_argument("--num-workers", type=int, default=None,
                        help="DataLoader workers per process (default: up to 8 on GPUs, sharing the CPUs; 0 on CPUs)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads per process")
    parser.add_argument("--dump-dir", default=None,
                        help="write the raw nvidia-smi views here right after the timed window (rank 0)")
    parser.add_argument("--dump-label", default="speed", help="file name prefix of those views")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model of the training step (--devices 1); compilation happens in the"
                             " first warm-up step, untimed, and validation runs the eager model")
    parser.add_argument("--ready-dir", default=None,
                        help="a folder shared with the other processes of --ready-count (--devices 1): after warm-up,"
                             " wait there until all are ready, then start the timed window together")
    parser.add_argument("--ready-count", type=int, default=1, help="how many processes time their window together")
    parser.add_argument("--ready-timeout", type=float, default=300.0,
                        help="after this many seconds of waiting for the others, start timing alone (and say so)")
    args = parser.parse_args(argv)
    for name in ("batch_size", "devices", "train_samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.val_samples < 0 or args.warmup_steps < 0 or args.seconds < 0 or args.seed < 0:
        parser.error("--val-samples, --warmup-steps, --seconds and --seed must be 0 or more")
    if args.devices > 1 and (args.compile or args.ready_dir):
        parser.error("--compile and --ready-dir are for --devices 1")
    if args.ready_count < 1 or (args.ready_count > 1 and not args.ready_dir):
        parser.error("--ready-count must be at least 1, and more than 1 only with --ready-dir")
    if args.train_samples < args.batch_size * args.devices:
        parser.error(f"--train-samples {args.train_samples} holds no full batch of {args.batch_size} for each of"
                     f" {args.devices} device(s)")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and torch.cuda.device_count() < args.devices:
        print(f"error: --devices {args.devices}: this machine has {torch.cuda.device_count()} CUDA GPU(s)",
              file=sys.stderr)
        return 2
    if args.devices == 1:
        try:
            result = measure(0, 1, args)
        except Exception as e:  # the traceback goes to the log; the proof reads the one line after it
            traceback.print_exc()
            print(json.dumps(dict(error=one_line(e), precision=args.precision, batch_size=args.batch_size, devices=1,
                                  compile=args.compile)), flush=True)
            return FAILED_EXIT
    else:
        result = _measure_ddp(args)
    if result.get("out_of_memory"):
        print(f"CUDA out of memory at batch {args.batch_size} per device ({args.precision})", flush=True)
        print(json.dumps(result), flush=True)
        return OOM_EXIT
    print(json.dumps(result), flush=True)
    return 0


def one_line(error: BaseException) -> str:
    """An exception as one line: its type and the first line of its message, as torch.compile's errors run to many
    lines."""
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {first}"[:400] if first else type(error).__name__


def why_it_failed(output: str, exit_code: int) -> str:
    """Why a gpu_speed run that exited with `exit_code` (not 0, not OOM_EXIT) failed, in one line: the error its last
    line of `output` gives after FAILED_EXIT, else its exit code."""
    lines = output.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if exit_code == FAILED_EXIT and lines else None
    except json.JSONDecodeError:
        result = None
    if isinstance(result, dict) and isinstance(result.get("error"), str):
        return result["error"]
    return f"exit code {exit_code}"


def start_together(folder: Path, count: int, timeout: float) -> tuple[float, bool]:
    """Mark this process ready in `folder` (a file holding the wall-clock time it got ready) and sleep until `count`
    processes have, then until the moment every one of them computes alike from those files: the last ready time
    plus START_MARGIN_S. Sleeping rather than stepping while waiting starts every window within milliseconds of the
    others' (a step would make it up to a whole step late).

    Args:
        folder: the folder every process of the group was given (empty before the first is ready).
        count: how many processes start together.
        timeout: after this many seconds of waiting, start at once.

    Returns:
        The seconds waited, and whether `timeout` ran out before `count` processes were ready.
    """
    ready = time.time()
    scratch, mine = folder / f".ready-{os.getpid()}", folder / f"ready-{os.getpid()}"
    scratch.write_text(repr(ready))
    os.replace(scratch, mine)  # the others never read a half-written time
    while True:
        times = [float(path.read_text()) for path in folder.glob("ready-*")]
        if len(times) >= count:
            break
        if time.time() - ready > timeout:
            return time.time() - ready, True
        time.sleep(READY_POLL_S)
    time.sleep(max(0.0, max(times) + START_MARGIN_S - time.time()))
    return time.time() - ready, False


def _measure_ddp(args: argparse.Namespace) -> dict:
    """One process per device; rank 0's result (with every rank's memory) comes back through a file."""
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port for the process group's rendezvous on loopback
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as scratch:
        result_path = Path(scratch) / "result.json"
        try:
            mp.spawn(_rank_main, args=(args, port, str(result_path)), nprocs=args.devices, join=True)
        except mp.ProcessExitedException as e:
            if e.exit_code == OOM_EXIT:  # one rank ran out of memory: spawn has stopped the others
                return dict(out_of_memory=True, precision=args.precision, batch_size=args.batch_size,
                            devices=args.devices)
            raise
        return json.loads(result_path.read_text())


def _rank_main(rank: int, args: argparse.Namespace, port: int, result_path: str) -> None:
    import torch.distributed as dist

    backend = "nccl" if args.device == "cuda" else "gloo"
    # A rank that stops answering (its peer ran out of memory) fails the collective after a minute, not never.
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.devices,
                            timeout=timedelta(seconds=60))
    try:
        result = measure(rank, args.devices, args)
        if result.get("out_of_memory"):
            os._exit(OOM_EXIT)  # the others wait in a collective for this rank: spawn stops them on this exit
        if rank == 0:
            Path(result_path).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def measure(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    """Warm up, time training, time a validation pass; on a process group when world_size > 1. The result (complete
    on rank 0) sums samples over ranks and lists each rank's peak memory.

    Args:
        rank: this process's rank (its GPU's index on CUDA).
        world_size: how many processes train together (DDP when more than 1).
        args: gpu_speed's parsed command line.
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler

    from hivetrain.pixels import to_model_input
    from hivetrain.synthetic_data import SyntheticCifar10
    from hivetrain.config import get_preset
    from hivetrain.model import autocast_dtype, create_model
    from hivetrain.optimizer import make_optimizer

    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    config = get_preset(PRESET)
    model = create_model(dataclasses.replace(config.model, pretrained=False), seed=config.seed).to(device)
    optimizer, _ = make_optimizer(model, config.optim)
    trained = model
    if world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        trained = DistributedDataParallel(model, device_ids=[rank] if cuda else None)
    # Validation runs the eager model: a compiled one would compile again for eval mode inside the timed pass.
    step_model = torch.compile(trained) if args.compile else trained
    dtype = autocast_dtype(args.precision)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "16-mixed")
    workers = args.num_workers if args.num_workers is not None else (
        min(8, max(1, (os.cpu_count() or 2) // world_size - 1)) if cuda else 0)

    def loader(split: str, size: int, train: bool) -> DataLoader:
        dataset = SyntheticCifar10(size, args.seed, split)
        sampler = DistributedSampler(dataset, world_size, rank, shuffle=train, seed=args.seed, drop_last=train) \
            if world_size > 1 else None
        generator = torch.Generator().manual_seed(args.seed)
        return DataLoader(dataset, batch_size=args.batch_size, shuffle=train and sampler is None, sampler=sampler,
                          drop_last=train, num_workers=workers, pin_memory=cuda, generator=generator,
                          persistent_workers=train and workers > 0, prefetch_factor=4 if workers > 0 else None)

    def batches() -> Iterator:
        train_loader, epoch = loader("train", args.train_samples, train=True), 0
        while True:  # as many passes over the training split as the timed window needs
            if isinstance(train_loader.sampler, DistributedSampler):
                train_loader.sampler.set_epoch(epoch)
            yield from train_loader
            epoch += 1

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    img_size = config.model.img_size
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"ViT-B/32 at {img_size} px, precision {args.precision}, batch {args.batch_size} x {world_size} device(s),"
        f" {workers} DataLoader worker(s) per process", flush=True)
    stream = batches()
    steps = 0
    loss = torch.zeros((), device=device)
    try:
        trained.train()

        def step() -> None:
            nonlocal loss
            images, labels = next(stream)
            x = to_model_input(images.to(device, non_blocking=True), "cifar10", img_size)
            y = labels.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(step_model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)

        first_step_seconds = None  # the first step holds CUDA's and cuBLAS's start, and with --compile compilation
        warmup_started = time.perf_counter()
        for n in range(args.warmup_steps):
            step()
            if n == 0:
                synchronize()
                first_step_seconds = time.perf_counter() - warmup_started
        synchronize()
        warmup_seconds = time.perf_counter() - warmup_started
        ready_wait_seconds, ready_timed_out = 0.0, False
        if args.ready_count > 1:
            say(f"waiting in {args.ready_dir} for {args.ready_count} processes to be ready", flush=True)
            ready_wait_seconds, ready_timed_out = start_together(Path(args.ready_dir), args.ready_count,
                                                                 args.ready_timeout)
        say(f"timing training for at least {args.seconds:g} s", flush=True)
        window_start_time = time.time()
        started = time.perf_counter()
        while steps < 2 or time.perf_counter() - started < args.seconds:
            step()
            steps += 1
        synchronize()
        train_seconds = time.perf_counter() - started
        window_end_time = time.time()
        dumps = []
        if rank == 0 and args.dump_dir:  # the GPUs as they are at the end of a busy window, memory still held
            from benchmarks.gpu_usage import write_nvidia_smi_dumps

            dumps = write_nvidia_smi_dumps(Path(args.dump_dir), args.dump_label)
        final_loss = float(loss.detach())
        val_seen = 0
        right = torch.zeros((), dtype=torch.int64, device=device)  # summed on the device: no sync per batch
        val_seconds = 0.0
        if args.val_samples:
            val_loader = loader("val", args.val_samples, train=False)
            trained.eval()
            synchronize()
            started = time.perf_counter()
            with torch.no_grad():
                for images, labels in val_loader:
                    x = to_model_input(images.to(device, non_blocking=True), "cifar10", img_size)
                    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                        predicted = trained(x).argmax(dim=1)
                    right += (predicted == labels.to(device, non_blocking=True)).sum()
                    val_seen += len(labels)
            synchronize()
            val_seconds = time.perf_counter() - started
        val_right = int(right)
    except torch.cuda.OutOfMemoryError:
        return dict(out_of_memory=True, precision=args.precision, batch_size=args.batch_size, devices=world_size)
    mine = dict(
        rank=rank, steps=steps, train_seconds=train_seconds, val_seen=val_seen, val_right=val_right,
        val_seconds=val_seconds, peak_memory_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
        device_name=torch.cuda.get_device_name(device) if cuda else "cpu",
        total_memory_bytes=torch.cuda.get_device_properties(device).total_memory if cuda else None,
    )
    ranks = [mine]
    if world_size > 1:
        ranks = [None] * world_size
        dist.all_gather_object(ranks, mine)
    # Every rank takes the same number of steps (DDP's collectives keep them in step), so the slowest rank's time
    # is the time all of the samples took.
    train_seconds = max(r["train_seconds"] for r in ranks)
    val_seconds = max(r["val_seconds"] for r in ranks)
    samples = steps * args.batch_size * world_size
    val_seen = sum(r["val_seen"] for r in ranks)
    return dict(
        out_of_memory=False, precision=args.precision, batch_size=args.batch_size, devices=world_size,
        strategy="ddp" if world_size > 1 else "single", compile=args.compile, warmup_steps=args.warmup_steps,
        first_step_seconds=None if first_step_seconds is None else round(first_step_seconds, 2),
        warmup_seconds=round(warmup_seconds, 2), ready_count=args.ready_count,
        ready_wait_seconds=round(ready_wait_seconds, 2), ready_timed_out=ready_timed_out,
        window_start_time=round(window_start_time, 3), window_end_time=round(window_end_time, 3), steps=steps,
        train_samples=samples, train_seconds=round(train_seconds, 3),
        train_samples_per_s=round(samples / train_seconds, 1),
        val_samples=val_seen, val_seconds=round(val_seconds, 3),
        val_samples_per_s=round(val_seen / val_seconds, 1) if val_seconds > 0 else None,
        val_top1=round(sum(r["val_right"] for r in ranks) / val_seen, 4) if val_seen else None,
        final_loss=round(final_loss, 4), num_workers=workers,
        peak_memory_bytes=[r["peak_memory_bytes"] for r in ranks],
        total_memory_bytes=ranks[0]["total_memory_bytes"], device_names=[r["device_name"] for r in ranks],
        nvidia_smi_dumps=dumps,
    )


if __name__ == "__main__":
    sys.exit(main())
