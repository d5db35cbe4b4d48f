"""peers/join.py with a loss that turns NaN for a few steps once the swarm reaches an epoch, as on broken hardware or
a diverging batch. For tests/test_faults.py: python tests/sick_peer.py EPOCH STEPS [join.py arguments]"""

import sys

import torch

from hivetrain.module import ImageClassifier
from hivetrain.roles.peers import join

sick_from, sick_steps = int(sys.argv[1]), int(sys.argv[2])
healthy_training_step = ImageClassifier.training_step
poisoned = 0


def sick_training_step(self, batch, batch_idx):
    global poisoned
    loss = healthy_training_step(self, batch, batch_idx)
    if self.trainer.strategy.local_epoch >= sick_from and poisoned < sick_steps:
        poisoned += 1
        print(f"Poisoned local step {poisoned} of {sick_steps}", flush=True)
        return loss * torch.tensor(float("nan"))
    return loss


ImageClassifier.training_step = sick_training_step
sys.exit(join.main(sys.argv[3:]))
