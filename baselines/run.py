"""Centralised baselines: train a preset on one device, with DDP, with FSDP2 sharding, with DataParallel or as a
pipeline of stages, and write one run result for the logbook.

    python baselines/run.py --strategy single --preset demo --epochs 3
    python baselines/run.py --strategy ddp --devices 2 --preset demo --threads 1
    python baselines/run.py --strategy fsdp --devices 4 --preset cifar10-vit-b32 --epochs 25 --data-dir DATA
    python baselines/run.py --strategy pipeline --devices 2 --preset demo --threads 1

Everything the swarm uses is reused unchanged: the preset (hivetrain.config), the model (hivetrain.model), the data
(hivetrain.data) and the LightningModule (hivetrain.module). Multi-node DDP/FSDP reads Lightning's cluster
environment: start this command once per node with MASTER_ADDR, MASTER_PORT and NODE_RANK set (Lightning starts the
node's --devices processes itself), or under torchrun or SLURM.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import warnings
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's tools are not installed

# torch, lightning and timm take seconds to import: they come after the arguments are checked.
STRATEGIES = ("single", "dp", "ddp", "fsdp", "pipeline")
SCHEDULES = ("1f1b", "gpipe")  # baselines.pipeline.SCHEDULES; named here to check arguments before torch loads
PRECISIONS = ("32", "bf16-mixed", "16-mixed")
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GLOO_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES")
# Set by the first process of a node for the processes Lightning starts from it (same command line, new env).
FOUND_BATCH_ENV = "HIVETRAIN_BASELINE_BATCH"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from hivetrain.wandb_run import add_wandb_arguments

    parser = argparse.ArgumentParser(
        prog="python baselines/run.py",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog=(
            "strategies: single = one device; ddp = DistributedDataParallel (gloo on CPUs, NCCL on GPUs); fsdp ="
            " FSDP2 parameter sharding (torch fully_shard per transformer block, through Lightning's"
            " ModelParallelStrategy; works on CPUs too); dp = torch.nn.DataParallel over the GPUs of one process"
            " (needs 2 or more GPUs); pipeline = the ViT's blocks split into one stage per process"
            " (torch.distributed.pipelining, micro-batches under a 1F1B or GPipe schedule)."
            " On CPUs, --devices is the number of processes per node."
            " Several nodes: run the same command on every node with MASTER_ADDR, MASTER_PORT and NODE_RANK set"
            " (Lightning starts each node's --devices processes), or under torchrun or SLURM; baselines/README.md has"
            " the recipes, including 2 nodes simulated on one machine."
            " Each run writes <result-dir>/<name>.json; python -m benchmarks.logbook build turns results into pages."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    what = parser.add_argument_group("what to train")
    what.add_argument("--strategy", required=True, choices=STRATEGIES)
    what.add_argument("--preset", default="demo", help="a RunConfig preset of hivetrain.config (demo, cifar10-vit-b32)")
    what.add_argument("--data-dir", default=None, help="where datasets are stored (default: ~/.cache/hivetrain/data)")
    what.add_argument("--pretrained-weights", default=None, metavar="FILE",
                      help="the preset's pretrained weights from this file instead of the Hugging Face hub")
    what.add_argument("--experiment", default=None,
                      help="logbook page this run belongs to (default: the preset's name)")
    how = parser.add_argument_group("how")
    how.add_argument("--accelerator", choices=("auto", "cpu", "cuda"), default="auto",
                     help="auto: CUDA GPUs when there are any")
    how.add_argument("--devices", type=int, default=None,
                     help="processes (GPUs, or CPU processes) per node; default 1, for dp all GPUs")
    how.add_argument("--num-nodes", type=int, default=1, help="nodes; start this command once per node")
    how.add_argument("--precision", choices=PRECISIONS, default=None,
                     help="default: the preset's; its 'auto' is bf16-mixed (16-mixed without bf16) on GPUs, 32 on CPUs")
    how.add_argument("--batch-size", default=None,
                     help="samples per device per step, or 'auto': the largest that fits (see --memory-budget);"
                          " default: the preset's")
    how.add_argument("--memory-budget", default=None,
                     help="for --batch-size auto: the peak memory one process may use, e.g. 4GiB (CPU: RSS, default"
                          " 4GiB; GPU: allocated memory, default until CUDA runs out of memory)")
    how.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step")
    how.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline: the schedule of micro-batches")
    how.add_argument("--microbatches", type=int, default=None,
                     help="pipeline: parts each batch is split into (default: 2 per stage); they divide the batch")
    how.add_argument("--threads", type=int, default=None, help="torch CPU threads per process")
    how.add_argument("--num-workers", type=int, default=None,
                     help="DataLoader workers per process (default: 0 on CPUs, 4 on GPUs)")
    how.add_argument("--seed", type=int, default=0, help="data order seed (the initial weights come from the preset)")
    how.add_argument("--compile", action="store_true",
                     help="compile the model with torch.compile (strategies single and ddp)")
    how.add_argument("--no-shuffle", action="store_true",
                     help="train on the training set in its stored order (exactness tests: DDP ranks then split"
                          " exactly the samples one larger batch would hold)")
    stop = parser.add_argument_group("how long")
    stop.add_argument("--epochs", type=int, default=1)
    stop.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimizer steps (-1: no limit)")
    stop.add_argument("--val-limit", type=int, default=None,
                      help="validate on the first N validation samples only (0: no validation)")
    out = parser.add_argument_group("output")
    out.add_argument("--out-dir", default="runs/baselines",
                     help="checkpoints/, tensorboard/ and monitor/ go here")
    out.add_argument("--checkpoint-store", default=None, metavar="DIR|s3://BUCKET/PREFIX",
                     help="where the best checkpoint goes (default: <out-dir>/checkpoints/<run name>); S3 credentials"
                          " come from the standard AWS chain")
    out.add_argument("--s3-endpoint-url", default=None, help="an S3-compatible server's URL")
    out.add_argument("--result-dir", default=None, help="where the run result goes (default: <out-dir>/results)")
    out.add_argument("--save-final-weights", default=None, metavar="FILE",
                     help="also write the final weights (safetensors), gathered from all shards")
    out.add_argument("--progress-bar", choices=("auto", "on", "off"), default="auto",
                     help="auto: only when the output is a terminal")
    add_wandb_arguments(parser)  # W&B files go under <out-dir>/wandb
    args = parser.parse_args(argv)

    if args.batch_size is not None and args.batch_size != "auto":
        if not args.batch_size.isdigit() or int(args.batch_size) < 1:
            parser.error(f"--batch-size must be a positive integer or 'auto', not {args.batch_size!r}")
    for name in ("num_nodes", "accumulate", "epochs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.devices is not None and args.devices < 1:
        parser.error("--devices must be at least 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")
    if args.max_steps == 0 or args.max_steps < -1:
        parser.error("--max-steps must be positive (or -1 for no limit)")
    if args.val_limit is not None and args.val_limit < 0:
        parser.error("--val-limit must be 0 or more")
    if args.strategy == "single" and ((args.devices or 1) != 1 or args.num_nodes != 1):
        parser.error("--strategy single trains on one device: use ddp or fsdp for --devices/--num-nodes above 1")
    if args.strategy == "dp" and args.num_nodes != 1:
        parser.error("--strategy dp runs in one process on one node: use ddp or fsdp across nodes")
    if args.strategy == "pipeline":
        stages = (args.devices or 1) * args.num_nodes
        if stages < 2:
            parser.error("--strategy pipeline needs 2 or more stages (--devices x --num-nodes): use --strategy single"
                         " for one device")
        args.microbatches = args.microbatches or 2 * stages
        if args.microbatches < 1 or (args.schedule == "1f1b" and args.microbatches < stages):
            parser.error(f"--microbatches must be at least 1, and for --schedule 1f1b at least the {stages} stages")
        if args.precision == "16-mixed":
            parser.error("--strategy pipeline supports --precision 32 or bf16-mixed (fp16 would need loss scaling"
                         " inside the schedule)")
        if args.batch_size == "auto":
            parser.error("--strategy pipeline needs a --batch-size: the batch finder measures whole models")
    elif args.microbatches is not None:
        parser.error("--microbatches is for --strategy pipeline")
    if args.compile and args.strategy not in ("single", "ddp"):
        # dp and pipeline train in loops of their own around the plain model; FSDP2 shards the model in
        # configure_model, after the module compiled it, an order torch.compile does not promise to follow
        parser.error("--compile is for --strategy single or ddp")
    if args.strategy == "fsdp" and args.precision == "16-mixed":
        parser.error("--strategy fsdp supports --precision 32 or bf16-mixed (Lightning's ModelParallelStrategy has"
                     " no fp16 gradient scaling)")
    from hivetrain.config import get_preset  # no torch: cheap to check before the slow imports

    try:
        get_preset(args.preset)
    except ValueError as e:
        parser.error(str(e))
    if args.memory_budget is not None:
        from hivetrain.batch_size import parse_bytes

        try:
            args.memory_budget = parse_bytes(args.memory_budget)
        except ValueError as e:
            parser.error(f"--memory-budget: {e}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = _command_line(argv)
    from hivetrain.batch_size import BatchSearchError
    from hivetrain.datasets import DatasetUnavailable
    from hivetrain.model import PretrainedWeightsUnavailable

    try:
        return _run(args, command)
    except (ValueError, BatchSearchError, DatasetUnavailable, PretrainedWeightsUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _command_line(argv: list[str] | None) -> str:
    """The command as typed, with the launch variables that shaped it (e.g. NODE_RANK for a multi-node run)."""
    env = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in LAUNCH_ENV if k in os.environ)
    args = shlex.join(sys.argv[1:] if argv is None else argv)
    launcher = "(under torchrun) " if "TORCHELASTIC_RUN_ID" in os.environ else (
        "(under SLURM srun) " if "SLURM_PROCID" in os.environ else "")
    return f"{launcher}{env + ' ' if env else ''}python baselines/run.py {args}"


def _say(message: str) -> None:
    # Lightning starts the other processes of a node with this same command: only the first one of each node talks.
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(message, flush=True)


def _run(args: argparse.Namespace, command: str) -> int:
    import torch

    from hivetrain.config import get_preset
    from hivetrain.speedups import apply_tf32, inner_loop_speedups

    if args.threads:
        torch.set_num_threads(args.threads)
    config = get_preset(args.preset)
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        raise ValueError("--accelerator cuda: no CUDA device is available")
    device = "cuda" if args.accelerator != "cpu" and torch.cuda.is_available() else "cpu"
    if args.strategy == "dp" and (device != "cuda" or torch.cuda.device_count() < 2):
        found = torch.cuda.device_count() if device == "cuda" else 0
        raise ValueError(f"--strategy dp needs at least 2 CUDA GPUs in this process (found {found}); DataParallel"
                         " on CPUs or one GPU is a single device: use --strategy single, or ddp for several processes")
    devices = args.devices or (torch.cuda.device_count() if args.strategy == "dp" else 1)
    if device == "cuda" and devices > torch.cuda.device_count():
        raise ValueError(f"--devices {devices}: this node has {torch.cuda.device_count()} CUDA GPUs")
    world_size = devices * args.num_nodes  # processes, or GPUs under DataParallel
    replicas = 1 if args.strategy == "pipeline" else world_size  # data-parallel: a pipeline's stages are one
    precision = _choose_precision(args.precision or config.precision, device, args.strategy)
    speedups = inner_loop_speedups(device, precision, compile=args.compile)
    apply_tf32(speedups)
    experiment = args.experiment or config.preset
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    name = f"{experiment}-{args.strategy}-{args.num_nodes}x{devices}-{stamp}"
    out_dir = Path(args.out_dir)
    result_dir = Path(args.result_dir) if args.result_dir else out_dir / "results"

    num_workers = args.num_workers if args.num_workers is not None else (4 if device == "cuda" else 0)
    datamodule = _datamodule(args, config, num_workers, speedups["pinned_memory"])
    datamodule.setup()  # loads (or fails on) the dataset now, and tells the batch search how many samples a rank gets
    per_rank = datamodule.num_train // replicas
    batch_size, search = _resolve_batch_size(args, config, device, precision, per_rank)
    if batch_size > per_rank:
        raise ValueError(f"--batch-size {batch_size} is more than the {per_rank} training samples each of the"
                         f" {replicas} devices gets: no full batch to train on")
    if args.strategy == "pipeline" and batch_size % args.microbatches:
        raise ValueError(f"--batch-size {batch_size} does not split into {args.microbatches} equal micro-batches:"
                         " pass --batch-size or --microbatches so that the micro-batches divide the batch")
    per = (f"in {args.microbatches} micro-batches ({args.schedule}) through the {world_size} stages"
           if args.strategy == "pipeline" else "per device")
    _say(f"{name}: {args.strategy} on {args.num_nodes} node(s) x {devices} {device} device(s), precision {precision},"
         f" batch {batch_size} {per} x accumulate {args.accumulate}, preset {config.preset}"
         f" (fingerprint {config.fingerprint}), speedups: {' '.join(k for k, on in speedups.items() if on) or 'none'}")

    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

    from baselines.recorder import RunStats
    from hivetrain.wandb_run import open_wandb_run

    started_at = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    best_path = out_dir / "checkpoints" / name / "best.safetensors"
    tb_dir = out_dir / "tensorboard" / experiment / name
    loggers = [TensorBoardLogger(out_dir / "tensorboard", name=experiment, version=name, default_hp_metric=False)]
    # One W&B run per baseline: only the run's first process opens it (Lightning starts the others with this command).
    layout = dict(strategy=args.strategy, num_nodes=args.num_nodes, devices=devices, batch_size=batch_size,
                  accumulate=args.accumulate, precision=precision)  # how this run trains the preset
    wandb_run = (open_wandb_run(args, out_dir, name, dict(config.to_dict(), baseline=layout),
                                step_metric="trainer/global_step", report=_say) if _is_first_process() else None)
    if wandb_run is not None:
        loggers.append(WandbLogger(experiment=wandb_run))
    final_path = Path(args.save_final_weights) if args.save_final_weights else None
    stats: RunStats | None
    if args.strategy == "dp":
        from baselines.dp import train_data_parallel

        datamodule.batch_size = batch_size * devices  # DataParallel splits each batch across the GPUs
        stats = train_data_parallel(
            config, datamodule, devices=devices, accumulate=args.accumulate, precision=precision, epochs=args.epochs,
            max_steps=args.max_steps, validate=args.val_limit != 0, pretrained_weights=args.pretrained_weights,
            best_path=best_path, final_path=final_path, loggers=loggers,
            nvidia_smi_path=out_dir / "monitor" / f"{name}-nvidia-smi.csv",
        )
    elif args.strategy == "pipeline":
        from baselines.pipeline import train_pipeline

        datamodule.batch_size = batch_size
        stats = train_pipeline(
            config, datamodule, device, devices, args.num_nodes, schedule=args.schedule,
            microbatches=args.microbatches, accumulate=args.accumulate, precision=precision, epochs=args.epochs,
            max_steps=args.max_steps, validate=args.val_limit != 0, pretrained_weights=args.pretrained_weights,
            best_path=best_path, final_path=final_path, loggers=loggers,
            nvidia_smi_path=out_dir / "monitor" / f"{name}-node{os.environ.get('NODE_RANK', '0')}-nvidia-smi.csv",
        )
    else:
        datamodule.batch_size = batch_size
        stats = _train_lightning(args, config, datamodule, device, devices, precision, name, out_dir, best_path,
                                 final_path, loggers)
    if stats is None:  # a rank other than 0: rank 0 writes the result
        return 0

    from hivetrain.run_result import (
        BatchSearch, BatchTrial, RunResult, cpu_name, software_versions, store_checkpoint, write_result,
    )

    best = max(stats.validation, key=lambda point: point.top1, default=None)
    if best is not None and best_path.exists():
        stats.best_checkpoint = store_checkpoint(
            best_path, config, best.epoch, dataclasses.asdict(best),
            args.checkpoint_store or out_dir / "checkpoints" / name, args.s3_endpoint_url,
        )

    global_batch = batch_size * replicas * args.accumulate
    run_result = RunResult(
        name=name, experiment=experiment, strategy=args.strategy, preset=config.preset, config=config.to_dict(),
        fingerprint=config.fingerprint, command=command, started_at=started_at, host=os.uname().nodename,
        accelerator=device, device_name=torch.cuda.get_device_name(0) if device == "cuda" else cpu_name(),
        versions=software_versions(), num_nodes=args.num_nodes, devices_per_node=devices,
        world_size=world_size, threads=args.threads, precision=precision,
        batch_size=batch_size, batch_size_auto=search is not None, accumulate=args.accumulate,
        global_batch_size=global_batch, epochs=stats.epochs, steps=stats.steps, train_samples=stats.train_samples,
        wall_time_s=stats.wall_time_s, train_time_s=stats.train_time_s,
        samples_per_s=round(stats.train_samples / stats.train_time_s, 2) if stats.train_time_s > 0 else 0.0,
        validation=stats.validation, memory=stats.memory, utilisation=stats.utilisation,
        best_checkpoint=stats.best_checkpoint, best_top1=stats.best_top1,
        batch_search=None if search is None else BatchSearch(
            budget_bytes=search.budget_bytes, cap=search.cap,
            trials=[BatchTrial(t.batch_size, t.fits, t.peak_bytes, round(t.seconds, 2), t.reason)
                    for t in search.trials],
        ),
        sharding=stats.sharding, pipeline=stats.pipeline, tensorboard_dir=str(tb_dir),
        nvidia_smi_log=stats.nvidia_smi_log, cpu_count=os.cpu_count(), speedups=speedups,
    )
    path = write_result(run_result, result_dir)
    if wandb_run is not None:  # the best checkpoint by reference: its URI, not its bytes
        wandb_run.summary.update({"best/top1": stats.best_top1, "best/epoch": best.epoch if best else None,
                                  "best/checkpoint": stats.best_checkpoint, "result": str(path)})
        wandb_run.finish()
    last = run_result.final
    outcome = f"val top-1 {last.top1:.2%}, loss {last.loss:.4f}" if last else "no validation"
    print(f"{name}: {run_result.steps} steps, {run_result.train_samples} samples in {run_result.wall_time_s:.1f} s"
          f" ({run_result.samples_per_s:.1f} samples/s), {outcome}. Result: {path}", flush=True)
    return 0


def _is_first_process() -> bool:
    """Global rank 0, before Lightning knows ranks: the launch variables of Lightning, torchrun and SLURM say."""
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def _choose_precision(requested: str, device: str, strategy: str) -> str:
    from hivetrain.model import choose_precision

    if strategy in ("fsdp", "pipeline") and requested == "16-mixed":
        raise ValueError(f"the preset's precision 16-mixed is not supported by --strategy {strategy}: pass"
                         " --precision bf16-mixed or 32")
    # fp16 needs loss scaling, which FSDP (through Lightning) and the pipeline schedule lack
    return choose_precision(requested, device, fp16=strategy not in ("fsdp", "pipeline"))


def _resolve_batch_size(args: argparse.Namespace, config, device: str, precision: str, per_rank: int):
    """The per-device batch, and the search that found it (None unless --batch-size auto)."""
    if args.batch_size != "auto":
        return int(args.batch_size or config.batch_size), None
    from hivetrain.batch_size import MAX_BATCH, TrialSpec, find_batch_size

    if FOUND_BATCH_ENV in os.environ:  # a process Lightning started: its node's first process already searched
        return int(os.environ[FOUND_BATCH_ENV]), None  # (such a process never writes the result)
    if "LOCAL_RANK" in os.environ or "SLURM_PROCID" in os.environ:
        raise ValueError("--batch-size auto searches before Lightning starts a node's processes; under torchrun or"
                         " SLURM run `python -m baselines.batch_finder --preset ...` once and pass --batch-size N")
    budget = args.memory_budget if args.memory_budget is not None or device == "cuda" else 4 * 1024**3
    spec = TrialSpec(config, device, precision, args.threads, args.data_dir)
    start = min(config.batch_size, per_rank, MAX_BATCH)
    result = find_batch_size(spec, budget, start=start, cap=min(MAX_BATCH, per_rank), log=_say)
    os.environ[FOUND_BATCH_ENV] = str(result.batch_size)
    _say(f"batch finder: using batch {result.batch_size} per device ({len(result.trials)} trials)")
    return result.batch_size, result


def _datamodule(args: argparse.Namespace, config, num_workers: int, pin_memory: bool):
    """The swarm's data module; with --no-shuffle, one whose training loader keeps the stored order. `pin_memory`:
    batches in page-locked memory (for CUDA)."""
    from torch.utils.data import DataLoader, Dataset, DistributedSampler

    from hivetrain.data import ImageDataModule
    from hivetrain.datasets import data_root

    class StoredOrder(ImageDataModule):
        # Lightning's own DistributedSampler always shuffles training data, so with --no-shuffle the Trainer gets
        # use_distributed_sampler=False and the split comes from here: rank r of W takes samples r, r+W, r+2W, ...
        def _loader(self, dataset: Dataset, drop_last: bool) -> DataLoader:
            trainer = self.trainer
            sampler = None
            if trainer is not None and trainer.world_size > 1:
                sampler = DistributedSampler(dataset, num_replicas=trainer.world_size, rank=trainer.global_rank,
                                             shuffle=False)
            return DataLoader(dataset, batch_size=self.batch_size, shuffle=False, sampler=sampler, drop_last=drop_last,
                              num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
                              pin_memory=self.pin_memory)

        def train_dataloader(self) -> DataLoader:
            self.setup()
            return self._loader(self.train_set, drop_last=True)

        def val_dataloader(self) -> DataLoader:
            self.setup()
            return self._loader(self.val_set, drop_last=False)

    data_dir = data_root(args.data_dir or None)
    val_limit = None if args.val_limit in (None, 0) else args.val_limit
    return (StoredOrder if args.no_shuffle else ImageDataModule)(
        config, data_dir, config.batch_size, args.seed, num_workers, val_limit, pin_memory)


def _train_lightning(args, config, datamodule, device, devices, precision, name, out_dir, best_path, final_path,
                     loggers):
    """Fit with Lightning; returns the run's stats on global rank 0 and None on the other ranks."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from baselines.recorder import RunRecorder
    from baselines.sharded import ShardedImageClassifier
    from hivetrain.model import create_model
    from hivetrain.module import ImageClassifier

    pl.seed_everything(args.seed, verbose=False)  # also DistributedSampler's shuffling seed (PL_GLOBAL_SEED)
    # The module logs val/loss per rank; RunRecorder averages it across ranks itself, so Lightning's advice is moot.
    warnings.filterwarnings("ignore", message=r".*self\.log\('val/loss', \.\.\., sync_dist=True\)")
    batch_size = datamodule.batch_size
    model = create_model(config.model, args.pretrained_weights, seed=config.seed)
    world_size = devices * args.num_nodes
    if args.strategy == "fsdp":
        module: ImageClassifier = ShardedImageClassifier(config, model)
        # Lightning's default mesh is data-parallel across nodes x tensor-parallel within one: we want pure FSDP.
        strategy = ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    else:
        module = ImageClassifier(config, model, compile_model=args.compile)
        strategy = DDPStrategy() if args.strategy == "ddp" else "auto"
    recorder = RunRecorder(config, best_path if args.val_limit != 0 else None, final_path,
                           out_dir / "monitor" / f"{name}-node{os.environ.get('NODE_RANK', '0')}-nvidia-smi.csv",
                           sharded=args.strategy == "fsdp")
    steps_per_epoch = max(1, datamodule.num_train // (batch_size * world_size * args.accumulate))
    show_bar = args.progress_bar == "on" or (args.progress_bar == "auto" and sys.stdout.isatty())
    trainer = pl.Trainer(
        accelerator=device,
        devices=devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        precision="32-true" if precision == "32" else precision,
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        limit_val_batches=0 if args.val_limit == 0 else None,
        use_distributed_sampler=not args.no_shuffle,  # --no-shuffle: the data module splits the data itself
        num_sanity_val_steps=0,
        logger=loggers,
        log_every_n_steps=min(50, steps_per_epoch),
        enable_checkpointing=False,  # the recorder keeps the best weights as safetensors, like the swarm
        enable_progress_bar=show_bar,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    trainer.fit(module, datamodule=datamodule)
    if trainer.interrupted:
        raise KeyboardInterrupt
    _leave_process_group()
    return recorder.stats if trainer.is_global_zero else None


def _leave_process_group() -> None:
    """The ranks of a multi-process run (DDP, FSDP) finish together and shut their process group down before the
    interpreter exits, as baselines.pipeline does. Lightning leaves it up: node 1 of a two-node DDP run once died at
    exit ("terminate called without an active exception", SIGABRT) after a training that had finished, and the links
    suite counted the run as failed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        code = main()
    except KeyboardInterrupt:
        print("interrupted: no result written", file=sys.stderr)
        code = 130
    sys.exit(code)
