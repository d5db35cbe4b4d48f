"""The model factory: a timm model built from the run's `ModelConfig`, with pretrained weights from the hub
or from a local file."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import timm
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from hivetrain.config import ModelConfig, RunConfig
from hivetrain.files import atomic_write


# A run's model reaches every volunteer from the network: one far beyond what a volunteer's device can train (a depth
# of 10^6, say) is refused before a byte of it is allocated. ViT-B/32 has 88 million parameters.
MAX_PARAMETERS = 2_000_000_000


class PretrainedWeightsUnavailable(RuntimeError):
    pass


def parameter_count(config: ModelConfig) -> int:
    """How many parameters `config`'s model has, counted on the meta device (nothing allocated, nothing loaded)."""
    with torch.device("meta"):
        model = timm.create_model(config.name, pretrained=False, img_size=config.img_size,
                                  num_classes=config.num_classes, **config.kwargs)
    return sum(parameter.numel() for parameter in model.parameters())


def _hub_is_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def _hub_is_reachable(timeout: float = 3.0) -> bool:
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def create_model(config: ModelConfig, pretrained_weights: str | Path | None = None, seed: int = 0) -> torch.nn.Module:
    """Build the model. Randomly initialised layers are seeded, so every peer starts from the same weights.

    Weights come from `pretrained_weights` (a timm state dict or safetensors file) when given, else, with
    `config.pretrained`, from the Hugging Face hub, else they are the seeded random ones. A file also serves a run
    that is not pretrained (synthetic-vit-b32 from the mission's weights, say): in a swarm it is the coordinator's
    start that counts, since peers download the swarm's state. The head is re-initialised for `num_classes`, and the
    position embedding is resized to `img_size`, by timm.
    """
    if (count := parameter_count(config)) > MAX_PARAMETERS:
        raise ValueError(f"model {config.name} with {config.kwargs} has {count:,} parameters, over the"
                         f" {MAX_PARAMETERS:,} a volunteer is asked to train")
    kwargs = dict(config.kwargs, img_size=config.img_size, num_classes=config.num_classes)
    torch.manual_seed(seed)
    if pretrained_weights is not None:
        path = Path(pretrained_weights)
        if not path.is_file():
            raise PretrainedWeightsUnavailable(f"--pretrained-weights {path}: no such file")
        return timm.create_model(config.name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **kwargs)
    if not config.pretrained:
        return timm.create_model(config.name, pretrained=False, **kwargs)
    hint = f"pretrained weights for {config.name} cannot be downloaded from the Hugging Face hub"
    hint += " (HF_HUB_OFFLINE is set)" if _hub_is_offline() else ""
    if _hub_is_offline() or not _hub_is_reachable():
        # timm would retry the download for about a minute before failing: fail fast and say what to do instead.
        _raise_unless_cached(config.name, hint)
    try:
        return timm.create_model(config.name, pretrained=True, **kwargs)
    except OSError as e:  # huggingface_hub's LocalEntryNotFoundError, connection errors
        raise PretrainedWeightsUnavailable(f"{hint}: {e.__class__.__name__}. {_FLAG_HINT}") from None


_FLAG_HINT = (
    "Download them where you have internet (e.g. `timm.create_model(NAME, pretrained=True)` then"
    " `torch.save(model.state_dict(), FILE)`) and pass --pretrained-weights FILE."
)


def _raise_unless_cached(name: str, hint: str) -> None:
    from huggingface_hub import try_to_load_from_cache

    cfg = timm.models.get_pretrained_cfg(name)
    repo = cfg.hf_hub_id if cfg is not None else None
    for filename in ("model.safetensors", "pytorch_model.bin"):
        if repo and isinstance(try_to_load_from_cache(repo, filename), str):
            return
    raise PretrainedWeightsUnavailable(f"{hint}. {_FLAG_HINT}")


def choose_device(requested: str) -> str:
    """--device auto|cpu|cuda: auto takes the GPU when there is one. Asking for cuda without one is a ValueError."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def choose_precision(requested: str, device: str, fp16: bool = True, bf16: bool | None = None) -> str:
    """A config.PRECISIONS value: "auto" takes bf16-mixed on a GPU that computes in bf16 natively, else 16-mixed on a
    GPU (unless fp16=False: a strategy without loss scaling), else 32.

    Args:
        requested: --precision or the run's; anything but "auto" is kept.
        device: "cuda" or "cpu".
        fp16: whether the caller can train in fp16 (it needs a loss scaler).
        bf16: whether the GPU computes in bf16 natively; None asks the current CUDA device (cuda_has_native_bf16).
    """
    if requested != "auto":
        return requested
    if device == "cuda" and (bf16 if bf16 is not None else cuda_has_native_bf16()):
        return "bf16-mixed"
    return "16-mixed" if device == "cuda" and fp16 else "32"


def cuda_has_native_bf16() -> bool:
    """Compute capability 8.0 or more (A100, H100, RTX 30xx and later). Older cards (V100 7.0, T4 7.5, P100 6.0) only
    emulate bf16, slowly, though torch.cuda.is_bf16_supported() says yes on them: fp16 with a scaler is their best."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype torch.autocast computes in for a mixed precision; None for 32 (no autocast)."""
    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def save_weights(path: Path, model: torch.nn.Module, config: RunConfig, epoch: int) -> None:
    """Weights as safetensors, with the run and epoch they belong to; written atomically."""
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    metadata = dict(run_id=config.run_id, fingerprint=config.fingerprint, epoch=str(epoch))
    atomic_write(path, save(state, metadata=metadata))


def load_weights(path: Path, model: torch.nn.Module) -> dict[str, str]:
    """Load weights saved by `save_weights` into `model`; returns their metadata (run_id, fingerprint, epoch)."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    model.load_state_dict(load_file(str(path)))
    return metadata
