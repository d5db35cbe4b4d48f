"""A last peer's state handed to the coordinator before it leaves (hivetrain.hand_over): the wait's rule with a clock
the test writes, and a run whose only peer stops at an epoch the coordinator would not have validated, after which a
joiner starts from that very state."""

import time

import pytest

from conftest import start_coordinator
from hivetrain.clock import ClockRecord
from hivetrain.hand_over import hand_over_state


def _clock(held, published: float = 100.0):
    return ClockRecord(run_id="run", epoch=7, time=published, held=held)


def _now():  # the DHT's time in these tests: the coordinator published its clock 1 s ago
    return 101.0


@pytest.mark.parametrize("clock, others", [(None, False), (_clock(3, published=1.0), False), (_clock(None), False),
                                           (_clock(7), False), (_clock(9), False), (_clock(3), True)],
                         ids=["no coordinator", "a coordinator gone", "it takes no states", "it holds this one",
                              "it holds a newer one", "others train on"])
def test_nothing_is_handed_over_when_nobody_needs_it(clock, others):
    lines = []
    assert hand_over_state(7, lambda: clock, lambda: others, lines.append, timeout=5, now=_now) is None
    assert lines == []


def test_a_last_peer_waits_until_the_coordinator_holds_its_state():
    reads, lines = [], []

    def read_clock():  # the coordinator takes the state at its third look
        reads.append(time.monotonic())
        return _clock(7 if len(reads) >= 3 else 5)

    assert hand_over_state(7, read_clock, lambda: False, lines.append, timeout=30, now=_now) is True
    assert lines == ["Handing this peer's state (swarm epoch 7) to the coordinator before leaving: no other peer"
                     " trains, and the coordinator holds swarm epoch 5 (up to 30 s; Ctrl-C leaves now)",
                     "The coordinator holds this peer's last state (swarm epoch 7)"]
    assert len(reads) == 3


def test_a_coordinator_that_never_takes_the_state_costs_the_timeout_and_one_line_more():
    lines = []
    started = time.monotonic()
    assert hand_over_state(7, lambda: _clock(5), lambda: False, lines.append, timeout=1.5, now=_now) is False
    assert 1.5 <= time.monotonic() - started < 5
    assert lines[1:] == ["The coordinator did not take this peer's state within 2 s: it holds swarm epoch 5"]


def test_a_coordinator_that_stops_publishing_ends_the_wait():
    """Its clock lives on in the DHT a while (a minute) after it stopped: a last peer does not wait that out."""
    reads, lines = [], []

    def read_clock():  # a fresh clock at the first two reads, then only the last one it published, aging
        reads.append(None)
        return _clock(5)

    times = iter([101.0, 102.0, 140.0])
    assert hand_over_state(7, read_clock, lambda: False, lines.append, timeout=30, now=lambda: next(times)) is False
    assert lines[1:] == ["The coordinator stopped publishing its clock: leaving; it holds swarm epoch 5"]
    assert len(reads) == 3


MODES = {"sync": ["--mode", "sync"],
         "diloco-overlapped": ["--mode", "diloco", "--inner-steps", "8", "--overlap-rounds"]}


@pytest.mark.parametrize("mode", MODES)
def test_the_run_keeps_its_last_peers_state_after_it_left(spawn, tmp_path, mode):
    """The coordinator validates once at first (--validate-every 100), so the state of epoch 4 is not due: before,
    the peer left with it and the run went on from the coordinator's older one."""
    coordinator, addresses = start_coordinator(spawn, tmp_path, "--preset", "demo", *MODES[mode], "--validate-every",
                                               "100", "--threads", "1")
    common = ("--host", "127.0.0.1", "--initial-peers", *addresses, "--threads", "1")
    last = spawn("last", "peers/join.py", *common, "--name", "last", "--stop-at-epoch", "4",
                 events=tmp_path / "last.jsonl")
    digest = last.wait_for(r"^swarm epoch 4 \|.* \| params (\w+)$", timeout=150).group(1)
    last.wait_for(r"^Handing this peer's state \(swarm epoch 4\) to the coordinator before leaving: .*$", timeout=30)
    last.wait_for(r"^The coordinator holds this peer's last state \(swarm epoch 4\)$", timeout=60)
    assert last.wait(timeout=60) == 0
    assert last.wait_for_event("hand_over", timeout=5)["held"] is True
    coordinator.wait_for(r"^validation at swarm epoch 4: ", timeout=30)  # the last state, validated

    joiner = spawn("joiner", "peers/join.py", *common, "--name", "joiner", "--max-steps", "1")
    joiner.wait_for(rf"^Starting at swarm epoch 4 \| params {digest}$", timeout=120)
