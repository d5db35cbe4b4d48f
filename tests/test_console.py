"""A volunteer's console: one line per swarm event. hivemind's records of ordinary events lose their tracebacks but
keep what happened; --verbose (no filter) keeps them."""

import logging
import subprocess
import sys
from concurrent.futures import InvalidStateError

from hivemind.averaging.partition import AllreduceException
from hivemind.utils import logging as hivemind_logging

from hivetrain.swarm import one_line_per_event, quiet_shutdown


def _record(message: str, error: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(error), error, error.__traceback__) if error is not None else None
    return logging.LogRecord("hivemind.averaging.averager", logging.ERROR, __file__, 1, message, None, exc_info)


def _raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as caught:
        return caught


def test_hivemind_events_print_one_line_each():
    one_line_per_event()
    one_line_per_event()  # once is enough: a second call adds nothing
    handler = hivemind_logging._default_handler
    assert sum(type(f).__name__ == "_OneLinePerEvent" for f in handler.filters) == 1

    failed = _record("Averaging step failed: could not find a group",
                     _raised(AllreduceException("Averaging step failed: could not find a group")))
    assert handler.filter(failed) and failed.exc_info is None
    assert handler.format(failed).count("\n") == 0 and "could not find a group" in handler.format(failed)

    # An exception logged with a message of its own keeps what it says, on the same line.
    refused = _record("Failed to load state from peer", _raised(ConnectionRefusedError("connection refused")))
    assert handler.filter(refused)
    line = handler.format(refused)
    assert "\n" not in line and "Failed to load state from peer (ConnectionRefusedError: connection refused)" in line

    # The announcement before a download goes: the line after it says where from and how long it took.
    assert not handler.filter(_record("Downloading parameters from peer QmSomeone"))
    assert handler.filter(_record("Finished downloading state in 0.1s from QmSomeone"))


def test_a_round_this_peer_cancelled_prints_no_traceback_when_hivemind_ends_it_anyway():
    """A round this peer gave up (its group gone) ends in hivemind's averager all the same, which then fails to set
    the cancelled step's result: asyncio printed "Task exception was never retrieved" and a traceback at the peer's
    console (seen at test_rollback's "Outer round 7: alone"). Dropped; any other InvalidStateError still shows."""
    quiet_shutdown()
    asyncio_logger = logging.getLogger("asyncio")

    def never_retrieved(error: BaseException) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "Task exception was never retrieved", None,
                                 (type(error), error, error.__traceback__))

    cancelled = _raised(InvalidStateError("Can't set_result to a future that is CANCELLED (6374766791104387902)"))
    assert not asyncio_logger.filter(never_retrieved(cancelled))
    finished = _raised(InvalidStateError("Can't set_result to a future that is FINISHED (6374766791104387902)"))
    assert asyncio_logger.filter(never_retrieved(finished))


# A role whose daemon thread is inside torch when it leaves (as hivemind's state server can be): the interpreter's
# finalization aborted such a process after its goodbye, exit code -6 in place of its own.
ROLE_LEAVING_BUSY = """
import atexit, sys, threading, time
from pathlib import Path
import torch
from hivetrain.swarm import run_role

matrix = torch.randn(512, 512)

def spin():
    while True:
        torch.mm(matrix, matrix)

def finish_writing():
    time.sleep(0.5)
    Path(sys.argv[2]).write_text("written")

def work():
    threading.Thread(target=spin, daemon=True).start()
    threading.Thread(target=finish_writing).start()  # not a daemon: the exit waits for it
    atexit.register(print, "exit handlers ran", flush=True)
    time.sleep(0.2)
    return int(sys.argv[1])

run_role(work, farewell="Left.")
"""


def test_a_role_leaves_with_its_own_code_while_a_daemon_thread_is_inside_torch(tmp_path):
    for code in (0, 3, 0):
        written = tmp_path / f"written-{code}"
        done = subprocess.run([sys.executable, "-c", ROLE_LEAVING_BUSY, str(code), str(written)], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == code, done.stderr[-2000:]
        assert "terminate called" not in done.stderr
        # what the interpreter's exit does first still happens: threads that are not daemons end, exit handlers run
        assert written.read_text() == "written" and done.stdout.splitlines() == ["exit handlers ran"]
