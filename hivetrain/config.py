"""The run's manifest: one typed, serialisable description of what the swarm trains.

The coordinator publishes a `RunConfig` in the DHT; every peer builds its model, data and optimizer
from it and compares its fingerprint, so a swarm never mixes two different runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional


# The timm keywords a run's model may carry: those that shape a ViT's architecture, and nothing that names a file.
ARCHITECTURE_SETTINGS = ("patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias", "qk_norm",
                         "init_values", "class_token", "no_embed_class", "reg_tokens", "pre_norm", "fc_norm",
                         "global_pool", "dynamic_img_size", "drop_rate", "pos_drop_rate", "proj_drop_rate",
                         "attn_drop_rate", "drop_path_rate", "in_chans")
# Their largest values (1.0 for the rest: flags and rates): even on the meta device, timm takes minutes to build a
# depth of 10^6, so sizes are bounded before a model is built (hivetrain.model also bounds the parameter count).
SETTING_LIMITS = {"patch_size": 1024, "embed_dim": 16384, "depth": 256, "num_heads": 256, "mlp_ratio": 16.0,
                  "reg_tokens": 256, "in_chans": 16, "init_values": 1.0}
MAX_IMAGE_SIZE = 4096
MAX_CLASSES = 100_000


@dataclass(frozen=True)
class ModelConfig:
    name: str  # a timm model name
    img_size: int
    num_classes: int
    pretrained: bool = False  # start from the model's pretrained weights (hub or --pretrained-weights)
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to timm.create_model (patch_size, depth, ...)

    def __post_init__(self) -> None:
        # A run's configuration reaches every volunteer from the network, and timm takes more than architectures:
        # names and keywords that fetch files or URLs (hf-hub:..., pretrained_cfg_overlay, checkpoint_path).
        if not re.fullmatch(r"[A-Za-z0-9_.]{1,100}", self.name):
            raise ValueError(f"model {self.name!r} is not a timm model name (no hub or file prefixes)")
        if not (1 <= self.img_size <= MAX_IMAGE_SIZE and 1 <= self.num_classes <= MAX_CLASSES):
            raise ValueError(f"model {self.name}: img_size must be 1..{MAX_IMAGE_SIZE} and num_classes"
                             f" 1..{MAX_CLASSES}")
        for key, value in self.kwargs.items():
            if key not in ARCHITECTURE_SETTINGS:
                raise ValueError(f"model setting {key!r} is not one a run may carry:"
                                 f" {', '.join(ARCHITECTURE_SETTINGS)}")
            if not isinstance(value, (bool, int, float, str)) or (isinstance(value, str) and len(value) > 32):
                raise ValueError(f"model setting {key}={value!r} is not a number, a flag or a short name")
            if isinstance(value, (int, float)) and not 0 <= value <= SETTING_LIMITS.get(key, 1.0):
                raise ValueError(f"model setting {key}={value!r} is outside 0..{SETTING_LIMITS.get(key, 1.0)}")


@dataclass(frozen=True)
class DataConfig:
    dataset: str  # one of DATASETS: "digits", "fashion-mnist", "cifar10" or "synthetic" (CIFAR-10-shaped noise)
    augment: bool = False  # random crop + horizontal flip on the training split


@dataclass(frozen=True)
class OptimConfig:
    lr: float
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 10  # optimizer steps of linear warmup: swarm epochs (sync swarm), inner steps (diloco)
    total_steps: int = 1000  # optimizer steps after which the cosine schedule reaches its floor
    min_lr_ratio: float = 0.1  # the cosine floor, as a fraction of lr


@dataclass(frozen=True)
class SwarmConfig:
    target_batch_size: int  # samples the whole swarm accumulates per optimizer step (one swarm epoch)
    matchmaking_time: float = 3.0  # seconds a peer waits for others to form an averaging group
    averaging_timeout: float = 30.0  # seconds before a stuck averaging round is abandoned
    # Seconds an all-reduce waits for a peer's next chunk before averaging without it. hivemind's default (the
    # matchmaking time, 1 s in the demo) drops the parts of a peer that is merely busy for a moment.
    next_chunk_timeout: float = 5.0
    grad_compression: str = "none"  # "none", "fp16" or "8bit" for gradient averaging
    state_compression: str = "none"  # the same choices for parameter/state averaging and state downloads
    # Swarm epochs between parameter/optimizer-state averaging rounds. Peers that average gradients exactly apply the
    # same update and stay identical; these rounds only repair drift (a peer that missed a round reloads the state).
    average_state_every: int = 1
    # "sync": one swarm epoch per target_batch_size samples, gradients averaged every epoch (hivemind.Optimizer).
    # "diloco": each peer takes about inner_steps steps of its own optimizer, then the peers average the
    # pseudo-gradient (outer minus local parameters, weighted by samples) and take one outer step, SGD with Nesterov
    # momentum (hivetrain.diloco): one round of communication per inner_steps local steps. A swarm epoch is then
    # one outer round, and the OptimConfig schedule counts a peer's inner steps.
    mode: str = "sync"
    inner_steps: int = 50  # H: local steps per peer between outer rounds (diloco)
    # The outer step: plain averaging (SGD at lr 1 on the averaged pseudo-gradient, no momentum) by default. The
    # DiLoCo paper's lr 0.7 with Nesterov momentum 0.9 was tuned over hundreds of rounds; these presets run a dozen
    # (the mission: 5,000 inner steps at H = 500), fewer than momentum 0.9's own memory of about 10 rounds, and an
    # overlapped round applies its update one round late. The convergence suite (H = 8, 13 rounds, 3 data orders)
    # runs both: plain averaging within 1 point of DDP, the paper's several points behind (logbook/benchmarks.md).
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    # How each part of an all-reduce is combined from the peers' copies of it (gradients in sync mode, outer
    # parameters in diloco, and the state averaging of both). "none": hivemind's weighted mean, which one peer can
    # move anywhere. "centered-clip": CenteredClip (Gorbunov et al. 2021), clipping each peer's distance from the
    # estimate at clip_radius x the median distance of the peers' copies from their coordinate-wise median (its fixed
    # point lies about clip_radius / (honest peers) median distances from the honest mean, toward an attacker it clips:
    # 0.25 kept every attack of the attacks suite within 2 top-1 points, 1 did not; logbook/reliability.md).
    # "trimmed-mean": per coordinate, the highest and lowest trim_fraction of the peers' values are dropped.
    robust_aggregation: str = "none"
    clip_radius: float = 0.25
    trim_fraction: float = 0.25
    # G: peers average in groups of at most G (hivemind's target_group_size, the Moshpit scheme), formed anew every
    # round, so that parameters mix across the swarm over a few rounds instead of every peer meeting every other one
    # each round. None: one group of everyone who is averaging. Applies to every averaging round of either mode.
    target_group_size: Optional[int] = None
    # diloco: a round's matchmaking and all-reduce run in the background while each peer takes the next round's inner
    # steps, and its result lands as a correction (hivetrain.overlapped_round.RoundInFlight); a peer waits for a round
    # only when it has taken H more inner steps before the round finished. False: each round stops the inner steps
    # until done.
    # On by default since the convergence suite showed overlapped rounds within 1 point of DDP, at H = 8 on the demo
    # preset (a round as long as its 8 steps: the hardest case for a result one round late) as the mean of 3 data
    # orders, with the default outer step (logbook/benchmarks.md, convergence).
    overlap_rounds: bool = True
    # diloco: rounds paced in seconds instead of steps. A round falls due every round_seconds seconds of the wall
    # clock, on one grid all peers share (hivetrain.round_schedule.next_round_time), and each peer takes as many
    # inner steps as its device fits in that time: a GPU peer and a CPU peer share one schedule, each
    # pseudo-gradient weighted by its samples. Each peer looks for its group ahead of the round, so matchmaking is
    # off the critical path.
    # inner_steps stays the nominal H, which the inner LR schedule counts per round. None: rounds of H steps.
    round_seconds: Optional[float] = None


@dataclass(frozen=True)
class RunConfig:
    run_id: str
    preset: str
    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    swarm: SwarmConfig
    batch_size: int  # default per-step batch of one peer (a peer may choose its own)
    precision: str = "auto"  # "auto", "32", "bf16-mixed" or "16-mixed"; auto picks per device
    seed: int = 0  # initial weights: every peer starts from the same ones

    def __post_init__(self) -> None:
        if not self.run_id or "." in self.run_id or "/" in self.run_id:
            raise ValueError(f"run_id {self.run_id!r} must be non-empty without '.' or '/' (hivemind DHT keys)")
        if self.data.dataset not in DATASETS:
            raise ValueError(f"dataset {self.data.dataset!r} is not one of {', '.join(DATASETS)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        for kind in (self.swarm.grad_compression, self.swarm.state_compression):
            if kind not in COMPRESSIONS:
                raise ValueError(f"compression {kind!r} is not one of {', '.join(COMPRESSIONS)}")
        if self.swarm.mode not in SWARM_MODES:
            raise ValueError(f"swarm mode {self.swarm.mode!r} is not one of {', '.join(SWARM_MODES)}")
        if self.swarm.inner_steps < 1:
            raise ValueError("swarm.inner_steps must be at least 1")
        seconds = self.swarm.round_seconds
        if seconds is not None and not MIN_ROUND_SECONDS <= seconds <= MAX_ROUND_SECONDS:
            raise ValueError(f"swarm.round_seconds must be from {MIN_ROUND_SECONDS:g} to {MAX_ROUND_SECONDS:g}"
                             " (or None: rounds of inner_steps steps)")
        if self.swarm.outer_lr <= 0 or not 0 <= self.swarm.outer_momentum < 1:
            raise ValueError("need swarm.outer_lr > 0 and 0 <= swarm.outer_momentum < 1")
        if self.swarm.robust_aggregation not in ROBUST_AGGREGATIONS:
            raise ValueError(f"robust aggregation {self.swarm.robust_aggregation!r} is not one of"
                             f" {', '.join(ROBUST_AGGREGATIONS)}")
        if not self.swarm.clip_radius > 0:
            raise ValueError("swarm.clip_radius must be positive")
        if not 0 < self.swarm.trim_fraction < 0.5:
            raise ValueError("swarm.trim_fraction must be in (0, 0.5)")
        if self.swarm.average_state_every < 1:
            raise ValueError("swarm.average_state_every must be at least 1")
        if self.swarm.target_group_size is not None and self.swarm.target_group_size < 2:
            raise ValueError("swarm.target_group_size must be at least 2 (or None: one group)")
        if (self.swarm.robust_aggregation != "none" and self.swarm.target_group_size is not None
                and self.swarm.target_group_size < 3):
            # robust averagers form groups of 3 or more (hivemind_internals.MIN_ROBUST_GROUP_SIZE): in a pair, the
            # robust estimate is the mean, and one attacker would own its partner
            raise ValueError("swarm.target_group_size must be at least 3 with robust aggregation")
        if self.batch_size < 1 or self.swarm.target_batch_size < self.batch_size:
            raise ValueError("need 1 <= batch_size <= swarm.target_batch_size")

    def to_dict(self) -> dict[str, Any]:
        raw = dataclasses.asdict(self)
        # Settings added after runs were recorded are left out while they hold the value that means "as before", so
        # that the fingerprints of those runs, their checkpoints, run records (DHT) and run results stay what they
        # were.
        for name, before in SETTINGS_ADDED_LATER["swarm"].items():
            if raw["swarm"][name] == before:
                del raw["swarm"][name]
        return raw

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunConfig:
        try:
            optim = dict(raw["optim"])
            optim["betas"] = tuple(optim.get("betas", (0.9, 0.999)))
            return cls(
                **{k: v for k, v in raw.items() if k not in ("model", "data", "optim", "swarm")},
                model=ModelConfig(**raw["model"]),
                data=DataConfig(**raw["data"]),
                optim=OptimConfig(**optim),
                # a setting the stored config predates holds the value that means "as before"
                swarm=SwarmConfig(**{**SETTINGS_ADDED_LATER["swarm"], **raw["swarm"]}),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a valid RunConfig: {e}") from e

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        return cls.from_dict(json.loads(text))

    @property
    def fingerprint(self) -> str:
        """A short hash of the whole manifest: peers whose fingerprints differ train different runs."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)


DATASETS = ("digits", "fashion-mnist", "cifar10", "synthetic")
PRECISIONS = ("auto", "32", "bf16-mixed", "16-mixed")
COMPRESSIONS = ("none", "fp16", "8bit")
SWARM_MODES = ("sync", "diloco")
ROBUST_AGGREGATIONS = ("none", "centered-clip", "trimmed-mean")
# section -> setting -> the value that keeps the behaviour from before the setting existed (see RunConfig.to_dict)
SETTINGS_ADDED_LATER: dict[str, dict[str, Any]] = {"swarm": {
    "target_group_size": None, "robust_aggregation": "none", "clip_radius": 1.0, "trim_fraction": 0.25,
    "overlap_rounds": False, "round_seconds": None}}
# Rounds paced in seconds: under a second leaves no time to find a group; over a day, a peer's record lapses first.
MIN_ROUND_SECONDS, MAX_ROUND_SECONDS = 1.0, 86_400.0

PRESETS: dict[str, RunConfig] = {
    # A tiny ViT on scikit-learn's bundled digits, upscaled to 32 px: trains on two CPU cores in minutes.
    "demo": RunConfig(
        run_id="hivetrain-demo",
        preset="demo",
        model=ModelConfig(
            name="vit_tiny_patch16_224",
            img_size=32,
            num_classes=10,
            # 4 tokens of 16 px: on 8x8 digits upscaled to 32 px, this reaches 93% in 40 steps of 128 samples,
            # where 8 px patches needed 200 (measured on one CPU thread).
            kwargs=dict(patch_size=16, embed_dim=128, depth=2, num_heads=4, global_pool="avg", class_token=False),
        ),
        data=DataConfig(dataset="digits"),
        optim=OptimConfig(lr=3e-3, weight_decay=0.01, warmup_steps=5, total_steps=60),
        swarm=SwarmConfig(target_batch_size=128, matchmaking_time=1.0, averaging_timeout=10.0),
        batch_size=32,
    ),
    # The swarm benchmarks' reference: timm's ViT-Tiny (5.4M parameters) with 4 px patches at 32 px (64 tokens), on
    # the bundled digits: as much compute per sample as the plain-hivemind measurements the issue reports against.
    "digits-vit-tiny": RunConfig(
        run_id="hivetrain-digits-vit-tiny",
        preset="digits-vit-tiny",
        model=ModelConfig(name="vit_tiny_patch16_224", img_size=32, num_classes=10, kwargs=dict(patch_size=4)),
        data=DataConfig(dataset="digits"),
        optim=OptimConfig(lr=1e-3, weight_decay=0.05, warmup_steps=5, total_steps=60),
        swarm=SwarmConfig(target_batch_size=256, matchmaking_time=1.0, averaging_timeout=10.0),
        batch_size=32,
    ),
    # The mission's model (ViT-B/32, 88M parameters, random weights) on the bundled digits at 32 px: one patch per
    # image, so a CPU trains it quickly while the swarm moves the mission's full state. For join and transfer
    # benchmarks, not for accuracy.
    "digits-vit-b32": RunConfig(
        run_id="hivetrain-digits-vit-b32",
        preset="digits-vit-b32",
        model=ModelConfig(name="vit_base_patch32_224", img_size=32, num_classes=10),
        data=DataConfig(dataset="digits"),
        optim=OptimConfig(lr=1e-4, weight_decay=0.05, warmup_steps=5, total_steps=100),
        swarm=SwarmConfig(target_batch_size=64, matchmaking_time=3.0, averaging_timeout=60.0),
        batch_size=16,
    ),
    # The mission: pretrained ViT-B/32 fine-tuned on CIFAR-10 at 224 px by volunteers on 10-100 Mbit/s links, in
    # DiLoCo rounds: a sync swarm moves the 88M parameters' gradients at every step (tens of seconds per step on such
    # a link); the links benchmark (logbook/benchmarks.md) measured diloco well ahead of sync and DDP on every link, at
    # a fiftieth of sync's bytes per trained sample. H = 500 inner steps as in the DiLoCo paper (minutes of GPU time
    # per round, against a round of 176 MB each way in fp16); the schedule counts a peer's inner steps: 5,000 are 25
    # passes over the training set for 4 volunteers at batch 64.
    "cifar10-vit-b32": RunConfig(
        run_id="hivetrain-cifar10-vit-b32",
        preset="cifar10-vit-b32",
        model=ModelConfig(name="vit_base_patch32_224", img_size=224, num_classes=10, pretrained=True),
        data=DataConfig(dataset="cifar10", augment=True),
        optim=OptimConfig(lr=1e-4, weight_decay=0.05, warmup_steps=100, total_steps=5000),
        swarm=SwarmConfig(target_batch_size=1024, matchmaking_time=5.0, averaging_timeout=300.0, mode="diloco",
                          inner_steps=500, grad_compression="fp16", state_compression="fp16"),
        batch_size=64,
    ),
}
# The mission preset with nothing to download: the same model at 224 px, optimizer, schedule and swarm (diloco), on
# seeded CIFAR-10-shaped noise (hivetrain.synthetic_data, through CIFAR-10's transforms) from random weights, or from
# given ones with --pretrained-weights FILE. For GPU machines without network: it measures the mission's speed and
# traffic, not its accuracy (noise teaches nothing).
PRESETS["synthetic-vit-b32"] = PRESETS["cifar10-vit-b32"].replace(
    run_id="hivetrain-synthetic-vit-b32",
    preset="synthetic-vit-b32",
    model=dataclasses.replace(PRESETS["cifar10-vit-b32"].model, pretrained=False),
    data=dataclasses.replace(PRESETS["cifar10-vit-b32"].data, dataset="synthetic"),
)
DEFAULT_PRESET = "cifar10-vit-b32"


def get_preset(name: str) -> RunConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None


def diloco_schedule_flags(config: RunConfig, peers: int) -> list[str]:
    """Coordinator flags that give a diloco run of `peers` peers the preset's learning rate at the same samples seen.
    A preset's schedule counts optimizer steps of target_batch_size samples; diloco's counts a peer's inner steps of
    batch_size samples, peers of them at a time, so warmup and total steps stretch by target batch / (peers x batch)."""
    stretch = max(1, round(config.swarm.target_batch_size / (peers * config.batch_size)))
    return ["--warmup-steps", str(config.optim.warmup_steps * stretch),
            "--total-steps", str(config.optim.total_steps * stretch)]
