"""Run results: one JSON file per training run (a baseline or the swarm) with everything the logbook reports.

A result holds the run's configuration and fingerprint, how it was parallelised, its validation metrics per epoch,
its speed, memory and utilisation, and where its best weights are. `RunResult.from_json` checks every field's type
and raises `ValueError` naming the first bad or missing field, so a malformed result fails loudly in the logbook
instead of rendering as a wrong number.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import types
import typing
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from hivetrain.config import RunConfig
from hivetrain.files import atomic_write

SCHEMA_VERSION = 1
STRATEGIES = ("single", "dp", "ddp", "fsdp", "pipeline", "swarm")


@dataclass
class ValidationPoint:
    epoch: int  # training epochs completed when this validation ran (1 after the first)
    step: int  # optimizer steps so far
    time_s: float  # seconds since training started (wall clock, validation time included)
    loss: float
    top1: float  # fraction in [0, 1]
    top5: float


@dataclass
class UtilisationSample:
    time_s: float  # seconds since this rank started training
    rank: int
    cpu_percent: float  # this process; 100 = one core busy
    system_cpu_percent: float  # the whole machine, 100 = every core busy
    rss_bytes: int  # this process
    gpu_util_percent: Optional[float] = None  # this rank's GPU (NVML), None on CPU
    gpu_memory_bytes: Optional[int] = None  # memory used on this rank's GPU (NVML)


@dataclass
class RankMemory:
    rank: int
    host: str
    peak_rss_bytes: int  # the process's peak resident set (getrusage)
    peak_gpu_bytes: Optional[int] = None  # torch.cuda.max_memory_allocated on its device


@dataclass
class Sharding:
    """The parameters each rank holds, as measured, against the whole model: FSDP's shards or pipeline stages."""

    total_param_bytes: int
    per_rank_param_bytes: list[int]

    @property
    def max_fraction(self) -> float:
        """The largest shard as a fraction of the model; 1/world size when shards are even."""
        return max(self.per_rank_param_bytes) / self.total_param_bytes


@dataclass
class PipelineLayout:
    """How a pipeline run split the model: stage i ran on rank i."""

    schedule: str  # "1f1b" or "gpipe" (torch.distributed.pipelining)
    microbatches: int  # per batch: each batch goes through the stages in this many parts
    stages: list[str]  # what each stage runs, e.g. "embedding, blocks 0-5"


@dataclass
class BatchTrial:
    batch_size: int
    fits: bool
    peak_bytes: Optional[int]
    seconds: float
    reason: str


@dataclass
class BatchSearch:
    """How `--batch-size auto` chose the batch: the budget and every trial."""

    budget_bytes: Optional[int]
    cap: int
    trials: list[BatchTrial]


@dataclass
class RunResult:
    name: str  # unique per run: also the result's file name
    experiment: str  # the logbook page it belongs to (default: the preset)
    strategy: str  # one of STRATEGIES
    preset: str
    config: dict[str, Any]  # RunConfig.to_dict()
    fingerprint: str  # RunConfig.fingerprint
    command: str  # the exact command line that produced this result
    started_at: str  # ISO 8601, UTC
    host: str
    accelerator: str  # "cpu" or "cuda"
    device_name: str  # CPU model or GPU name
    versions: dict[str, str]  # torch, lightning, timm, ...
    num_nodes: int
    devices_per_node: int
    # data-parallel replicas that trained together: processes, GPUs under DataParallel, or peers; for a pipeline,
    # its processes (one per stage), which together are one replica
    world_size: int
    threads: Optional[int]  # torch threads per process, None when left to torch
    precision: str
    batch_size: int  # per device, per step (a pipeline's whole batch, which every stage sees)
    batch_size_auto: bool  # found by --batch-size auto
    accumulate: int  # batches per optimizer step (gradient accumulation)
    global_batch_size: int  # samples per optimizer step, all ranks together
    epochs: int  # training epochs completed
    steps: int  # optimizer steps taken
    train_samples: int  # samples trained on, all ranks together
    wall_time_s: float  # training start to end, validation included
    train_time_s: float  # the same without validation
    samples_per_s: float  # train_samples / train_time_s
    validation: list[ValidationPoint]
    memory: list[RankMemory]  # one per rank
    utilisation: list[UtilisationSample]
    best_checkpoint: Optional[str] = None  # URI of the weights with the best validation top-1 (store_checkpoint)
    best_top1: Optional[float] = None
    batch_search: Optional[BatchSearch] = None
    sharding: Optional[Sharding] = None  # FSDP and pipeline only
    pipeline: Optional[PipelineLayout] = None  # pipeline only
    tensorboard_dir: Optional[str] = None
    nvidia_smi_log: Optional[str] = None  # raw `nvidia-smi -l 1` output of rank 0's node, when the binary exists
    cpu_count: Optional[int] = None  # logical CPUs of rank 0's machine: with system_cpu_percent, the load of others
    # inner-loop speedups that were on (hivetrain.speedups): tf32, fused_adamw, pinned_memory, compile; None in
    # results from before they were recorded
    speedups: Optional[dict[str, bool]] = None
    notes: str = ""
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"field 'strategy': {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if self.world_size < 1 or self.batch_size < 1 or self.accumulate < 1:
            raise ValueError("fields 'world_size', 'batch_size' and 'accumulate' must be at least 1")
        if self.schema != SCHEMA_VERSION:
            raise ValueError(f"field 'schema': version {self.schema} is not the supported {SCHEMA_VERSION}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, raw: Any) -> RunResult:
        return _build(cls, raw, "")

    @classmethod
    def from_json(cls, text: str) -> RunResult:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON: {e}") from None
        return cls.from_dict(raw)

    @property
    def final(self) -> Optional[ValidationPoint]:
        return self.validation[-1] if self.validation else None

    @property
    def peak_rss_bytes(self) -> int:
        return max(m.peak_rss_bytes for m in self.memory) if self.memory else 0

    @property
    def peak_gpu_bytes(self) -> Optional[int]:
        values = [m.peak_gpu_bytes for m in self.memory if m.peak_gpu_bytes is not None]
        return max(values) if values else None


# --- strict decoding --------------------------------------------------------------------------------------------


def _build(cls: type, raw: Any, where: str) -> Any:
    """Decode a dataclass from JSON data, checking each field against its annotation."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where or 'result'}: expected an object, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ValueError(f"field '{_join(where, unknown[0])}' is not part of a {cls.__name__}")
    values = {}
    for name, f in fields.items():
        path = _join(where, name)
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"field '{path}' is missing")
            continue
        values[name] = _check(hints[name], raw[name], path)
    try:
        return cls(**values)
    except ValueError as e:  # __post_init__ checks (already name their field)
        raise ValueError(f"{where + ': ' if where else ''}{e}") from None


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _check(hint: Any, value: Any, path: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check(inner[0], value, path)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"field '{path}': expected a list, got {_describe(value)}")
        return [_check(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ValueError(f"field '{path}': expected an object, got {_describe(value)}")
        return {k: _check(args[1], v, f"{path}.{k}") for k, v in value.items()}
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"field '{path}': expected true or false, got {_describe(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"field '{path}': expected an integer, got {_describe(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"field '{path}': expected a number, got {_describe(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"field '{path}': expected a string, got {_describe(value)}")
        return value
    raise TypeError(f"run_result.py cannot decode {hint!r} (field '{path}')")  # a bug in the dataclasses above


def _describe(value: Any) -> str:
    text = json.dumps(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


# --- files ------------------------------------------------------------------------------------------------------


def read_result(path: str | Path) -> RunResult:
    """A result from its file; the error names the file and the field."""
    path = Path(path)
    try:
        return RunResult.from_json(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror}") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def write_result(result: RunResult, directory: str | Path) -> Path:
    """Write `<directory>/<result.name>.json` atomically, so readers never see half a result."""
    return atomic_write(Path(directory) / f"{result.name}.json", result.to_json())


def store_checkpoint(weights_path: str | Path, config: RunConfig, epoch: int, metrics: dict, store: str | Path,
                     endpoint_url: Optional[str] = None) -> str:
    """Put the best weights into the checkpoint store (a folder, or s3://bucket/prefix) as the run's best checkpoint;
    returns the URI the result keeps. The same store the coordinator uses, so --checkpoint-store s3://... works."""
    from safetensors.torch import load_file

    from hivetrain.checkpoint import Checkpoint
    from hivetrain.checkpoint_location import open_store

    checkpoint = Checkpoint(config=config, epoch=epoch, weights=load_file(str(weights_path)), metrics=metrics,
                            optimizer=None, scheduler=None)
    with open_store(str(store), endpoint_url=endpoint_url) as checkpoints:
        uri = checkpoints.save(checkpoint, best=True)
        checkpoints.flush(timeout=300)
    return uri


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def software_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {"python": platform.python_version()}
    for package in ("torch", "lightning", "timm", "hivemind"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            continue
    return versions


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.machine()} ({os.cpu_count()} cores)"

