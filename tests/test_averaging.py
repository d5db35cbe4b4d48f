"""One swarm step over two peers equals one local AdamW step on the union of their batches."""

import asyncio
import contextlib
import gc
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from hivemind.averaging.control import AveragingStage
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.mpfuture import MPFuture

from hivetrain.config import get_preset
from hivetrain.hivemind_internals import BoundedDownloads, BoundedStateAverager, RobustAveraging
from hivetrain.hivemind_internals.allreduce import ClosesAfterLastPart
from hivetrain.model import create_model
from hivetrain.optimizer import make_optimizer
from hivetrain.robust import RobustAggregation
from hivetrain.swarm_optimizer import wrap_optimizer
from hivetrain.swarm_options import HivemindOptions
from hivetrain.swarm import DHTOptions, start_dht


def _batch(seed: int, size: int, config):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(size, 3, config.model.img_size, config.model.img_size, generator=generator)
    labels = torch.randint(0, config.model.num_classes, (size,), generator=generator)
    return images, labels


def _assert_averagers_follow(options, optimizers) -> None:
    """Both averagers of every optimizer aggregate as the run's configuration says."""
    expected_aggregation = RobustAggregation.for_swarm(options)
    for opt in optimizers:
        for averager in (opt.grad_averager, opt.state_averager):
            assert isinstance(averager, RobustAveraging) == (expected_aggregation is not None)
            assert getattr(averager, "aggregation", None) == expected_aggregation
            # a robust averager forms no group of two, in which the robust aggregate is the plain mean
            assert averager.matchmaking_kwargs["min_group_size"] == (2 if expected_aggregation is None else 3)


@pytest.mark.parametrize("peers, robust_aggregation, matchmaking_time", [
    (2, "none", 2.0), (3, "centered-clip", 2.0), (2, "none", 40.0)], ids=["mean", "centered-clip", "long-window"])
def test_swarm_step_equals_local_step_on_union_batch(peers, robust_aggregation, matchmaking_time):
    """Also with centered-clip (which averages in groups of three or more), its radius wide enough that no honest
    gradient is clipped: the robust gradient and state averagers (hivemind_internals.PatchedOptimizer) then give the
    same step as the mean. With a matchmaking window of 40 s the step takes a fraction of it: the group closes once it
    holds every peer of the progress records (GroupClosesWhenFull), where hivemind's leader waited out the window."""
    config = get_preset("demo")
    b = 16
    batches = [_batch(seed, b, config) for seed in range(1, peers + 1)]

    reference = create_model(config.model, seed=config.seed)
    initial = {k: v.detach().clone() for k, v in reference.named_parameters()}
    optimizer, scheduler = make_optimizer(reference, config.optim)
    images = torch.cat([images for images, _ in batches])
    labels = torch.cat([labels for _, labels in batches])
    F.cross_entropy(reference(images), labels).backward()
    optimizer.step()

    options = HivemindOptions(
        run_id="test_union", target_batch_size=peers * b, batch_size=b, matchmaking_time=matchmaking_time,
        averaging_timeout=max(30.0, 2 * matchmaking_time),
        robust_aggregation=robust_aggregation, clip_radius=100.0,
    )
    first = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    dhts = [first] + [start_dht(DHTOptions(initial_peers=[str(a) for a in first.get_visible_maddrs()],
                                           host_maddrs=["/ip4/127.0.0.1/tcp/0"])) for _ in range(peers - 1)]
    models, optimizers = [], []
    try:
        for dht in dhts:
            model = create_model(config.model, seed=config.seed)
            torch_optimizer, torch_scheduler = make_optimizer(model, config.optim)
            models.append(model)
            # two peers in one process: each signs its progress with its own key
            optimizers.append(wrap_optimizer(options, dht, torch_optimizer, torch_scheduler, RSAPrivateKey()))
        _assert_averagers_follow(options, optimizers)

        # Each peer computes the gradients of its own batch and announces its b samples first, so that when it
        # steps, the swarm already holds all their samples and all average in one round (no timing luck involved).
        for model, opt, (x, y) in zip(models, optimizers, batches):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.tracker.report_local_progress(0, b)
        deadline = time.monotonic() + 30
        while min(opt.tracker.global_progress.samples_accumulated for opt in optimizers) < peers * b:
            assert time.monotonic() < deadline, "peers never saw each other's progress"
            time.sleep(0.2)

        threads = [threading.Thread(target=opt.step) for opt in optimizers]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60 + 2 * matchmaking_time)
        took = time.monotonic() - started
        assert [opt.local_epoch for opt in optimizers] == [1] * peers
        if matchmaking_time > 10:
            assert took < matchmaking_time / 2, f"the step took {took:.1f} s: its group waited for the window to end"

        for model in models:
            for (name, expected), actual in zip(reference.named_parameters(), model.parameters()):
                # Adam divides by the gradient's magnitude, which amplifies float rounding (2 batches of b vs one of
                # 2b) in near-zero gradients: compare whole update vectors. Without the virtual-step fix in
                # wrap_optimizer this ratio is ~0.25 for every parameter.
                step = expected - initial[name]
                assert (actual - expected).norm() <= 1e-3 * step.norm(), name
        # the step really moved the weights: the comparison above is not between two untouched models
        moved = sum((initial[name] - p).abs().sum().item() for name, p in models[0].named_parameters())
        assert moved > 1e-3
    finally:
        for opt in optimizers:
            opt.shutdown()
        for dht in reversed(dhts):
            dht.shutdown()


def test_non_finite_gradients_never_reach_the_swarm():
    """A peer whose loss turns NaN skips the step, counts no samples, and reloads the swarm's state. So does a peer
    behind the swarm (hivemind drops its step): neither step counts as this peer's contribution."""
    config = get_preset("demo")
    b = 16
    options = HivemindOptions(run_id="test_nan", target_batch_size=2 * b, batch_size=b, matchmaking_time=1.0,
                              averaging_timeout=5.0)
    first = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    second = start_dht(DHTOptions(initial_peers=[str(a) for a in first.get_visible_maddrs()],
                                  host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    optimizers = []
    try:
        models = [create_model(config.model, seed=config.seed) for _ in range(2)]
        for model, dht in zip(models, (first, second)):
            torch_optimizer, torch_scheduler = make_optimizer(model, config.optim)
            optimizers.append(wrap_optimizer(options, dht, torch_optimizer, torch_scheduler, RSAPrivateKey()))
        _assert_averagers_follow(options, optimizers)
        healthy, sick = optimizers

        def closure(model, seed, poison=1.0):
            def run():
                x, y = _batch(seed, b, config)
                loss = F.cross_entropy(model(x), y) * poison
                loss.backward()
                return loss
            return run

        # The healthy peer trains alone for a while, so the swarm's state differs from any fresh model.
        for seed in range(6):
            healthy.zero_grad()
            healthy.step(closure(models[0], seed))
        assert healthy.local_epoch >= 2
        deadline = time.monotonic() + 30
        while sick.tracker.global_epoch < healthy.local_epoch:  # the sick peer reads the swarm's progress records
            assert time.monotonic() < deadline, "the sick peer never saw the healthy one's epoch"
            time.sleep(0.1)
        sick.zero_grad()
        sick.step(closure(models[1], 50))  # at epoch 0: out of sync, so hivemind drops the step and loads the state
        assert sick.local_epoch == healthy.local_epoch and sick.samples_discarded == b
        sick.zero_grad()
        with torch.no_grad():  # the sick peer's own parameters went bad too
            next(models[1].parameters()).fill_(float("nan"))
        loss = sick.step(closure(models[1], 100, poison=float("nan")))
        assert not torch.isfinite(loss)
        assert sick.tracker.local_progress.samples_accumulated == 0  # nothing was counted toward the swarm's batch
        assert sick.samples_discarded == 2 * b
        for mine, theirs in zip(models[1].parameters(), models[0].parameters()):
            assert torch.isfinite(mine).all() and torch.equal(mine, theirs)  # the swarm's state, reloaded
        assert sick.local_epoch == healthy.local_epoch
    finally:
        for opt in optimizers:
            opt.shutdown()
        second.shutdown()
        first.shutdown()


def test_a_holders_offer_to_share_its_state_never_lapses_between_renewals():
    """A joiner asks the holders that offer their state in the DHT at that moment. hivemind renewed an offer only as it
    expired: a joiner reading meanwhile found no holder (a new volunteer started at epoch 0 beside the coordinator's
    state). Renewed at half its lifetime, the offer read at any moment has a good part of its lifetime left."""
    period = 2.0
    dht = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    holder = BoundedDownloads(averaged_tensors=[torch.zeros(4)], dht=dht, prefix="offer_test", start=True,
                              declare_state_period=period)
    try:
        holder.state_sharing_priority = 7.0
        own, left = holder.peer_id.to_bytes(), []

        def offer_left():  # seconds the holder's offer has left, None while none is there
            found = dht.get("offer_test.all_averagers", latest=True)
            entry = found.value.get(own) if found is not None and isinstance(found.value, dict) else None
            return entry.expiration_time - get_dht_time() if entry is not None and entry.value == 7.0 else None

        deadline = time.monotonic() + 30
        while offer_left() is None:
            assert time.monotonic() < deadline, "the holder never offered its state"
            time.sleep(0.05)
        end = time.monotonic() + 3 * period
        while time.monotonic() < end:
            left.append(offer_left())
            time.sleep(0.02)
        assert None not in left
        assert min(left) > period / 4, sorted(left)[:5]  # renewed at half its lifetime (expiring: near 0)
    finally:
        holder.shutdown()
        dht.shutdown()


def _wait_for_stage(controls, stage, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while any(control.stage != stage for control in controls):
        assert time.monotonic() < deadline, [control.stage for control in controls]
        time.sleep(0.02)


@contextlib.contextmanager
def _two_averagers(averager_class: type, size: int, **kwargs):
    """Two averagers of `averager_class` on two loopback DHTs joined to each other, averaging `size` values each of
    1.0 and of 3.0 (`kwargs`: the averager's own, beside the tests' matchmaking and timeouts); shut down at the end."""
    first = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    second = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                  initial_peers=[str(a) for a in first.get_visible_maddrs()]))
    averagers = [averager_class(averaged_tensors=[torch.full((size,), value)], dht=dht, start=True,
                                min_matchmaking_time=1.0, request_timeout=0.5, next_chunk_timeout=5.0, **kwargs)
                 for dht, value in ((first, 1.0), (second, 3.0))]
    try:
        yield averagers
    finally:
        for averager in averagers:
            averager.shutdown()
        second.shutdown()
        first.shutdown()


def test_a_part_sent_before_its_group_is_triggered_here_waits_for_it():
    """An overlapped peer looks for its next round's group while the last round's all-reduce still runs, and the
    groupmates trigger a round each at its own moment. hivemind turned away a part sent for a group this peer had
    found but not triggered yet whenever an earlier group had registered since (WaitsForItsGroup): both halves of
    the all-reduce then waited out their timeout and each peer kept part of its own tensors."""
    with _two_averagers(BoundedDownloads, 1000, prefix="late_trigger", target_group_size=2) as averagers:
        def schedule(ahead: float):
            at = get_dht_time() + ahead
            return [a.step(scheduled_time=at, timeout=20.0, require_trigger=True, wait=False) for a in averagers]

        earlier = schedule(1.5)
        _wait_for_stage(earlier, AveragingStage.AWAITING_TRIGGER)
        later = schedule(3.0)  # looked for ahead while the earlier round has yet to run (hivemind clears its event)
        for control in earlier:
            control.allow_allreduce()
        for control in earlier:
            control.result(timeout=20)  # registered, it sets the event that the later round cleared
        for averager, value in zip(averagers, (10.0, 20.0)):
            with averager.get_tensors() as (tensor,):
                tensor.fill_(value)
        _wait_for_stage(later, AveragingStage.AWAITING_TRIGGER)
        later[0].allow_allreduce()  # the first peer's part reaches the second before the second triggers
        time.sleep(1.0)
        later[1].allow_allreduce()
        for control in later:
            control.result(timeout=20)
        for averager in averagers:
            with averager.get_tensors() as (tensor,):
                assert torch.allclose(tensor, torch.full_like(tensor, 15.0)), tensor.unique()


class CollectsGarbage(BoundedDownloads):
    """A BoundedDownloads whose process can be told to run Python's garbage collector now (collect_garbage)."""

    def collect_garbage(self) -> None:
        future = MPFuture()
        self._outer_pipe.send(("_collect_garbage", [], dict(future=future)))  # as hivemind sends its own commands
        future.result(timeout=30)

    async def _collect_garbage(self, future: MPFuture) -> None:
        gc.collect()
        future.set_result(None)


def test_a_step_waiting_for_its_trigger_outlives_the_garbage_collector():
    """hivemind's averager process keeps no reference to a command's task, and a step waiting for its trigger is
    reachable only weakly (asyncio's tasks, hivemind's MPFutures): once the next command had run, a collection
    destroyed it, and its round never ran (KeepsItsSteps). Here the collector runs after each peer's next command."""
    with _two_averagers(CollectsGarbage, 100, prefix="collected") as averagers:
        at = get_dht_time() + 1.5
        controls = [a.step(scheduled_time=at, timeout=20.0, require_trigger=True, wait=False) for a in averagers]
        _wait_for_stage(controls, AveragingStage.AWAITING_TRIGGER)
        for averager in averagers:
            averager.collect_garbage()  # a command after the step's: it took the step's task's place
        for control in controls:
            control.allow_allreduce()
        for control in controls:
            control.result(timeout=20)
        for averager in averagers:
            with averager.get_tensors() as (tensor,):
                assert torch.allclose(tensor, torch.full_like(tensor, 2.0)), tensor.unique()


def test_a_peer_that_leaves_right_after_its_round_first_sends_a_client_groupmate_its_results():
    """A client-mode groupmate (a volunteer nobody can dial) gets its averaged parts only after it has sent all of its
    own, while the dialable peer's round ends once it holds its own: a peer that left right after its round shut its
    averager under the client's results, and the client kept its own values for most of its tensors, its round
    counted as averaged (AnswersBeforeLeaving)."""
    size = 1_000_000
    first = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    second = start_dht(DHTOptions(client_mode=True, initial_peers=[str(a) for a in first.get_visible_maddrs()]))
    common = dict(prefix="leaving", start=True, min_matchmaking_time=1.0, request_timeout=0.5, next_chunk_timeout=5.0,
                  target_group_size=2)
    leaver = BoundedDownloads(averaged_tensors=[torch.full((size,), 1.0)], dht=first, **common)
    client = BoundedDownloads(averaged_tensors=[torch.full((size,), 3.0)], dht=second, client_mode=True, **common)
    try:
        rounds = [averager.step(timeout=20.0, wait=False) for averager in (leaver, client)]
        assert rounds[0].result(timeout=30) is not None  # averaged with the client
        leaver.shutdown()  # at once, as a peer whose run ends there
        assert rounds[1].result(timeout=30) is not None
        with client.get_tensors() as (tensor,):
            assert torch.equal(tensor, torch.full_like(tensor, 2.0)), (tensor != 2.0).sum().item()
    finally:
        client.shutdown()
        if leaver.is_alive():
            leaver.shutdown()
        second.shutdown()
        first.shutdown()


def test_a_sender_closes_a_reducers_answer_stream_once_it_holds_every_part():
    """The reducer does not close its end after its last answer (the P2P daemon then resets the stream, and a sender
    slow to read lost its last parts: SenderClosedAllReduceRunner); the sender stops reading and closes the stream
    itself once it holds the parts it expects. An error code passes through as hivemind reads it."""
    closed = []

    async def answers(codes):
        try:
            for code in codes:
                yield averaging_pb2.AveragingData(code=code)
            await asyncio.sleep(3600)  # a reducer that keeps its end open (ANSWER_LINGER)
        finally:
            closed.append(len(codes))

    class Stub:
        def __init__(self, codes):
            self.codes = codes

        async def rpc_aggregate_part(self, inputs):
            return answers(self.codes)

    async def read(codes, parts):
        stream = await ClosesAfterLastPart(Stub(codes), parts).rpc_aggregate_part(None)
        return [message.code async for message in stream]

    part, error = averaging_pb2.AVERAGED_PART, averaging_pb2.INTERNAL_ERROR
    assert asyncio.run(asyncio.wait_for(read([part] * 3, 3), 10)) == [part] * 3
    assert closed == [3]
    assert asyncio.run(asyncio.wait_for(read([part, error, part], 2), 10)) == [part, error, part]
    assert closed == [3, 3]


def test_a_holder_serves_no_epoch_whose_step_is_still_running():
    """hivemind raises a holder's epoch before the epoch's optimizer step runs: a download in between was served
    epoch 1 with the parameters of epoch 0, a state the holder never held (CI, test_rollback in sync mode). The
    holder serves what it holds between two epochs only (ServesWholeEpochs)."""
    in_step, armed = threading.Event(), threading.Event()

    class SlowSGD(torch.optim.SGD):
        def step(self, closure=None):
            if armed.is_set():  # not hivemind's virtual step at start
                in_step.set()
                time.sleep(1.0)
            return super().step(closure)

    dht = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    parameter = torch.nn.Parameter(torch.zeros(4))
    holder = BoundedStateAverager(optimizer=lambda params: SlowSGD(params, lr=1.0), params=[parameter], dht=dht,
                                  prefix="whole_epoch_test", start=True)
    try:
        parameter.grad = torch.ones(4)
        armed.set()
        stepping = threading.Thread(target=holder.step, kwargs=dict(increment_epoch=True, optimizer_step=True))
        stepping.start()
        assert in_step.wait(30), "the optimizer step never ran"
        assert holder.local_epoch == 1  # hivemind's order: the epoch first, then the step
        metadata, tensors, _ = holder.get_current_state()
        served = tensors[0].tolist()  # read now: hivemind serves the parameter itself, which the step changes later
        stepping.join(30)
        assert (metadata["epoch"], served) == (1, [-1.0] * 4)  # epoch 1's parameters, stepped
    finally:
        holder.shutdown()
        dht.shutdown()
