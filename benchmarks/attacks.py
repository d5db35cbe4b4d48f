"""The attacks suite of python -m benchmarks.bench: what one malicious volunteer in four does to a diloco run of the
demo preset under each defence, and what a defence costs when nobody attacks. Its section lands in
logbook/reliability.md, beside the faults a swarm survives.

Every run: a coordinator and four peers (one torch thread each, waiting for all four) that train `rounds` outer rounds
of INNER_STEPS inner steps and leave, the schedule stretched for four peers (hivetrain.config's
diloco_schedule_flags). In an attacked run the last of the four is benchmarks/attacker.py with the attack. Top-1: the
honest peers' saved weights on the whole validation split. Samples/s: each honest peer's samples over its training
time (its goodbye event), summed.

Robust aggregation (centered-clip, trimmed-mean) is a defence against every round; rollback is one against a run
that has already lost its good state. Its runs: the coordinator validates every swarm epoch with --rollback-drop, and
the attacker plays honest for ROLLBACK_FROM rounds first (ATTACK@R), so that there is a validated state to go back to.
Measured there: how long from the first poisoned state to every honest peer training on the restored one.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional

from benchmarks.harness import Process

PEERS = 4
INNER_STEPS = 8
# A smoke run's 4 rounds: the attacker, the fourth peer on two cores, can come to a round after the three honest
# peers averaged without it, and the smoke asks for one. A peer left out of one round may be left out of the next
# (hivemind_internals.LOOKING_CHECK_S): a round more gives it one more chance.
ROUNDS, SMOKE_ROUNDS = 8, 4
# and a smoke run's groups wait up to 5 s for a late peer (the demo preset's wait is 1 s): the smoke shares two cores
# with another test's swarm under `make test`, where the attacker joined none of its 4 rounds once
SMOKE_OPTIONS = ["--matchmaking-time", "5"]
ATTACKS = ("scale:-10", "scale:1000", "noise", "replay")  # benchmarks/attacker.py's, each with one factor
# the coordinator's options for each: the defaults, and CenteredClip at radius 1, its default until the suite showed
# that its fixed point, about radius / (honest peers) from the honest mean toward an attacker it clips, costs points
DEFENCES = {"none": [], "centered-clip": ["--robust-aggregation", "centered-clip"],
            "centered-clip-r1": ["--robust-aggregation", "centered-clip", "--clip-radius", "1"],
            "trimmed-mean": ["--robust-aggregation", "trimmed-mean"]}
# what the defences of results written before the suite recorded them meant at their commits (before dc48bea)
DEFENCES_BEFORE_DC48BEA = {"none": [], "centered-clip": ["--robust-aggregation", "centered-clip", "--clip-radius", "1"],
                           "centered-clip-r0.25": ["--robust-aggregation", "centered-clip", "--clip-radius", "0.25"],
                           "trimmed-mean": ["--robust-aggregation", "trimmed-mean"]}
ROLLBACK_DROP = 20  # top-1 points: the scale attacks drag an undefended run to about chance (10%)
ROLLBACK = ["--validate-every", "1", "--rollback-drop", str(ROLLBACK_DROP)]
ROLLBACK_FROM = 3  # the attacker's first malicious round in a rollback run
ROLLBACK_ATTACKS = ("scale:-10", "scale:1000")  # the attacks whose undefended runs fall further than ROLLBACK_DROP
# targets: a robust run within 2 points of the honest one; at most 10% slower; back on the restored state within one
# validation interval plus 10 s
TOP1_POINTS, OVERHEAD, ROLLBACK_SLACK_S = 2.0, 0.10, 10.0


def defended_run(work: Path, name: str, defence: str, attack: Optional[str], rounds: int,
                 coordinator_options: list[str]) -> tuple[dict, list[Process]]:
    """One run: `attack` (None: four honest peers) against a coordinator with `coordinator_options`; the honest
    peers' top-1 and samples/s, and the rounds the attacker averaged with the others (the coordinator's store), and
    the honest peers (stopped, their events kept)."""
    from benchmarks.harness import evaluate_weights, run_swarm
    from benchmarks.churn import peer_rows
    from hivetrain.config import diloco_schedule_flags, get_preset

    attacker = PEERS - 1 if attack is not None else None
    _, peers = run_swarm(
        work, name, PEERS,
        ["--mode", "diloco", "--inner-steps", str(INNER_STEPS), "--refresh", "2",
         *diloco_schedule_flags(get_preset("demo"), PEERS), *coordinator_options],
        ["--stop-at-epoch", str(rounds), "--save-weights", str(work / f"{name}-peer-{{index}}.safetensors")],
        timeout=900, programs={} if attacker is None else {attacker: ["benchmarks/attacker.py", attack]})
    honest = peers[:attacker]
    left = [peer.event("left") for peer in honest]
    attacker_rounds = None
    if attacker is not None:
        [row] = [p for p in peer_rows(work / name / "metrics.sqlite").values() if p.name == f"{name}-peer-{attacker}"]
        attacker_rounds = row.rounds_averaged or 0
    return dict(defence=defence, attack=attack, rounds=rounds, attacker_rounds=attacker_rounds,
                top1=evaluate_weights([work / f"{name}-peer-{i}.safetensors" for i in range(len(honest))]),
                samples_per_s=sum(event["samples"] / event["train_seconds"] for event in left)), honest


def rollback_recovery(validation_times: list[float], rollbacks: list[dict], honest: list[dict],
                      from_round: int) -> dict:
    """What a rollback run shows: `validation_times` and `rollbacks` (the coordinator's store, RollbackRow fields)
    and each honest peer's epoch and rollback events. Poisoned: the first epoch event of a state the attacker's round
    `from_round` went into (swarm epoch from_round + 1). Detected: the coordinator's first rollback. Back: the last
    honest peer's first rollback event (printed at its first step on the restored state). None where it never
    happened."""
    poisoned = min((event["time"] for peer in honest for event in peer["epochs"] if event["epoch"] > from_round),
                   default=None)
    firsts = [min((event["time"] for event in peer["rollbacks"]), default=None) for peer in honest]
    back = None if not firsts or None in firsts else max(firsts)
    detected = rollbacks[0]["time"] if rollbacks else None
    times = sorted(validation_times)

    def between(start: Optional[float], end: Optional[float]) -> Optional[float]:
        return None if start is None or end is None else end - start

    return dict(
        rollbacks=len(rollbacks),
        fell_to=rollbacks[0]["top1"] if rollbacks else None,
        restored_top1=rollbacks[0]["best_top1"] if rollbacks else None,
        detected_s=between(poisoned, detected), reloaded_s=between(detected, back), recovery_s=between(poisoned, back),
        validation_interval_s=statistics.median(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else None,
    )


def rollback_run(work: Path, attack: str, rounds: int) -> dict:
    from hivetrain.metrics_store import MetricsReader

    name = f"{attack.replace(':', '')}-rollback"
    run, honest = defended_run(work, name, "rollback", f"{attack}@{ROLLBACK_FROM}", rounds, ROLLBACK)
    with MetricsReader(work / name / "metrics.sqlite") as reader:
        validation_times = [row.time for row in reader.validations()]
        rollbacks = [vars(row) for row in reader.rollbacks()]
    events = [dict(epochs=peer.events("epoch"), rollbacks=peer.events("rollback")) for peer in honest]
    run.update(attack=attack, from_round=ROLLBACK_FROM,
               **rollback_recovery(validation_times, rollbacks, events, ROLLBACK_FROM))
    return run


def attacks_suite(work: Path, smoke: bool) -> dict:
    """Four honest peers under each defence, then each attack under each defence, then rollback against the attacks
    that need it. A smoke run: the honest run and scale:1000 under centered-clip, SMOKE_ROUNDS each (rollback has its
    end-to-end test in tests/test_rollback.py)."""
    rounds = SMOKE_ROUNDS if smoke else ROUNDS
    options = {defence: [*flags, *(SMOKE_OPTIONS if smoke else [])] for defence, flags in DEFENCES.items()}
    defences = ["centered-clip"] if smoke else list(DEFENCES)
    attacks = ATTACKS[1:2] if smoke else ATTACKS
    runs = []
    for defence in defences:
        runs.append(defended_run(work, f"honest-{defence}", defence, None, rounds, options[defence])[0])
        print(f"honest, {defence}: top-1 {min(runs[-1]['top1']):.3f}, {runs[-1]['samples_per_s']:.0f} samples/s",
              flush=True)
    for attack in attacks:
        for defence in defences:
            runs.append(defended_run(work, f"{attack.replace(':', '')}-{defence}", defence, attack, rounds,
                                     options[defence])[0])
            print(f"{attack}, {defence}: honest top-1 {min(runs[-1]['top1']):.3f} (the attacker averaged"
                  f" {runs[-1]['attacker_rounds']} rounds)", flush=True)
    rollbacks = []
    for attack in () if smoke else ROLLBACK_ATTACKS:
        rollbacks.append(rollback_run(work, attack, rounds))
        print(f"{attack}@{ROLLBACK_FROM}, rollback: {rollbacks[-1]['rollbacks']} rollback(s), back on the restored"
              f" state {rollbacks[-1]['recovery_s']} s after the first poisoned one", flush=True)
    return dict(preset="demo", peers=PEERS, inner_steps=INNER_STEPS, rounds=rounds, runs=runs, rollbacks=rollbacks,
                rollback_drop=ROLLBACK_DROP, defences={name: options[name] for name in defences})


def attacks_section(result: dict, env: dict, out: Path) -> str:
    from benchmarks.report import measured_by, verdict

    honest = {run["defence"]: run for run in result["runs"] if run["attack"] is None}

    def mean(run: dict) -> float:
        return sum(run["top1"]) / len(run["top1"])

    def points(run: dict) -> float:
        """An attacked run's mean top-1 against the better of the honest runs with no defence and with its own (one
        run each, and an honest run's top-1 varies by a few points from run to run: the better is the stricter
        bar); an honest run's against the one with no defence."""
        names = ("none",) if run["attack"] is None else ("none", run["defence"])
        bars = [mean(honest[name]) for name in names if name in honest] or [mean(honest[run["defence"]])]
        return 100 * (mean(run) - max(bars))

    rows = "".join(
        f"| {run['attack'] or 'none (4 honest peers)'} | {run['defence']} | {min(run['top1']):.1%} |"
        f" {mean(run):.1%} | {points(run):+.1f} |"
        f" {'–' if run['attacker_rounds'] is None else run['attacker_rounds']} | {run['samples_per_s']:.0f} |\n"
        for run in result["runs"])
    verdicts = []
    for defence, baseline in honest.items():
        if defence == "none":
            continue
        attacked = [run for run in result["runs"] if run["defence"] == defence and run["attack"] is not None]
        worst = min(attacked, key=points, default=None)
        if worst is not None:
            verdicts.append(f"{defence} keeps every attacked run within {TOP1_POINTS:.0f} top-1 points of the honest"
                            " run: " + verdict(-points(worst) <= TOP1_POINTS,
                                                f"worst {worst['attack']}, {points(worst):+.1f} points"))
        if "none" in honest:
            overhead = 1 - baseline["samples_per_s"] / honest["none"]["samples_per_s"]
            verdicts.append(f"{defence} costs an honest run at most {OVERHEAD:.0%} of its samples/s: "
                            + verdict(overhead <= OVERHEAD, f"{overhead:.1%}"))
    section = (
        "## attacks\n\n"
        f"{measured_by(env)} A coordinator and {result['peers']} peers of the `{result['preset']}`"
        f" preset (diloco, {result['inner_steps']} inner steps per round, one torch thread each, the schedule"
        f" stretched for {result['peers']} peers) train {result['rounds']} outer rounds; in an attacked run one of the"
        " four is `benchmarks/attacker.py ATTACK`: its pseudo-gradient times -10 or 1000, Gaussian noise of its norm,"
        " or its first round's again in every round. Top-1: the honest peers' final weights on the whole validation"
        " split (the worst of them, and their mean: a peer whose last round went unaveraged ends a few points apart)."
        " Points: an attacked run's mean against the better of two honest runs, the one with no defence and the one"
        " with the same defence (each row is one run, and honest runs differ by a few points from run to run: the"
        " better is the stricter bar); an honest run's against the one with no defence, which shows what the defence"
        " alone costs. Attacker"
        " rounds: the outer rounds it averaged with the others (the coordinator's store). Samples/s: the honest"
        " peers', summed, on a machine whose two cores all the roles share. Defences, as the coordinator's options: "
        + "; ".join(f"`{name}`: " + (f"`{' '.join(options)}`" if options else "none (hivemind's mean)")
                    for name, options in result.get("defences", DEFENCES_BEFORE_DC48BEA).items()
                    if name in honest) + ".\n\n"
        "| attack | defence | worst honest top-1 | mean honest top-1 | points against the honest run | attacker"
        " rounds | samples/s |\n|---|---|---:|---:|---:|---:|---:|\n"
        f"{rows}\n" + "".join(f"- {verdict}\n" for verdict in verdicts)
    )
    if not result.get("rollbacks"):
        return section

    def figure(value: Optional[float], form: str) -> str:
        return "never" if value is None else format(value, form)

    rollback_rows = "".join(
        f"| {run['attack']}@{run['from_round']} | {run['rollbacks']} | {figure(run['fell_to'], '.1%')} |"
        f" {figure(run['restored_top1'], '.1%')} | {figure(run['detected_s'], '.1f')} |"
        f" {figure(run['reloaded_s'], '.1f')} | {figure(run['recovery_s'], '.1f')} |"
        f" {figure(run['validation_interval_s'], '.1f')} |\n" for run in result["rollbacks"])
    late = [run for run in result["rollbacks"] if run["recovery_s"] is None or run["validation_interval_s"] is None
            or run["recovery_s"] > run["validation_interval_s"] + ROLLBACK_SLACK_S]
    worst = max(result["rollbacks"], key=lambda run: run["recovery_s"] or float("inf"))
    return section + (
        "\n### rollback\n\n"
        f"The same runs with no robust aggregation, but a coordinator that validates every swarm epoch with"
        f" `--rollback-drop {result['rollback_drop']}`: a validation more than {result['rollback_drop']} top-1 points"
        " below the best sends the swarm back to the best validated state. The attacker plays honest for its first"
        f" {result['rollbacks'][0]['from_round']} rounds (`ATTACK@R`), so that there is a good state to lose, and"
        " attacks in every round after. Top-1 fell to: the validation that called the first rollback. Restored: the"
        " best validated top-1, the state the peers went back to. Seconds from the first poisoned state (an honest"
        " peer's first swarm epoch that the attacker's round went into) to the coordinator's rollback (detected), from"
        " there to the last honest peer's first step on the restored state (reloaded; the peers' rollback events), and"
        " in all. Validation interval: the median time between the coordinator's validations (it validates the"
        " newest state it can download, so it can skip epochs). Rollback restores a state; it does not stop an"
        " attacker who stays, whose later rounds poison the run again (robust aggregation, above, is the defence for"
        " those).\n\n"
        "| attack | rollbacks | top-1 fell to | restored top-1 | detected (s) | reloaded (s) | in all (s) |"
        " validation interval (s) |\n|---|---:|---:|---:|---:|---:|---:|---:|\n"
        f"{rollback_rows}\n"
        f"- Every honest peer trains on the restored state within one validation interval plus"
        f" {ROLLBACK_SLACK_S:.0f} s of the first poisoned one: "
        + verdict(not late, f"worst {worst['attack']}, {figure(worst['recovery_s'], '.1f')} s against"
                   f" {figure(worst['validation_interval_s'], '.1f')} + {ROLLBACK_SLACK_S:.0f} s") + "\n"
    )
