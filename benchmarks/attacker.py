"""A malicious volunteer, for tests and benchmarks only: peers/join.py whose contribution to every averaging round is
replaced before it is sent. Never a volunteer's option: it exists to show what robust aggregation stops.

    python benchmarks/attacker.py ATTACK [peers/join.py arguments]

ATTACK is one of
  scale:FACTOR  its gradients (sync) or pseudo-gradient (diloco) times FACTOR: scale:-10, scale:1000
  noise         Gaussian noise of the same norm, tensor by tensor: as large as an honest contribution, and useless
  replay        the contribution of its first round, sent again in every later one: stale, honest-looking values
and, so that the run first has a good state to lose, it plays honest
  ATTACK@R      in its first R rounds (diloco: until outer round R; sync: R swarm epochs): scale:1000@3, for a
                benchmark that times the recovery from a known round;
  ATTACK@PATH   until the file PATH exists (scale:1000@/tmp/go): whoever runs it creates the file once the coordinator
                has validated a good state. A count of rounds races the coordinator's validation: demo rounds of
                under a second can pass three rounds before its first look.

In diloco mode the pseudo-gradient g = outer - local is replaced by attack(g) before the outer step, so the outer
parameters it sends are outer - lr (1 + m) attack(g)-ish, as hivetrain.outer_state.OuterState computes them. In sync
mode the gradients it loads into hivemind's gradient averager are replaced. Each replaced round prints one line
("Attack: ..."), so that a test can tell that the attacker took part.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

ATTACKS = ("scale:FACTOR", "noise", "replay")


class Contribution:
    """What the attack makes of one round's contribution (a list of tensors), and what it remembers across rounds."""

    def __init__(self, spec: str, seed: int = 0):
        spec, _, start = spec.partition("@")
        # ATTACK@R: from round R (diloco: outer round R); ATTACK@PATH: once the file PATH exists
        self.from_round = int(start) if start.isdigit() else 0
        self.trigger = Path(start) if start and not start.isdigit() else None
        self.spec, self.rounds = spec, 0
        self.first_round: Optional[list[torch.Tensor]] = None
        self.generator = torch.Generator().manual_seed(seed)
        if spec.startswith("scale:"):
            self.factor = float(spec.split(":", 1)[1])
        elif spec not in ("noise", "replay"):
            raise ValueError(f"unknown attack {spec!r}: choose one of {', '.join(ATTACKS)}")

    def started(self, round_: int) -> bool:
        """Whether it attacks `round_` (counted from 0): from its first round, or once its trigger file exists (and
        from then on)."""
        if self.trigger is not None and self.trigger.exists():
            self.trigger = None
        return self.trigger is None and round_ >= self.from_round

    def __call__(self, honest: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        self.rounds += 1
        if self.spec.startswith("scale:"):
            return [tensor * self.factor for tensor in honest]
        if self.spec == "noise":
            noise = [torch.randn(tensor.shape, generator=self.generator) for tensor in honest]
            return [n * (t.norm() / n.norm().clamp(min=1e-12)) for n, t in zip(noise, honest)]
        if self.first_round is None:
            self.first_round = [tensor.clone() for tensor in honest]
        return [tensor.clone() for tensor in self.first_round]


def _say(attack: Contribution, what: str) -> None:
    print(f"Attack: {attack.spec} on {what} (round {attack.rounds})", flush=True)


def attack_diloco(attack: Contribution) -> None:
    """Replace the pseudo-gradient a diloco peer's outer step averages (hivetrain.outer_state.OuterState.outer_step)."""
    from hivetrain.outer_state import OuterState

    honest_outer_step = OuterState.outer_step

    def attacked_outer_step(self, local_parameters: Sequence[torch.Tensor], weight: float,
                            timeout: Optional[float], **kwargs):
        if timeout is None or not attack.started(self.round):  # alone: nobody to harm; or not yet
            return honest_outer_step(self, local_parameters, weight, timeout, **kwargs)
        with torch.no_grad():
            pseudo = [outer - local.detach().to("cpu", torch.float32)
                      for outer, local in zip(self.outer_parameters, local_parameters)]
            replaced = attack(pseudo)
            attacked_local = [outer - g for outer, g in zip(self.outer_parameters, replaced)]
        _say(attack, f"outer round {self.round}")
        return honest_outer_step(self, attacked_local, weight, timeout, **kwargs)

    OuterState.outer_step = attacked_outer_step


def attack_sync(attack: Contribution) -> None:
    """Replace the gradients a sync peer loads into its gradient averager before each all-reduce: the optimizer builds
    an attacker's averager (PatchedOptimizer.gradient_averager_class), answering under hivemind's name."""
    from hivemind.optim.grad_averager import GradientAverager

    from hivetrain.hivemind_internals import PatchedOptimizer, named_for_rpc_as

    @named_for_rpc_as(GradientAverager)
    class AttackedGradientAverager(GradientAverager):
        loads = 0

        @torch.no_grad()
        def load_accumulators_into_averager_(self) -> None:
            super().load_accumulators_into_averager_()
            self.loads += 1
            if not attack.started(self.loads - 1):  # one load per swarm epoch
                return
            with self.get_tensors() as averaged:
                for tensor, replaced in zip(averaged, attack([t.clone() for t in averaged])):
                    tensor.copy_(replaced)
            _say(attack, "gradients")

    PatchedOptimizer.gradient_averager_class = AttackedGradientAverager


def main(argv: Sequence[str], join_main: Callable[[list[str]], int]) -> int:
    if not argv:
        print(f"usage: python benchmarks/attacker.py {{{'|'.join(ATTACKS)}}}[@R|@PATH] [peers/join.py arguments]",
              file=sys.stderr)
        return 2
    try:
        attack = Contribution(argv[0])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    attack_diloco(attack)
    attack_sync(attack)
    return join_main(list(argv[1:]))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from the repository root
    from hivetrain.roles.peers import join

    sys.exit(main(sys.argv[1:], join.main))
