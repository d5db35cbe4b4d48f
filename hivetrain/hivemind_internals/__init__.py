"""Every use HiveTrain makes of hivemind's private API, in one place, written for the hivemind versions in
SUPPORTED_HIVEMIND_VERSIONS.

hivemind's public API does not reach everything a swarm of volunteers needs (hooks into how the optimizer builds its
tracker and averagers, a peer's own progress record, the signed-record formats, its log handler, the all-reduce's part
reducer). Its modules use
private names that may change in any release, so importing this package checks the installed version first and
refuses any other: a changed private name would otherwise fail deep inside a training run, or silently do nothing.
No module outside this package touches hivemind's private names (tests/test_hivemind_internals.py checks).

  runtime    tensor serialisation and command pipes (patched at import), hivemind's log handler, a direct dial
  records    progress records (a hooked tracker, a peer's own record) and signed records (formats, keys, signing)
  allreduce  the all-reduce's runner: answer streams closed by their sender, robust aggregation (part reducer)
  averaging  RPC names, steps held while they run, state servers, RPCs answered only for a private run's members,
             a shutdown that first sends groupmates their parts, and rounds whose peers are gone
  downloads  state downloads vetted before they are deserialised, and taken once a second holder (or the pinned
             coordinator) vouches for them
  optimizer  hivemind.Optimizer's factories and scheduling (PatchedOptimizer), a state averager's schedule
  dht        inside a DHT node (in its own process): key IDs, its storage and cache, routing table, pings, validator
             and authorizer

"""

from __future__ import annotations

import hivemind

SUPPORTED_HIVEMIND_VERSIONS = ("1.1.12",)


def check_hivemind_version(installed: str) -> None:
    """Refuse a hivemind version the private uses below were not written for."""
    if installed not in SUPPORTED_HIVEMIND_VERSIONS:
        raise ImportError(
            f"HiveTrain relies on hivemind internals (hivetrain/hivemind_internals/) written for hivemind "
            f"{' or '.join(SUPPORTED_HIVEMIND_VERSIONS)}, but hivemind {installed} is installed. Install a supported "
            f"version: pip install hivemind=={SUPPORTED_HIVEMIND_VERSIONS[-1]}")


# before the modules below: on another version, any of hivemind's names they import may be gone, and the message above
# says why
check_hivemind_version(hivemind.__version__)

from hivetrain.hivemind_internals.runtime import (ask_cuda_availability_once, dial, hivemind_log_handler,
                                                  is_averager_cut_short)  # noqa: E402
from hivetrain.hivemind_internals.records import (HookedProgressTracker, SIGNATURE_RE, SIGNED_SUBKEY_RE,
                                                  announce_and_count_peers, identity_key, progress_subkey,
                                                  rsa_key_from_der, sign_records_with, signature_checker,
                                                  write_identity)  # noqa: E402
from hivetrain.hivemind_internals.allreduce import (MIN_ROBUST_GROUP_SIZE, PartCopies, RobustAllReduceRunner,
                                                    RobustAveraging, RobustPartReducer)  # noqa: E402
from hivetrain.hivemind_internals.averaging import (GroupClosesWhenFull, JoinsStateServer, KeepsItsSteps, MembersOnly,
                                                    STATE_SERVER_JOIN_TIMEOUT, LEFT_ALONE_CHECK_S, LOOKING_CHECK_S,
                                                    members_only_class, named_for_rpc_as, robust_averager_class,
                                                    wait_unless_left_alone)  # noqa: E402
from hivetrain.hivemind_internals.downloads import (BoundedDownloads, BoundedStateAverager, MAX_STATE_ASKS,
                                                    STATE_AGREEMENT, STATE_BYTES_FACTOR, STATE_BYTES_SLACK,
                                                    asking_order, state_disagreement)  # noqa: E402
from hivetrain.hivemind_internals.optimizer import PatchedOptimizer, catch_up_schedule  # noqa: E402

__all__ = [
    "SUPPORTED_HIVEMIND_VERSIONS", "check_hivemind_version", "ask_cuda_availability_once", "dial",
    "hivemind_log_handler", "is_averager_cut_short", "HookedProgressTracker", "SIGNATURE_RE", "SIGNED_SUBKEY_RE",
    "announce_and_count_peers", "identity_key", "progress_subkey", "rsa_key_from_der", "sign_records_with",
    "signature_checker", "write_identity", "BoundedDownloads", "BoundedStateAverager",
    "GroupClosesWhenFull", "JoinsStateServer", "KeepsItsSteps", "MIN_ROBUST_GROUP_SIZE", "MembersOnly", "PartCopies",
    "RobustAllReduceRunner", "RobustAveraging", "RobustPartReducer", "MAX_STATE_ASKS", "STATE_AGREEMENT",
    "STATE_BYTES_FACTOR", "STATE_BYTES_SLACK", "asking_order", "state_disagreement",
    "STATE_SERVER_JOIN_TIMEOUT",
    "members_only_class", "named_for_rpc_as", "robust_averager_class", "LEFT_ALONE_CHECK_S", "LOOKING_CHECK_S",
    "wait_unless_left_alone",
    "PatchedOptimizer", "catch_up_schedule",
]
