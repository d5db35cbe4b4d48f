"""What keeps a volunteer's GPU busy in the inner loop, decided in one place from the device and precision, so that
every role turns on the same things and every run record and peer event says which were on.

- tf32: fp32 matmuls on TensorFloat-32 tensor cores (CUDA cards of compute capability 8.0 and up, precision 32 only;
  the mixed precisions already compute in bf16/fp16).
- fused_adamw: AdamW's single fused CUDA kernel instead of a loop of per-tensor ops (hivetrain.module.make_optimizer
  fuses whenever the parameters are on CUDA).
- pinned_memory: DataLoader batches in page-locked memory, so the copy to the GPU can overlap compute (Lightning's
  batch transfer passes non_blocking=True for every device but the CPU and MPS).
- compile: torch.compile of the model (asked for with --compile; never chosen here).
"""

from __future__ import annotations

from typing import Optional

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
        {"tf32": bool, "fused_adamw": bool, "pinned_memory": bool, "compile": bool}, as run records and events carry it.
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
