"""peers/join.py that dies (SIGKILL to its whole process group: averager processes and p2pd too) in the middle of
an outer round's all-reduce, once the swarm reaches a round: a volunteer's machine losing power at the worst moment.
For tests/test_diloco_swarm.py: python tests/dying_peer.py ROUND [join.py arguments]"""

import os
import signal
import sys
import time

from hivemind.averaging.control import AveragingStage

from hivetrain.outer_state import OuterState
from hivetrain.roles.peers import join

die_at = int(sys.argv[1])
step = OuterState.step


def dying_step(self, *args, **kwargs):
    if self.round < die_at:
        return step(self, *args, **kwargs)
    control = step(self, *args, **dict(kwargs, wait=False))
    deadline = time.monotonic() + 30
    while control.stage != AveragingStage.RUNNING_ALLREDUCE and time.monotonic() < deadline:
        time.sleep(0.001)
    print(f"Dying in outer round {self.round}, stage {control.stage.name}", flush=True)
    os.killpg(os.getpgid(0), signal.SIGKILL)


OuterState.step = dying_step
sys.exit(join.main(sys.argv[2:]))
