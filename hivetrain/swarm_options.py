"""How a peer takes part in the swarm, as our Lightning strategies take it (HivemindOptions), and the compressions
the swarm's transfers may use."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from hivemind.compression import CompressionBase, Float16Compression, NoCompression, Uniform8BitQuantization

from hivetrain.config import SwarmConfig


COMPRESSION: dict[str, Callable[[], CompressionBase]] = {
    "none": NoCompression,
    "fp16": Float16Compression,
    "8bit": Uniform8BitQuantization,
}


def wire_bytes(values: int, compression: CompressionBase) -> int:
    """What `values` float32 numbers take on the wire under `compression`, estimated (the payload only)."""
    per_value = 2 if isinstance(compression, Float16Compression) else 1 if isinstance(
        compression, Uniform8BitQuantization) else 4
    return values * per_value


@dataclass
class HivemindOptions:
    run_id: str
    target_batch_size: int  # samples the swarm accumulates per optimizer step
    batch_size: int  # this peer's samples per local step
    matchmaking_time: float = 3.0
    averaging_timeout: float = 30.0
    next_chunk_timeout: float = 5.0  # seconds before a silent peer's remaining parts are averaged without it
    grad_compression: str = "none"  # "none", "fp16", "8bit"
    state_compression: str = "none"  # for parameter averaging and state downloads
    average_state_every: int = 1  # swarm epochs between parameter averaging rounds
    delay_state_averaging: bool = False  # average parameters in the background (one epoch stale)
    delay_optimizer_step: bool = False  # run the optimizer in the background (needs offload_optimizer)
    delay_grad_averaging: bool = False  # average gradients in the background (needs delay_optimizer_step)
    offload_optimizer: bool = True  # keep optimizer state and a master copy of parameters in host memory
    reuse_grad_buffers: bool = False  # accumulate in .grad (saves memory); forced on for fp16 with hivemind's scaler
    load_state_timeout: float = 60.0
    verbose: bool = False  # hivemind's own progress messages
    # "sync": gradients averaged every swarm step (hivemind.Optimizer). "diloco": each peer takes about inner_steps
    # steps of its own optimizer, then the peers average the pseudo-gradient and take an outer SGD step (outer_lr,
    # Nesterov momentum outer_momentum: hivetrain.diloco); the gradient fields above (compression, delays, offload)
    # are then unused but grad_compression, which applies to the pseudo-gradient.
    mode: str = "sync"
    inner_steps: int = 50
    overlap_rounds: bool = SwarmConfig.overlap_rounds  # diloco: each round in the background during the next inner steps
    round_seconds: Optional[float] = None  # diloco: a round every S seconds of the clock, not every inner_steps steps
    outer_lr: float = SwarmConfig.outer_lr
    outer_momentum: float = SwarmConfig.outer_momentum
    # How each all-reduce part combines the peers' copies (hivetrain.robust): "none" (hivemind's weighted mean),
    # "centered-clip" or "trimmed-mean", in both modes.
    robust_aggregation: str = "none"
    clip_radius: float = SwarmConfig.clip_radius
    trim_fraction: float = SwarmConfig.trim_fraction
    target_group_size: Optional[int] = None  # G: average in groups of at most G peers (None: one group), either mode
    # The subkey the run record was signed under (hivetrain.run_record.fetch_run): this peer goes back to the best
    # validated state when a rollback record signed by it says so (hivetrain.rollback). None: no rollbacks.
    coordinator_key: Optional[bytes] = None

    @classmethod
    def for_run(cls, run_id: str, swarm: SwarmConfig, batch_size: int, **others: Any) -> HivemindOptions:
        """A peer's options in a run whose swarm settings are `swarm`: every setting the two share by name (a new
        one reaches the peers without being copied by hand), this peer's `batch_size`, and `others`."""
        shared = {field.name for field in dataclasses.fields(cls)} & {field.name for field in dataclasses.fields(swarm)}
        return cls(run_id=run_id, batch_size=batch_size, **{name: getattr(swarm, name) for name in shared}, **others)
