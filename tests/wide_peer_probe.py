"""peers/join.py for a peer on several devices whose rank 1 has one non-finite loss once the swarm reaches an epoch (the
ranks must agree to drop that very step: every rank says when it holds non-finite parameters after an inner step), and
whose every rank writes the parameters it ends with (they must be rank 0's).
For tests/test_multi_device_peer.py: python tests/wide_peer_probe.py SICK_AT_EPOCH PREFIX [join.py arguments]; rank r
writes PREFIX.rank<r>.pt. Lightning launches the other ranks by running this same command again."""

import sys

import torch

from hivetrain.module import ImageClassifier
from hivetrain.diloco_ddp import DiLoCoDDPStrategy
from hivetrain.roles.peers import join
from hivetrain.roles.peers.progress import SwarmProgress

sick_at, prefix = int(sys.argv[1]), sys.argv[2]
healthy_training_step = ImageClassifier.training_step
finish = SwarmProgress.on_train_end
inner_step = DiLoCoDDPStrategy.optimizer_step
poisoned = False


def sick_training_step(self, batch, batch_idx):
    global poisoned
    loss = healthy_training_step(self, batch, batch_idx)
    if self.trainer.global_rank == 1 and not poisoned and self.trainer.strategy.local_epoch >= sick_at:
        poisoned = True
        print(f"Poisoned a local step of rank 1 in swarm epoch {self.trainer.strategy.local_epoch}", flush=True)
        return loss * torch.tensor(float("nan"))
    return loss


def checked_inner_step(self, *args, **kwargs):
    output = inner_step(self, *args, **kwargs)
    if not all(torch.isfinite(param).all() for param in self.lightning_module.parameters()):
        print(f"Non-finite parameters on rank {self.global_rank} after an inner step", flush=True)
    return output


def on_train_end(self, trainer, pl_module):
    finish(self, trainer, pl_module)
    torch.save([p.detach().clone() for p in pl_module.parameters()], f"{prefix}.rank{trainer.global_rank}.pt")


ImageClassifier.training_step = sick_training_step
SwarmProgress.on_train_end = on_train_end
DiLoCoDDPStrategy.optimizer_step = checked_inner_step
sys.exit(join.main(sys.argv[3:]))
