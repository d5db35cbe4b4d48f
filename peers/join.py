"""`python peers/join.py ...` in a clone: the same as `hivetrain-join ...` after `pip install`. The code is
hivetrain.roles.peers, inside the package, so that a wheel installs `hivetrain` alone."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this clone's hivetrain, installed or not

from hivetrain.roles.peers.join import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
