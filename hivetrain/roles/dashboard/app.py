"""The HiveTrain dashboard: a live view of one swarm run, read from the coordinator's metrics store.

    streamlit run hivetrain/roles/dashboard/app.py -- [--store FILE] [--results DIR] [--refresh SECONDS]

Only the live part of the page (a Streamlit fragment) reruns on each refresh, so the scroll position, the sidebar
and any choice made on the page stay where the user left them. The store is opened read-only: watching a run can
never disturb it.
"""

import argparse
import sqlite3
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import altair as alt
import pandas as pd
import streamlit as st

from hivetrain.config import RunConfig
from hivetrain.formatting import fmt_bytes, fmt_pct, fmt_seconds
from hivetrain.metrics_store import (CheckpointRow, MetricsReader, PeerRow, RollbackRow, RunInfo, StoreError,
                                     StoreMissing, SwarmSnapshot, ValidationRow)
from hivetrain.run_result import RunResult, read_result

# A peer that left is marked so by the coordinator's first look without it ("left"). Until then: peers refresh their
# DHT record every 5 s and it lapses after 15 s, the coordinator looks every 10 s: within 30 s a peer is surely there.
# Up to 120 s it may only be slow to reach (a busy machine, a coordinator that stopped looking), after that it is gone.
ONLINE_S = 30
STALE_S = 120
PEER_COLUMNS = ["name", "peer", "hardware", "client mode", "samples/s", "contributed", "in swarm rounds", "last seen",
                "last seen (UTC)", "state"]
# what diloco peers report besides
DILOCO_COLUMNS = ["inner steps", "pseudo-gradient norm", "MB per round", "rounds averaged / alone / failed"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="HiveTrain dashboard")
    parser.add_argument("--store", type=Path, default=Path("runs/hivetrain-demo/metrics.sqlite"),
                        help="the coordinator's SQLite metrics store")
    parser.add_argument("--results", type=Path, default=Path("logbook/results"),
                        help="baseline run results (the defaults: a clone's, from its root)")
    parser.add_argument("--refresh", type=int, default=5, help="seconds between refreshes, 0 = off")
    return parser.parse_known_args(argv)[0]  # known only: Streamlit may leave its own arguments behind


# --- pure helpers -----------------------------------------------------------------------------------------------


def duration(seconds: float) -> str:
    """A coarse duration for people: 42 s, 4 min, 2 h, 3 d."""
    seconds = max(0, int(seconds))  # clocks of different machines differ: a time a little ahead reads as now
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"


def ago(seconds: float) -> str:
    return f"{duration(seconds)} ago"


def utc(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def shown_path(path: Path) -> str:
    """A path as people typed it: relative to the folder the dashboard runs in when it is inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def peer_state(last_seen: float, now: float, left_at: float | None = None) -> str:
    if left_at is not None:
        return "left"
    age = now - last_seen
    return "online" if age <= ONLINE_S else "stale" if age <= STALE_S else "gone"


def config_summary(config_json: str) -> str:
    try:
        config = RunConfig.from_json(config_json)
    except ValueError as e:
        return f"run configuration unreadable: {e}"
    swarm = config.swarm
    mode = (f"diloco: {swarm.inner_steps} inner steps per outer round, outer lr {swarm.outer_lr:g}, momentum"
            f" {swarm.outer_momentum:g}" if swarm.mode == "diloco" else f"sync: target batch {swarm.target_batch_size}")
    if swarm.target_group_size is not None:
        mode += f", averaging in groups of at most {swarm.target_group_size}"
    return (f"model {config.model.name} at {config.model.img_size} px · dataset {config.data.dataset} · {mode} · "
            f"per-step batch {config.batch_size} · lr {config.optim.lr:g}")


def is_diloco(config_json: str) -> bool:
    try:
        return RunConfig.from_json(config_json).swarm.mode == "diloco"
    except ValueError:
        return False


def peer_rows(peers: list[PeerRow], now: float) -> list[dict]:
    return [{"name": p.name, "peer": p.peer_id[:8] + "…", "hardware": p.hardware,
             "client mode": "yes" if p.client_mode else "no", "samples/s": round(p.samples_per_second, 1),
             "contributed": p.samples, "in swarm rounds": _share(p.swarm_seconds, p.train_seconds),
             "last seen": ago(now - p.last_seen), "last seen (UTC)": utc(p.last_seen),
             "state": peer_state(p.last_seen, now, p.left_at), "inner steps": p.inner_steps,
             "pseudo-gradient norm": None if p.pseudo_gradient_norm is None else round(p.pseudo_gradient_norm, 4),
             "MB per round": None if p.round_bytes is None else round(p.round_bytes / 1e6, 1),
             "rounds averaged / alone / failed": _rounds(p)} for p in peers]


def _rounds(p: PeerRow) -> str | None:
    counts = (p.rounds_averaged, p.rounds_alone, p.rounds_failed)
    return None if None in counts else " / ".join(map(str, counts))


def _share(part: float | None, whole: float | None) -> str | None:
    """The share of a peer's training time spent in swarm rounds and state downloads, e.g. "7%"."""
    return f"{part / whole:.0%}" if part is not None and whole else None


def leaderboard(peers: list[PeerRow]) -> list[dict]:
    total = sum(p.samples for p in peers)
    ranked = sorted(peers, key=lambda p: (-p.samples, p.name))
    return [{"rank": rank, "name": p.name, "samples contributed": p.samples,
             "share %": round(100 * p.samples / total, 1) if total else 0.0} for rank, p in enumerate(ranked, 1)]


def rollback_rows(rollbacks: list[RollbackRow]) -> list[dict]:
    return [{"at swarm epoch": r.epoch, "time": utc(r.time), "top-1": fmt_pct(r.top1), "loss": f"{r.loss:.4g}",
             "back to epoch": r.best_epoch, "its top-1": fmt_pct(r.best_top1), "served as epoch": r.restored_epoch}
            for r in rollbacks]


def checkpoint_rows(checkpoints: list[CheckpointRow], now: float) -> list[dict]:
    return [{"epoch": c.epoch, "uri": c.uri, "size": fmt_bytes(c.size_bytes),
             "top-1": fmt_pct(c.top1), "time": ago(now - c.time), "best": "★" if c.best else ""}
            for c in checkpoints]


def result_row(result: RunResult) -> dict:
    return {"run": result.name, "strategy": result.strategy, "world size": result.world_size,
            "global batch": result.global_batch_size, "samples/s": round(result.samples_per_s, 1),
            "best top-1": fmt_pct(result.best_top1), "wall time": fmt_seconds(result.wall_time_s),
            "peak memory": fmt_bytes(result.peak_rss_bytes or None)}


def swarm_row(run_id: str, peers: list[PeerRow], snapshots: list[SwarmSnapshot], best: ValidationRow | None) -> dict:
    """This run as a baselines row. Its speed is the mean over all snapshots, as a run result's is over its training;
    its wall time spans the snapshots, so a restarted coordinator does not reset it."""
    return {"run": run_id, "strategy": "swarm (this run)", "world size": len(peers),
            "global batch": snapshots[-1].target_batch_size if snapshots else None,
            "samples/s": round(sum(s.samples_per_second for s in snapshots) / len(snapshots), 1) if snapshots else None,
            "best top-1": fmt_pct(best.top1 if best else None),
            "wall time": fmt_seconds(snapshots[-1].time - snapshots[0].time) if snapshots else "–",
            "peak memory": "–"}  # peers do not report their memory to the coordinator


def load_results(directory: Path) -> tuple[list[RunResult], list[str]]:
    """The readable run results of a directory, and one message per file that is not."""
    results, problems = [], []
    for path in sorted(directory.glob("*.json")):
        try:
            results.append(read_result(path))
        except ValueError as e:  # names the file and the field
            problems.append(str(e))
    return results, problems


# --- reading the store ------------------------------------------------------------------------------------------


@dataclass
class RunView:
    run: RunInfo
    peers: list[PeerRow]
    snapshots: list[SwarmSnapshot]
    validations: list[ValidationRow]
    checkpoints: list[CheckpointRow]
    best: ValidationRow | None
    rollbacks: list[RollbackRow]


def read_store(path: Path) -> RunView | None:
    """Everything the page shows, or None while there is nothing to show: no store yet, or a coordinator that is
    still starting and has not written its run."""
    try:
        reader = MetricsReader(path)
    except StoreMissing:
        return None
    with reader:
        run = reader.run()
        if run is None:
            return None
        return RunView(run, reader.peers(), reader.snapshots(), reader.validations(), reader.checkpoints(),
                       reader.best_validation(), reader.rollbacks())


# --- rendering --------------------------------------------------------------------------------------------------


def show_live(store: Path, results_dir: Path) -> None:
    try:
        view = read_store(store)
    except StoreError as e:
        st.error(str(e))
        return
    except sqlite3.Error as e:  # not SQLite, or damaged: say so instead of a traceback
        st.error(f"Cannot read the metrics store {store}: {e}")
        return
    if view is None:
        st.info(f"Waiting for the coordinator: no metrics at {store} yet. Start one with "
                f"`python coordinator/start.py --preset demo --store {store}`; this page checks again by itself.")
        return
    now = time.time()
    show_overview(view, now)
    st.subheader("Peers")
    columns = PEER_COLUMNS + (DILOCO_COLUMNS if is_diloco(view.run.config_json) else [])
    st.dataframe(pd.DataFrame(peer_rows(view.peers, now), columns=columns), hide_index=True)
    show_contributions(view.peers)
    show_training(view.snapshots)
    show_validation(view.validations, view.best, view.rollbacks)
    show_checkpoints(view.checkpoints, now)
    show_baselines(view, results_dir)


def show_overview(view: RunView, now: float) -> None:
    run, latest, best = view.run, (view.snapshots[-1] if view.snapshots else None), view.best
    st.header("Swarm overview")
    st.markdown(f"Run **{run.run_id}** · preset **{run.preset}**")
    st.caption(config_summary(run.config_json))
    columns = st.columns(6)
    columns[0].metric("Outer round" if is_diloco(run.config_json) else "Swarm epoch", latest.epoch if latest else "–")
    columns[1].metric("Samples/s", f"{latest.samples_per_second:.1f}" if latest else "–")
    eta = latest.eta_seconds if latest else None
    columns[2].metric("Next epoch in", duration(eta) if eta is not None else "–")
    columns[3].metric("Alive peers", latest.alive_peers if latest else "–")
    columns[4].metric("Clients", latest.clients if latest else "–",
                      help="peers that cannot accept connections; they train but do not serve others")
    columns[5].metric("Best top-1", fmt_pct(best.top1) if best else "–",
                      delta=f"epoch {best.epoch}" if best else None, delta_color="off", delta_arrow="off")
    if latest:
        target = latest.target_batch_size  # 0: a round paced in seconds before the peers state their rates
        st.progress(min(latest.samples_accumulated / target, 1.0) if target else 0.0,
                    text=f"{latest.samples_accumulated}{f' of {target}' if target else ''} samples toward swarm epoch"
                         f" {latest.epoch + 1}")
        st.caption(f'<span title="{utc(latest.time)}">last updated {ago(now - latest.time)}</span>',
                   unsafe_allow_html=True)
    else:
        st.caption("No swarm snapshot yet: the coordinator writes one each time it looks at the swarm.")
    st.markdown("Join this run:")
    st.code(run.join_command, language="bash")


def show_contributions(peers: list[PeerRow]) -> None:
    st.subheader("Contributions")
    rows = pd.DataFrame(leaderboard(peers), columns=["rank", "name", "samples contributed", "share %"])
    left, right = st.columns(2)
    left.dataframe(rows, hide_index=True)
    if peers:
        right.altair_chart(alt.Chart(rows).mark_bar().encode(
            x=alt.X("samples contributed:Q"), y=alt.Y("name:N", sort="-x", title=None)))


def line_chart(data: pd.DataFrame, x: alt.X, y: str, title: str) -> alt.Chart:
    return alt.Chart(data, title=title, height=220).mark_line(point=True).encode(x=x, y=alt.Y(f"{y}:Q", title=None))


def show_training(snapshots: list[SwarmSnapshot]) -> None:
    st.subheader("Training")
    if not snapshots:
        st.caption("No swarm snapshot yet.")
        return
    data = pd.DataFrame({"time": [datetime.fromtimestamp(s.time, timezone.utc) for s in snapshots],
                         "mean loss": [s.mean_loss for s in snapshots],
                         "samples/s": [s.samples_per_second for s in snapshots],
                         "alive peers": [s.alive_peers for s in snapshots]})
    for column, y in zip(st.columns(3), ("mean loss", "samples/s", "alive peers")):
        column.altair_chart(line_chart(data, alt.X("time:T", title=None), y, y))


def show_validation(validations: list[ValidationRow], best: ValidationRow | None,
                    rollbacks: list[RollbackRow] = ()) -> None:
    st.subheader("Validation")
    if not validations or best is None:
        st.caption("No validation yet: the coordinator validates after each swarm epoch it is told to.")
        return
    st.markdown(f"Best top-1 **{fmt_pct(best.top1)}** at swarm epoch **{best.epoch}** ({utc(best.time)})")
    against = st.radio("Against", ["swarm epoch", "wall time"], horizontal=True)
    by_epoch = alt.X("epoch:Q", title="swarm epoch", axis=alt.Axis(format="d", tickMinStep=1))
    x = by_epoch if against == "swarm epoch" else alt.X("time:T", title="time")
    data = pd.DataFrame({"epoch": [v.epoch for v in validations],
                         "time": [datetime.fromtimestamp(v.time, timezone.utc) for v in validations],
                         "top-1": [v.top1 for v in validations], "top-5": [v.top5 for v in validations],
                         "loss": [v.loss for v in validations],
                         "best": [(v.time, v.epoch) == (best.time, best.epoch) for v in validations]})
    accuracy = alt.Chart(data, title="accuracy").transform_fold(["top-1", "top-5"], as_=["metric", "value"]).mark_line(
        point=True).encode(x=x, y=alt.Y("value:Q", title=None, axis=alt.Axis(format="%")), color="metric:N")
    best_point = alt.Chart(data[data["best"]]).mark_point(
        size=200, shape="diamond", filled=True, color="red").encode(x=x, y="top-1:Q", tooltip=["epoch", "top-1"])
    chart = accuracy + best_point
    if rollbacks:  # a rule where each validation that called for a rollback stands
        marks = pd.DataFrame({"epoch": [r.epoch for r in rollbacks],
                              "time": [datetime.fromtimestamp(r.time, timezone.utc) for r in rollbacks],
                              "rollback": [f"back to epoch {r.best_epoch}" for r in rollbacks]})
        chart += alt.Chart(marks).mark_rule(color="orange", strokeDash=[4, 2]).encode(x=x, tooltip=["rollback"])
    left, right = st.columns(2)
    left.altair_chart(chart)
    right.altair_chart(line_chart(data, x, "loss", "loss"))
    if rollbacks:
        st.markdown(f"**{len(rollbacks)} rollback{'s' if len(rollbacks) > 1 else ''}** to the best validated state"
                    f" (orange on the chart):")
        st.dataframe(pd.DataFrame(rollback_rows(rollbacks)), hide_index=True)


def show_checkpoints(checkpoints: list[CheckpointRow], now: float) -> None:
    st.subheader("Checkpoints")
    if not checkpoints:
        st.caption("No checkpoint yet.")
        return
    st.dataframe(pd.DataFrame(checkpoint_rows(checkpoints, now)), hide_index=True)


def show_baselines(view: RunView, results_dir: Path) -> None:
    st.subheader("Baselines")
    results, problems = load_results(results_dir)
    for problem in problems:
        st.warning(f"Skipped a run result: {problem}")
    same_preset = [r for r in results if r.preset == view.run.preset]
    if not same_preset:
        st.info(f"No baseline runs recorded for preset {view.run.preset} yet in {results_dir}. Run one with "
                f"`python baselines/run.py --strategy ddp --preset {view.run.preset} --result-dir {results_dir}`.")
        return
    rows = [result_row(r) for r in same_preset] + [swarm_row(view.run.run_id, view.peers, view.snapshots, view.best)]
    st.dataframe(pd.DataFrame(rows), hide_index=True)


def main() -> None:
    st.set_page_config(page_title="HiveTrain", layout="wide")
    args = parse_args(sys.argv[1:])
    st.title("HiveTrain")
    refresh = st.sidebar.number_input("Refresh every (seconds, 0 = off)", min_value=0, value=max(args.refresh, 0))
    st.sidebar.caption(f"Metrics store: `{shown_path(args.store)}`")
    st.sidebar.caption(f"Baseline results: `{shown_path(args.results)}`")
    # A fragment reruns alone on its timer; changing the interval reruns the page, which re-creates it.
    st.fragment(show_live, run_every=refresh or None)(args.store, args.results)


if __name__ == "__main__":  # Streamlit runs the script as __main__; tests import it for the helpers
    main()
