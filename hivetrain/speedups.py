"""What keeps a volunteer's GPU busy in the inner loop, decided in one place from the device and precision, so that
every role turns on the same things and every run result and peer event says which were on.

- tf32: fp32 matmuls on TensorFloat-32 tensor cores (CUDA cards of compute capability 8.0 and up, precision 32 only;
  the mixed precisions already compute in bf16/fp16).
- fused_adamw: AdamW's single fused CUDA kernel instead of a loop of per-tensor ops (hivetrain.optimizer.make_optimizer
  fuses whenever the parameters are on CUDA).
- pinned_memory: DataLoader batches in page-locked memory, so the copy to the GPU can overlap compute (Lightning's
  batch transfer passes non_blocking=True for every device but the CPU and MPS).
- compile: torch.compile of the model (asked for with --compile; never chosen here).

And what keeps it busy between two steps: FiniteSteps learns whether the steps came out finite without making the GPU
wait for the host.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Optional, Union

import torch

TF32_MIN_CAPABILITY = (8, 0)  # Ampere: the first CUDA cards with TF32 tensor cores
FP32_PRECISIONS = ("32", "32-true")  # config.PRECISIONS' "32" and Lightning's name for it


def inner_loop_speedups(device_type: str, precision: str, compile: bool = False,
                        cuda_capability: Optional[tuple[int, int]] = None) -> dict[str, bool]:
    """Which inner-loop speedups a run on `device_type` at `precision` uses.

    Args:
        device_type: "cuda" or "cpu" (torch.device.type).
        precision: the resolved precision ("32", "bf16-mixed", "16-mixed"; not "auto").
        compile: whether the model is compiled (--compile).
        cuda_capability: the CUDA card's compute capability (major, minor); None: the current card's, read from
            torch when device_type is "cuda".

    Returns:
        {"tf32": bool, "fused_adamw": bool, "pinned_memory": bool, "compile": bool}, as run results and events carry it.
    """
    cuda = device_type == "cuda"
    if cuda and cuda_capability is None:
        cuda_capability = torch.cuda.get_device_capability()
    tf32 = (cuda and precision in FP32_PRECISIONS and cuda_capability is not None
            and cuda_capability >= TF32_MIN_CAPABILITY)
    return dict(tf32=tf32, fused_adamw=cuda, pinned_memory=cuda, compile=compile)


def apply_tf32(speedups: dict[str, bool]) -> None:
    """Allow TF32 for fp32 matmuls in this process when `speedups["tf32"]` (torch's "high" matmul precision); otherwise
    leave torch's default ("highest": full fp32). cuDNN's convolutions already allow TF32 by torch's default."""
    if speedups["tf32"]:
        torch.set_float32_matmul_precision("high")


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every value of `tensors` is finite, read on the host once: asking each tensor (bool() per tensor) made
    the training thread wait for the GPU once per tensor, about 150 times a step for ViT-B/32's gradients."""
    verdicts = [torch.isfinite(tensor).all() for tensor in tensors]
    return not verdicts or bool(torch.stack([v.to(verdicts[0].device) for v in verdicts]).all())


class FiniteSteps:
    """Whether a peer's inner steps came out finite, learnt without making the GPU wait for the host.

    Reading a CUDA loss on the host (bool(), float(), .item()) blocks the training thread until the GPU has run every
    kernel queued so far, and the GPU then idles until the thread has queued the next step's: once a step, on the
    critical path. Here each step's verdict is copied to pinned host memory behind a CUDA event instead, and read once
    the GPU got there, a step or so later, at no wait. Whoever reads the parameters for others (a round's
    pseudo-gradient) first calls `settled(wait=True)`, so that a non-finite step never leaves the peer. On the CPU, and
    for a verdict given as a bool, it is known at once."""

    def __init__(self) -> None:
        self._pending: deque[tuple[torch.Tensor, Optional[torch.cuda.Event]]] = deque()

    def add(self, finite: Union[bool, torch.Tensor]) -> None:
        """One step's verdict: a bool, or a 0-d bool tensor on the training device (torch.isfinite(loss).all())."""
        if isinstance(finite, torch.Tensor) and finite.device.type == "cuda":
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(finite, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(finite.device))  # the stream the copy went on
            self._pending.append((host, event))
        else:
            self._pending.append((torch.tensor(bool(finite)), None))

    def settled(self, wait: bool = False) -> bool:
        """False when one of the verdicts that arrived since the last call was a non-finite step, else True; with
        `wait`, after waiting for every verdict still on its way (those left keep for a later call)."""
        finite = True
        while self._pending:
            host, event = self._pending[0]
            if event is not None:
                if not wait and not event.query():
                    break
                event.synchronize()
            self._pending.popleft()
            finite = finite and bool(host)
        return finite

    def clear(self) -> None:
        """Forget the verdicts on their way: the parameters they were about were just replaced."""
        self._pending.clear()
