"""Short hashes of parameters, as a peer's console lines show them: a peer that downloaded a state shows the digest
its server showed, and peers in step after a round often show the same one (not always: hivemind's all-reduce adds
the average's difference to each peer's own copy, which can differ from the average in the last bit). Probes, a few
of the parameters' values, compare two peers' parameters to float rounding (a peer's `--events`)."""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch


def tensors_digest(tensors: Iterable[torch.Tensor]) -> str:
    """The first 10 hex digits of the SHA-256 of the tensors' bytes, in order, wherever they live. For ViT-B/32's
    88M parameters that is a copy of 350 MB to the host and about a quarter of a second of hashing: a peer's training
    thread leaves it to a round's own thread where it can (DiLoCoRounds.landed)."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:10]


PROBE_SIZE = 16


def tensors_probe(tensors: Iterable[torch.Tensor], size: int = PROBE_SIZE) -> list[float]:
    """`size` of the tensors' values, spread evenly over all of them in order: how close two peers' parameters are,
    to float rounding (the digest tells bit-for-bit copies only)."""
    tensors = list(tensors)
    total = sum(tensor.numel() for tensor in tensors)
    wanted, probe, start = [index * total // size for index in range(size)], [], 0
    for tensor in tensors:
        inside = [index - start for index in wanted if start <= index < start + tensor.numel()]
        if inside:
            flat = tensor.detach().reshape(-1)
            probe += flat[torch.tensor(inside, device=flat.device)].float().cpu().tolist()
        start += tensor.numel()
    return probe
