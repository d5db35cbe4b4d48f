"""The attacks suite of python -m benchmarks.bench: what one malicious volunteer in four does to a diloco run of the
demo preset under each defence, and what a defence costs when nobody attacks. Its section lands in
logbook/reliability.md, beside the faults a swarm survives.

Every run: a coordinator and four peers (one torch thread each, waiting for all four) that train DEFENCE_ROUNDS outer
rounds of INNER_STEPS inner steps and leave, the schedule stretched for four peers (hivetrain.config's
diloco_schedule_flags). In an attacked run one of the four is benchmarks/attacks.py with the attack. Top-1: the
honest peers' saved weights on the whole validation split. Samples/s: each honest peer's samples over its training
time (its goodbye event), summed.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness import Process, start_coordinator, start_peer

PEERS = 4
INNER_STEPS = 8
ROUNDS, SMOKE_ROUNDS = 8, 2
ATTACKS = ("scale:-10", "scale:1000", "noise", "replay")  # benchmarks/attacks.py's, each with one factor
DEFENCES = {"none": [], "centered-clip": ["--robust-aggregation", "centered-clip"]}
TOP1_POINTS, OVERHEAD = 2.0, 0.10  # targets: a defended run within 2 points of the honest one; at most 10% slower


def defended_run(work: Path, name: str, defence: str, attack: str | None, rounds: int) -> dict:
    """One run: `attack` (None: four honest peers) under `defence`; the honest peers' top-1 and samples/s, and the
    rounds the attacker averaged with the others (the coordinator's store)."""
    from benchmarks.bench import MONITOR_ONLY, evaluate_weights
    from benchmarks.churn import peer_rows
    from hivetrain.config import diloco_schedule_flags, get_preset

    roles: list[Process] = []
    try:
        coordinator, addresses = start_coordinator(work, name, [
            *MONITOR_ONLY, "--mode", "diloco", "--inner-steps", str(INNER_STEPS), "--refresh", "2",
            *diloco_schedule_flags(get_preset("demo"), PEERS), *DEFENCES[defence]])
        roles.append(coordinator)
        honest = PEERS - (attack is not None)
        common = ["--threads", "1", "--min-peers", str(PEERS), "--stop-at-epoch", str(rounds), "--progress-bar", "off"]
        peers = [start_peer(work, f"{name}-peer-{i}", addresses, [
            *common, "--seed", str(i), "--save-weights", str(work / f"{name}-peer-{i}.safetensors")])
            for i in range(honest)]
        roles += peers
        if attack is not None:
            roles.append(Process(["benchmarks/attacks.py", attack, "--initial-peers", *addresses, "--name",
                                  f"{name}-attacker", *common, "--seed", str(honest)], work / f"{name}-attacker.log",
                                 events=work / f"{name}-attacker.events"))
        for role in roles[1:]:
            if role.wait(timeout=600) != 0:
                raise RuntimeError(f"a peer of {name} failed (exit code {role.popen.returncode}); see {role.log}")
        left = [peer.event("left") for peer in peers]
        top1 = evaluate_weights([work / f"{name}-peer-{i}.safetensors" for i in range(honest)])
        attacker_rounds = None
        if attack is not None:
            [row] = [p for p in peer_rows(work / name / "metrics.sqlite").values() if p.name == f"{name}-attacker"]
            attacker_rounds = row.rounds_averaged or 0
        return dict(defence=defence, attack=attack, rounds=rounds, top1=top1, attacker_rounds=attacker_rounds,
                    samples_per_s=sum(event["samples"] / event["train_seconds"] for event in left))
    finally:
        for role in reversed(roles):
            role.stop()


def attacks_suite(work: Path, smoke: bool) -> dict:
    """Four honest peers under each defence, then each attack under each defence. A smoke run: the honest run and
    scale:1000 under centered-clip, two rounds each."""
    rounds = SMOKE_ROUNDS if smoke else ROUNDS
    defences = ["centered-clip"] if smoke else list(DEFENCES)
    attacks = ATTACKS[1:2] if smoke else ATTACKS
    runs = []
    for defence in defences:
        runs.append(defended_run(work, f"honest-{defence}", defence, None, rounds))
        print(f"honest, {defence}: top-1 {min(runs[-1]['top1']):.3f}, {runs[-1]['samples_per_s']:.0f} samples/s",
              flush=True)
    for attack in attacks:
        for defence in defences:
            runs.append(defended_run(work, f"{attack.replace(':', '')}-{defence}", defence, attack, rounds))
            print(f"{attack}, {defence}: honest top-1 {min(runs[-1]['top1']):.3f} (the attacker averaged"
                  f" {runs[-1]['attacker_rounds']} rounds)", flush=True)
    return dict(preset="demo", peers=PEERS, inner_steps=INNER_STEPS, rounds=rounds, runs=runs)


def attacks_section(result: dict, env: dict, out: Path) -> str:
    from benchmarks.bench import _measured_by, _verdict

    honest = {run["defence"]: run for run in result["runs"] if run["attack"] is None}
    rows = "".join(
        f"| {run['attack'] or 'none (4 honest peers)'} | {run['defence']} | {min(run['top1']):.1%} |"
        f" {sum(run['top1']) / len(run['top1']):.1%} |"
        f" {100 * (min(run['top1']) - min(honest[run['defence']]['top1'])):+.1f} |"
        f" {'–' if run['attacker_rounds'] is None else run['attacker_rounds']} | {run['samples_per_s']:.0f} |\n"
        for run in result["runs"])
    verdicts = []
    for defence, baseline in honest.items():
        if defence == "none":
            continue
        attacked = [run for run in result["runs"] if run["defence"] == defence and run["attack"] is not None]
        worst = min(attacked, key=lambda run: min(run["top1"]), default=None)
        if worst is not None:
            drop = 100 * (min(baseline["top1"]) - min(worst["top1"]))
            verdicts.append(f"{defence} keeps every attacked run within {TOP1_POINTS:.0f} top-1 points of the honest"
                            " one: " + _verdict(drop <= TOP1_POINTS, f"worst {worst['attack']}, {drop:.1f} points"))
        if "none" in honest:
            overhead = 1 - baseline["samples_per_s"] / honest["none"]["samples_per_s"]
            verdicts.append(f"{defence} costs an honest run at most {OVERHEAD:.0%} of its samples/s: "
                            + _verdict(overhead <= OVERHEAD, f"{overhead:.1%}"))
    return (
        "## attacks\n\n"
        f"{_measured_by('attacks', env)} A coordinator and {result['peers']} peers of the `{result['preset']}`"
        f" preset (diloco, {result['inner_steps']} inner steps per round, one torch thread each, the schedule"
        f" stretched for {result['peers']} peers) train {result['rounds']} outer rounds; in an attacked run one of the"
        " four is `benchmarks/attacks.py ATTACK`: its pseudo-gradient times -10 or 1000, Gaussian noise of its norm,"
        " or its first round's again in every round. Top-1: the honest peers' final weights on the whole validation"
        " split (the worst of them, and their mean), and the worst against the honest run under the same defence."
        " Attacker rounds: the outer rounds it averaged with the others (the coordinator's store). Samples/s: the"
        " honest peers', summed, on a machine whose two cores all the roles share.\n\n"
        "| attack | defence | worst honest top-1 | mean honest top-1 | points against honest | attacker rounds |"
        " samples/s |\n|---|---|---:|---:|---:|---:|---:|\n"
        f"{rows}\n" + "".join(f"- {verdict}\n" for verdict in verdicts)
    )
