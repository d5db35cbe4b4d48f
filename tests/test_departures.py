"""Peers that leave stop counting at once, and peers that die soon: a peer that leaves cleanly withdraws its progress
record and its offer to share state before it exits, and a killed peer's records lapse within RECORD_LIFETIME, so the
others neither wait for it in a round's target nor ask it for the state. In both swarm modes, on loopback."""

import re
import threading
import time

import hivemind
import pytest
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.optim.progress_tracker import LocalTrainingProgress
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from conftest import dht_entries, live_entries, record_reader, start_coordinator
from hivetrain.config import get_preset
from hivetrain.hivemind_internals import (LEFT_ALONE_CHECK_S, LOOKING_CHECK_S, HookedProgressTracker,
                                          announce_and_count_peers, wait_unless_left_alone)
from hivetrain.outer_state import outer_state_prefix
from hivetrain.record_guard import others_epochs, vetted
from hivetrain.swarm import RECORD_LIFETIME
from hivetrain.telemetry import PEER_RECORD_TTL, metrics_key

RUN_ID = get_preset("demo").run_id
EPOCH_LINE = re.compile(r"^swarm epoch (\d+) \| (\d+) peer\(s\)")
MODES = {"sync": ("--mode", "sync"), "diloco": ("--mode", "diloco", "--inner-steps", "4")}


def _live(dht, key: str) -> dict[bytes, object]:
    """The records under `key` that are not withdrawn, by peer id: the progress records' values carry it, the offers to
    share state have it as their subkey."""
    found = dht.get(key, latest=True, return_future=True).result(timeout=30)
    if found is None or not isinstance(found.value, dict):
        return {}
    live = {subkey: entry.value for subkey, entry in found.value.items() if entry.value is not None}
    if key.endswith("_progress"):
        return {value["peer_id"]: value for value in live.values()}
    return live


def _epoch_lines(process, since: int = 0) -> list[tuple[int, int]]:
    """(epoch, peers) of each epoch line from line number `since` on."""
    return [(int(m.group(1)), int(m.group(2))) for line in list(process.lines)[since:] if (m := EPOCH_LINE.match(line))]


def _wait_for_line(process, since: int, condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not any(condition(epoch, peers) for epoch, peers in _epoch_lines(process, since)):
        assert process.popen.poll() is None, f"{process.log} exited"
        assert time.monotonic() < deadline, f"no such epoch line within {timeout} s; log {process.log}"
        time.sleep(0.2)


@pytest.mark.parametrize("mode", list(MODES))
def test_departed_peers_stop_counting(spawn, tmp_path, mode):
    _, addresses = start_coordinator(spawn, tmp_path, "--preset", "demo", *MODES[mode], "--refresh", "1")
    common = ("--host", "127.0.0.1", "--initial-peers", *addresses, "--threads", "1", "--min-peers", "3")
    peers = {name: spawn(name, "peers/join.py", *common, "--name", name) for name in ("a", "b", "c")}
    for process in peers.values():
        process.wait_for(r"^swarm epoch \d+ \| 3 peer\(s\)", timeout=240)
    progress_key = f"{RUN_ID}_progress"
    sharing_key = (f"{outer_state_prefix(RUN_ID)}.all_averagers" if mode == "diloco"
                   else f"{RUN_ID}_state_averager.all_averagers")
    dht = record_reader(addresses)
    try:
        training = _live(dht, progress_key)  # peer id of each peer counted in the swarm's progress
        assert len(training) == 3

        # A clean leave (SIGTERM, as a notebook's stop button): c's records are withdrawn by the time it has exited,
        # seconds before they could lapse: it is no longer counted, and no longer offers its state.
        peers["c"].stop()
        assert peers["c"].popen.returncode == 0
        still = _live(dht, progress_key)
        assert len(still) == 2 and set(still) < set(training)
        (left,) = set(training) - set(still)
        assert left not in _live(dht, sharing_key)
        # its last metrics record says it left (or is gone with it): the coordinator and the dashboard count it out at
        # their next look
        metrics = [value for value, _ in dht_entries(dht, metrics_key(RUN_ID)) if value is not None]
        assert "c" not in [value["name"] for value in metrics if not value.get("left")]

        # Killed without a word: b's records were refreshed within their lifetime and lapse within it.
        peers["b"].kill()
        killed_at = get_dht_time()
        # (live ones: c's withdrawals outlive their lifetime on purpose, to beat a report its tracker stored meanwhile)
        for key in (progress_key, sharing_key):
            assert all(expiration <= killed_at + RECORD_LIFETIME + 1
                       for value, expiration in dht_entries(dht, key) if value is not None)
        metrics = dht_entries(dht, metrics_key(RUN_ID))
        assert all(expiration <= killed_at + PEER_RECORD_TTL + 1 for _, expiration in metrics)
        # ...and a goes on, alone once b's record has lapsed.
        since = len(peers["a"].lines)
        _wait_for_line(peers["a"], since, lambda epoch, peers_: peers_ == 1, timeout=RECORD_LIFETIME + 120)
        assert live_entries(dht, progress_key) == 1
    finally:
        dht.shutdown()


def _round_control() -> StepControl:
    """An averaging round's control as hivemind's averager hands it out, for a round that never finds its group."""
    # the averager's trigger and cancel futures, made first: hivemind starts its futures' backend on the class of the
    # process's first MPFuture, and a StepControl first would start it on StepControl alone
    trigger, cancel = MPFuture(), MPFuture()
    control = StepControl(scheduled_time=get_dht_time(), deadline=float("inf"), allow_retries=False, weight=1.0,
                          data_for_gather=b"")
    control.attach(trigger, cancel)
    return control


def test_a_round_looks_whether_to_end_more_often_while_it_looks_for_its_group():
    """A round asks whether it should end every LOOKING_CHECK_S while it looks for its group, and every
    LEFT_ALONE_CHECK_S once the group formed: a peer left out of a group must give up its search within a fraction of
    the others' matchmaking time, or its next round's search begins after that group formed too (the attacks smoke's
    attacker averaged none of its 3 rounds in one run of 10)."""
    control, asked = _round_control(), []
    control.stage = AveragingStage.LOOKING_FOR_GROUP

    def ask() -> bool:
        asked.append(time.monotonic())
        if len(asked) == 4:  # the group formed: the all-reduce runs
            control.stage = AveragingStage.RUNNING_ALLREDUCE
        return len(asked) == 6

    began = time.monotonic()
    assert wait_unless_left_alone(control, ask, timeout=60.0) and control.cancelled()
    looking, running = asked[3] - began, asked[5] - asked[3]
    assert 4 * LOOKING_CHECK_S <= looking < 4 * LOOKING_CHECK_S + 1.0, asked
    assert 2 * LEFT_ALONE_CHECK_S <= running < 2 * LEFT_ALONE_CHECK_S + 1.0, asked


def test_a_round_the_other_peer_left_is_given_up_at_once(cleanup):
    """A swarm of two: the other peer leaves (withdrawing its progress record) while this one's round looks for it.
    hivemind waited for the group until the averaging timeout; the round (a sync peer's gradient round, a diloco
    peer's outer round) is now cancelled within about LEFT_ALONE_CHECK_S of the withdrawal, and not before it."""
    dht = hivemind.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    cleanup.append(dht)
    tracker = vetted(HookedProgressTracker)(dht, "left-alone", target_batch_size=64, start=False)
    announce_and_count_peers(dht, tracker)  # its own record: a read without it tells nothing of who is gone
    signer = RSASignatureValidator(RSAPrivateKey())  # the other peer, which signs its record as hivemind's do
    other = hivemind.DHT(initial_peers=[str(a) for a in dht.get_visible_maddrs()], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                         record_validators=[signer], start=True)
    cleanup.append(other)
    record = LocalTrainingProgress(peer_id=other.peer_id.to_bytes(), epoch=3, samples_accumulated=8,
                                   samples_per_second=1.0, time=get_dht_time(), client_mode=False)
    assert other.store(tracker.training_progress_key, record.dict(), get_dht_time() + 60,
                       subkey=signer.local_public_key)
    control, outcome = _round_control(), []  # a round that never finds its group

    def wait() -> None:
        outcome.append(wait_unless_left_alone(control, lambda: others_epochs(tracker, timeout=10.0) == [], timeout=60.0))

    waiting = threading.Thread(target=wait)
    waiting.start()
    time.sleep(3 * LEFT_ALONE_CHECK_S)
    assert waiting.is_alive() and not control.done()  # the other peer is there: the round goes on
    withdrawn = time.monotonic()
    assert other.store(tracker.training_progress_key, None, get_dht_time() + 60, subkey=signer.local_public_key)
    waiting.join(timeout=30)
    assert outcome == [True] and control.cancelled()
    assert time.monotonic() - withdrawn < 3 * LEFT_ALONE_CHECK_S
