"""FSDP2 parameter sharding of the shared ImageClassifier, through Lightning's ModelParallelStrategy.

Lightning's `strategy="fsdp"` (FSDP1) refuses CPUs; ModelParallelStrategy leaves parallelisation to the module's
`configure_model`, where `torch.distributed.fsdp.fully_shard` (FSDP2) shards each transformer block and then the root,
over the strategy's data-parallel mesh. That works with gloo on CPUs and NCCL on GPUs alike.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from hivetrain.module import ImageClassifier


class ShardedImageClassifier(ImageClassifier):
    """ImageClassifier whose model's parameters are sharded across the data-parallel ranks (FSDP2)."""

    # (bytes of parameters this rank holds, bytes of the whole model), measured right after sharding: FSDP2 keeps
    # the root module's parameters gathered after a forward until the next backward, so a count taken after
    # validation would include the root's full parameters.
    param_bytes: tuple[int, int] | None = None

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        # Lightning calls this hook again for every later trainer.validate/test: shard only once.
        if any(isinstance(p, DTensor) for p in self.model.parameters()):
            return
        mesh = self.device_mesh["data_parallel"]
        # One FSDP unit per block: only one block's full parameters exist at a time in forward and backward.
        # Models without `blocks` (not a ViT) are sharded as one unit.
        for block in getattr(self.model, "blocks", []):
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)  # the rest: patch embedding, norms, head
        self.param_bytes = parameter_bytes(self.model)


def parameter_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of parameters this rank holds, bytes of the whole model's parameters). A sharded parameter is a
    DTensor: its local tensor is this rank's shard, its numel() the whole parameter's."""
    local = total = 0
    for p in model.parameters():
        shard = p.to_local() if isinstance(p, DTensor) else p
        local += shard.numel() * shard.element_size()
        total += p.numel() * p.element_size()
    return local, total


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights, gathered on CPU. A collective: every rank must call it; rank 0 gets the weights, the
    other ranks an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class StateDict(torch.nn.Module):
    """Gathered weights in the shape `hivetrain.model.save_weights` takes (anything with `state_dict()`)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        super().__init__()
        self._state = state

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return self._state
