"""The relay suite: what leading the averaging rounds of peers that nobody can dial costs the coordinator
(hivetrain.roles.coordinator.relay), python -m benchmarks.bench relay.

Each peer of a swarm runs behind a NAT of its own (benchmarks.netns.NattedNamespace), so every trainer is in client
mode and the coordinator leads every round as hivemind's auxiliary peer, reducing all of it: diloco's outer rounds,
and sync's gradient all-reduce. Figures come from the coordinator's `relayed` events (the trainers in each round, its
wall time, the CPU time of the coordinator's averager process, the bytes it moved) and the peers' own events (diloco:
the group each round had; sync: the rounds each missed).
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Optional

from benchmarks.harness import MONITOR_ONLY, Process, start_coordinator, start_peer
from benchmarks.netns import NattedNamespace
from benchmarks.report import measured_by

# (preset, trainers, mode): diloco at two sizes of model, to tell the relay's cost per parameter from its cost per
# round, and sync's gradient rounds
RUNS = (("demo", 2, "diloco"), ("demo", 3, "diloco"), ("digits-vit-tiny", 2, "diloco"), ("demo", 2, "sync"))
ROUNDS, SMOKE_ROUNDS = 12, 4  # rounds (diloco: outer rounds, sync: swarm epochs) each peer takes (--stop-at-epoch)
INNER_STEPS = 8  # H: a round every few seconds here
MISSION = "cifar10-vit-b32"  # what the cost per parameter is carried over to
PEER_TIMEOUT = 600


def relay_suite(work: Path, smoke: bool) -> dict:
    unavailable = NattedNamespace.unavailable()
    if unavailable:
        raise RuntimeError(f"the relay suite needs network namespaces with NAT: {unavailable}")
    rounds = SMOKE_ROUNDS if smoke else ROUNDS
    results = [relay_run(work, preset, trainers, rounds, mode)
               for preset, trainers, mode in (RUNS[:1] if smoke else RUNS)]
    return dict(results=results, inner_steps=INNER_STEPS, mission=MISSION, mission_parameters=_parameters(MISSION),
                mission_value_bytes=_value_bytes(MISSION))


def relay_run(work: Path, preset: str, trainers: int, rounds: int, mode: str = "diloco") -> dict:
    """A coordinator of `preset` in `mode` and `trainers` peers, each behind its own NAT, taking `rounds` rounds: the
    rounds the coordinator relayed and what each cost it."""
    name = f"relay-{preset}-{trainers}-{mode}"
    swarm = ["--mode", "diloco", "--inner-steps", str(INNER_STEPS)] if mode == "diloco" else ["--mode", "sync"]
    nats: list[NattedNamespace] = []
    roles: list[Process] = []
    try:
        for index in range(trainers):
            nats.append(NattedNamespace(index + 1).create())
        coordinator, addresses = start_coordinator(
            work, name, [*MONITOR_ONLY, *swarm, "--refresh", "2"],
            preset=preset, host=nats[0].host_ip)
        roles.append(coordinator)
        peers = [start_peer(work, f"{name}-{index}", addresses, ["--threads", "1", "--min-peers", str(trainers),
                                                                   "--stop-at-epoch", str(rounds)],
                            prefix=nat.exec_prefix) for index, nat in enumerate(nats)]
        roles.extend(peers)
        for peer in peers:
            if peer.wait(timeout=PEER_TIMEOUT) != 0:
                raise RuntimeError(f"peer {peer.log} failed")
        relayed = [event for event in coordinator.events("relayed") if event["trainers"] == trainers]
        if not relayed:
            raise RuntimeError(f"the coordinator of {name} relayed no round of all {trainers}; see {coordinator.log}")
        together = min(_averaged_with_all(peer, trainers, rounds, mode) for peer in peers)
        result = dict(preset=preset, parameters=_parameters(preset), trainers=trainers, mode=mode, rounds=rounds,
                      relayed=len(relayed), averaged_together=together,
                      seconds_median=statistics.median(e["seconds"] for e in relayed),
                      cpu_seconds_median=statistics.median(e["cpu_seconds"] for e in relayed),
                      bytes_per_round=statistics.median(e["bytes"] for e in relayed))
        print(f"{preset}, {mode}, {trainers} trainers behind NAT: {len(relayed)} rounds relayed, each peer averaged"
              f" {together} of {rounds} with all; a round {result['seconds_median']:.2f} s, the relay's CPU"
              f" {result['cpu_seconds_median']:.2f} s", flush=True)
        return result
    finally:
        for role in reversed(roles):
            role.stop()
        for nat in nats:
            nat.delete()


def _averaged_with_all(peer: Process, trainers: int, rounds: int, mode: str) -> int:
    """The rounds `peer` averaged with all `trainers`: diloco's epoch events name each round's group; a sync peer
    counts the rounds it missed (it stepped with its own gradients), and in a group of all trainers none did."""
    if mode == "diloco":
        return sum(event.get("group_size") == trainers for event in peer.events("epoch"))
    return rounds - peer.event("left")["missed_rounds"]


def _parameters(preset: str) -> int:
    from hivetrain.config import get_preset
    from hivetrain.model import create_model

    config = get_preset(preset)
    model = create_model(dataclasses.replace(config.model, pretrained=False), seed=config.seed)
    return sum(parameter.numel() for parameter in model.parameters())


def _value_bytes(preset: str) -> int:
    from hivetrain.config import get_preset

    return {"none": 4, "fp16": 2, "8bit": 1}[get_preset(preset).swarm.grad_compression]


def relay_section(result: dict, env: dict, out: Path) -> str:
    rows = "".join(
        f"| `{r['preset']}` | {r.get('mode', 'diloco')} | {r['parameters']:,} | {r['trainers']} |"
        f" {r['relayed']} of {r['rounds']} |"
        f" {r['averaged_together']} | {r['seconds_median']:.2f} | {r['cpu_seconds_median']:.2f} |"
        f" {r['bytes_per_round'] / 1e6:.1f} |\n" for r in result["results"])
    return (
        "## relay\n\n"
        + measured_by(env) + f" Swarms of one torch thread per peer, each peer behind a NAT of its own, so that"
        " nobody can dial any trainer and the coordinator leads every round as hivemind's auxiliary peer"
        f" (hivetrain.roles.coordinator.relay): diloco's outer rounds (H = {result['inner_steps']} inner steps)"
        + (", and sync's gradient all-reduce at each swarm epoch" if any(r.get("mode") == "sync"
                                                                          for r in result["results"]) else "")
        + ". From the coordinator's `relayed` events (medians over the rounds it relayed with every trainer; CPU: its"
        " averager's process) and the peers' own events (the rounds each averaged with all the others: diloco's"
        " epoch events name each round's group; a sync peer's rounds are those it did not miss).\n\n"
        "| preset | mode | parameters | trainers | rounds relayed with all |"
        " rounds each peer averaged with all (fewest) | round (s) | relay CPU per round (s) |"
        " through the coordinator per round (MB) |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|\n" + rows + "\n" + _carried_over(result)
        + " The relay is a fallback for swarms without one reachable volunteer: a reachable peer leads the rounds"
        " itself and the coordinator then relays nothing.\n"
    )


@dataclasses.dataclass(frozen=True)
class RelayCapacity:
    """What the relay costs per unreachable trainer and round, carried over to the mission's model, and how many such
    trainers one coordinator serves at a round a minute (ROUND_EVERY_S)."""

    mission: str
    mission_parameters: int
    bytes_per_trainer: float  # through the coordinator per round: the trainer's copy in, the average back
    fixed_cpu_s: Optional[float] = None  # relay CPU per trainer and round: fixed + per_parameter x parameters
    per_parameter_cpu_s: Optional[float] = None

    @property
    def cpu_per_trainer_s(self) -> Optional[float]:
        if self.fixed_cpu_s is None:
            return None
        return self.fixed_cpu_s + self.per_parameter_cpu_s * self.mission_parameters

    @property
    def trainers_per_core(self) -> Optional[float]:
        return None if self.cpu_per_trainer_s is None else ROUND_EVERY_S / self.cpu_per_trainer_s

    @property
    def trainers_per_gigabit(self) -> float:
        return ROUND_EVERY_S * GIGABIT_BYTES_S / self.bytes_per_trainer


ROUND_EVERY_S = 60.0  # the pace the capacity is given at: a round a minute
GIGABIT_BYTES_S = 125e6  # a 1 Gbit/s link, each way


def relay_capacity(result: dict) -> RelayCapacity:
    """The relay's cost per trainer and round as a fixed part plus a part per parameter, fitted on the two-trainer
    diloco runs of two model sizes (the fixed and per-parameter parts are None with one size), carried over to the
    mission's model."""
    mission = result["mission_parameters"]
    capacity = RelayCapacity(result["mission"], mission, 2 * mission * result["mission_value_bytes"])
    pairs = sorted({r["parameters"]: r["cpu_seconds_median"] / r["trainers"] for r in result["results"]
                    if r["trainers"] == 2 and r.get("mode", "diloco") == "diloco"}.items())
    if len(pairs) < 2:
        return capacity
    (small, small_cpu), (large, large_cpu) = pairs[0], pairs[-1]
    per_parameter = max(0.0, (large_cpu - small_cpu) / (large - small))
    return dataclasses.replace(capacity, fixed_cpu_s=max(0.0, small_cpu - per_parameter * small),
                               per_parameter_cpu_s=per_parameter)


def _carried_over(result: dict) -> str:
    capacity = relay_capacity(result)
    moved = (f"Each round moves 2 x the model's size per trainer through the coordinator (its copy in, the average"
             f" back): {capacity.bytes_per_trainer / 1e6:.0f} MB per trainer for `{capacity.mission}`"
             f" ({capacity.mission_parameters:,} parameters, fp16).")
    if capacity.cpu_per_trainer_s is None:
        return moved + " (One model size measured: no cost per parameter to carry over.)"
    return (moved + f" The relay's CPU per trainer and round, fitted on the two-trainer diloco runs:"
            f" {capacity.fixed_cpu_s:.2f} s plus {capacity.per_parameter_cpu_s * 1e6:.3f} s per million parameters,"
            f" so about {capacity.cpu_per_trainer_s:.0f} s for `{capacity.mission}` (if reducing stays linear in"
            f" size). With a round a minute, one coordinator core keeps up with about"
            f" {capacity.trainers_per_core:.0f} trainers, and a 1 Gbit/s link with about"
            f" {capacity.trainers_per_gigabit:.0f}.")
