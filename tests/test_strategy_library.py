"""HivemindStrategy as a library piece: anyone's LightningModule, as the library guide (docs/library.md) shows it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from hivetrain import DHTOptions, HivemindOptions, HivemindStrategy
from hivetrain.swarm_optimizer import wrap_optimizer
from hivetrain.swarm import start_dht

ROOT = Path(__file__).resolve().parent.parent
GUIDE = "docs/library.md"
GUIDE_SECTION = "## Your own LightningModule in a swarm"


def _readme_example() -> str:
    """The first Python block of the library guide's section on bringing your own LightningModule."""
    guide = (ROOT / GUIDE).read_text()
    assert GUIDE_SECTION in guide, f"{GUIDE} has no section {GUIDE_SECTION!r}"
    section = guide.split(GUIDE_SECTION, 1)[1]
    match = re.search(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert match is not None, f"no Python block under {GUIDE_SECTION!r}"
    return match.group(1)


def test_readme_example_trains_in_a_swarm(tmp_path):
    """The guide's example runs as written, in a fresh process, and takes every step it asks for."""
    script = tmp_path / "example.py"
    script.write_text(_readme_example() + "\nprint(f'trained {trainer.global_step} steps')\n")
    env = {key: value for key, value in os.environ.items() if key != "HIVETRAIN_INITIAL_PEERS"}  # a swarm of its own
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "trained 40 steps" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


def test_package_exports_the_strategy_without_importing_it_for_config():
    """`from hivetrain import HivemindStrategy` works, and `import hivetrain.config` (what the roles import first, to
    parse their arguments) still loads neither hivemind nor Lightning."""
    probe = (
        "import sys, hivetrain.config\n"
        "heavy = sorted(m for m in ('hivemind', 'lightning', 'torch') if m in sys.modules)\n"
        "from hivetrain import DHTOptions, HivemindOptions, HivemindStrategy\n"
        "from hivetrain.strategy import HivemindStrategy as Defined\n"
        "print(heavy, HivemindStrategy is Defined, DHTOptions.__module__, HivemindOptions.__module__)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["[]", "True", "hivetrain.swarm", "hivetrain.swarm_options"]


class _Regression(pl.LightningModule):
    """A user's module, nothing of HiveTrain's: a linear layer, SGD with momentum and an LR schedule per step."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self.layer(inputs), targets)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9 ** step)
        return dict(optimizer=optimizer, lr_scheduler=dict(scheduler=scheduler, interval="step"))


def _regression_data(batch_size: int) -> torch.utils.data.DataLoader:
    inputs = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    return torch.utils.data.DataLoader(data, batch_size=batch_size)


class _WhileTraining(pl.Callback):
    """What the strategy had put in place while the module trained."""

    def on_train_start(self, trainer, pl_module):
        self.own_zero_grad = "optimizer_zero_grad" in vars(pl_module)
        self.optimizer_types = [type(optimizer) for optimizer in trainer.optimizers]
        self.scheduler_configs = len(trainer.lr_scheduler_configs)
        self.learning_rates = []  # the module's optimizer's, at the start of each batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.learning_rates.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_end(self, trainer, pl_module):
        self.swarm_epoch = getattr(trainer.strategy, "local_epoch", None)  # before teardown ends the swarm


def _fit(module: pl.LightningModule, strategy, steps: int, callbacks=(), **trainer_options) -> _WhileTraining:
    seen = _WhileTraining()
    # no accelerator flag: Lightning refuses one beside a strategy instance that has its accelerator from a fit before
    trainer = pl.Trainer(strategy=strategy, max_steps=steps, max_epochs=-1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[seen, *callbacks], **trainer_options)
    trainer.fit(module, _regression_data(batch_size=16))
    seen.trainer = trainer
    return seen


def test_teardown_gives_back_what_the_strategy_replaced():
    """The same module fits twice with one HivemindStrategy, then with Lightning's own strategy: after each swarm fit
    the module's optimizer_zero_grad is its class's again, and the trainer's optimizers and schedulers are the
    module's own."""
    torch.set_num_threads(1)
    module = _Regression()
    strategy = HivemindStrategy(
        # reuse_grad_buffers: the strategy replaces the module's optimizer_zero_grad while it trains
        HivemindOptions(run_id="test_refit", target_batch_size=32, batch_size=16, matchmaking_time=0.5,
                        reuse_grad_buffers=True),
        network=DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]),
    )
    for _ in range(2):
        seen = _fit(module, strategy, steps=4)
        assert seen.own_zero_grad and seen.scheduler_configs == 0  # replaced while it trained: hivemind steps it
        assert [t.__name__ for t in seen.optimizer_types] == ["SwarmOptimizer"]
        assert "optimizer_zero_grad" not in vars(module)
        assert module.optimizer_zero_grad.__func__ is pl.LightningModule.optimizer_zero_grad
        assert [type(optimizer) for optimizer in seen.trainer.optimizers] == [torch.optim.SGD]
        configs = seen.trainer.lr_scheduler_configs
        assert [type(config.scheduler) for config in configs] == [torch.optim.lr_scheduler.LambdaLR]
        assert configs[0].scheduler.optimizer is seen.trainer.optimizers[0]

    before = [param.detach().clone() for param in module.parameters()]
    seen = _fit(module, "auto", steps=3)  # Lightning's single-device strategy, which zeroes gradients every step
    assert not seen.own_zero_grad
    assert all(not torch.equal(old, new) for old, new in zip(before, module.parameters()))
    (config,) = seen.trainer.lr_scheduler_configs
    assert config.scheduler.last_epoch == 3  # Lightning stepped the module's schedule at every step
    assert seen.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.9 ** 3)


def _step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def _sequential(optimizer):
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=2),
        torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.7),
    ], milestones=[2])


# Each builds a scheduler on an SGD optimizer with lr 0.1 and momentum 0.9; 5 swarm epochs cross their milestones,
# warmups and cycles.
SCHEDULES = {
    "StepLR": _step_lr,
    "MultiStepLR": lambda optimizer: torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[1, 3], gamma=0.3),
    "ExponentialLR": lambda optimizer: torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.8),
    "CosineAnnealingLR": lambda optimizer: torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=4, eta_min=0.01),
    "OneCycleLR": lambda optimizer: torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.5, total_steps=8),
    "LinearLR": lambda optimizer: torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.2, total_iters=3),
    "LambdaLR": lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1 / (1 + epoch)),
    "SequentialLR": _sequential,
    "ChainedScheduler": lambda optimizer: torch.optim.lr_scheduler.ChainedScheduler(
        [_step_lr(optimizer), torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)]),
    "CyclicLR": lambda optimizer: torch.optim.lr_scheduler.CyclicLR(optimizer, base_lr=0.01, max_lr=0.1, step_size_up=2),
}
SWARM_EPOCHS = 5


def _sgd(model: torch.nn.Module) -> torch.optim.SGD:
    # two param groups, as modules that exempt biases from weight decay have
    return torch.optim.SGD([dict(params=[model.weight], weight_decay=1e-4), dict(params=[model.bias])], lr=0.1,
                           momentum=0.9)


def _scheduled(groups) -> list[float]:
    """The hyperparameters a schedule sets: each param group's LR and momentum."""
    return [value for group in groups for value in (group["lr"], group["momentum"])]


@pytest.fixture(scope="module")
def two_dhts():
    first = start_dht(DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    second = start_dht(DHTOptions(initial_peers=[str(a) for a in first.get_visible_maddrs()],
                                  host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    yield first, second
    second.shutdown()
    first.shutdown()


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_any_torch_schedule_follows_swarm_epochs(name, two_dhts):
    """A peer's LR (and momentum, for the cyclic schedules) after k swarm epochs is the schedule's k-th value, as the
    same scheduler stepped k times on a plain torch optimizer gives it; a peer that joins then and loads the swarm's
    state has the same. (Before SwarmSchedule the joiner of a recursive schedule, StepLR say, applied the k steps a
    second time on top of the learning rates it loaded.)"""
    torch.set_num_threads(1)
    make_schedule = SCHEDULES[name]
    reference_optimizer = _sgd(torch.nn.Linear(4, 1))
    reference = make_schedule(reference_optimizer)
    expected = []  # after 0, 1, ..., k steps
    for _ in range(SWARM_EPOCHS):
        expected.append(_scheduled(reference_optimizer.param_groups))
        reference_optimizer.step()
        reference.step()
    expected.append(_scheduled(reference_optimizer.param_groups))

    batch = 8
    options = HivemindOptions(run_id=f"test_schedule_{name}", target_batch_size=batch, batch_size=batch,
                              matchmaking_time=0.5)
    inputs = torch.randn(batch, 4, generator=torch.Generator().manual_seed(0))
    peers = []
    try:
        model = torch.nn.Linear(4, 1)
        optimizer = _sgd(model)
        first = wrap_optimizer(options, two_dhts[0], optimizer, make_schedule(optimizer), RSAPrivateKey())
        peers.append(first)
        seen = {0: _scheduled(first.opt.param_groups)}  # swarm epoch: what the peer's inner optimizer had
        for _ in range(4 * SWARM_EPOCHS):  # alone in the swarm, each step of the target batch ends a swarm epoch
            if first.local_epoch == SWARM_EPOCHS:
                break
            first.zero_grad()
            model(inputs).square().mean().backward()
            first.step()
            seen[first.local_epoch] = _scheduled(first.opt.param_groups)
        assert seen == {epoch: pytest.approx(values) for epoch, values in enumerate(expected)}

        joining_model = torch.nn.Linear(4, 1)
        joining_optimizer = _sgd(joining_model)
        joiner = wrap_optimizer(options, two_dhts[1], joining_optimizer, make_schedule(joining_optimizer),
                                RSAPrivateKey())
        peers.append(joiner)
        joiner.load_state_from_peers()
        assert joiner.local_epoch == SWARM_EPOCHS
        assert _scheduled(joiner.opt.param_groups) == pytest.approx(expected[-1])
        assert torch.equal(joining_model.weight, model.weight)  # it did load the swarm's state
    finally:
        for peer in peers:
            peer.shutdown()


class _PlateauRegression(_Regression):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
        return dict(optimizer=optimizer, lr_scheduler=dict(scheduler=scheduler, monitor="train_loss"))


@pytest.mark.parametrize("mode", ["sync", "diloco"])
def test_reduce_on_plateau_is_refused_with_what_to_use_instead(mode):
    strategy = HivemindStrategy(
        HivemindOptions(run_id=f"test_plateau_{mode}", target_batch_size=32, batch_size=16, mode=mode),
        network=DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]),
    )
    with pytest.raises(ValueError, match="cannot follow ReduceLROnPlateau.*Use a schedule of the step count"):
        _fit(_PlateauRegression(), strategy, steps=2)


class _Manual(_Regression):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()


class _Configured(_Regression):
    """_Regression whose configure_optimizers returns what `make(module)` builds."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def configure_optimizers(self):
        return self.make(self)

    def lr_scheduler_step(self, scheduler, metric):  # how Lightning takes a scheduler that is not torch's
        scheduler.step()


class _OwnSchedule:
    """A scheduler of the user's own, not torch's."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _two_schedulers(module):
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 2), torch.optim.lr_scheduler.StepLR(optimizer, 3)]


def _own_scheduler(module):
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    return dict(optimizer=optimizer, lr_scheduler=dict(scheduler=_OwnSchedule(optimizer)))


# (Lightning itself refuses several optimizers without manual optimization, and a scheduler of an optimizer that
# configure_optimizers did not return.)
REFUSED = {
    "manual optimization": (_Manual, "needs automatic optimization.*Return the loss from training_step"),
    "two schedulers": (lambda: _Configured(_two_schedulers), "at most one LR scheduler.*SequentialLR"),
    "a scheduler of its own": (lambda: _Configured(_own_scheduler), "_OwnSchedule"),
}


@pytest.mark.parametrize("mode", ["sync", "diloco"])
@pytest.mark.parametrize("what", REFUSED)
def test_what_a_swarm_cannot_train_is_refused_at_setup(what, mode):
    make_module, message = REFUSED[what]
    strategy = HivemindStrategy(
        HivemindOptions(run_id=f"test_refused_{mode}", target_batch_size=32, batch_size=16, mode=mode),
        network=DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]),
    )
    with pytest.raises(ValueError, match=message):
        _fit(make_module(), strategy, steps=2)


@pytest.mark.parametrize("mode", ["sync", "diloco"])
def test_gradient_accumulation_counts_every_batch_toward_the_swarm(mode):
    """Two batches of 16 per optimizer step: 4 steps are 128 samples, two swarm epochs of 64 (sync) or two rounds of
    2 inner steps (diloco) for a peer alone; counting one batch per step would make one. Blocking rounds: an
    overlapped round due at the last step is still in flight when training ends, and lands as the peer leaves."""
    torch.set_num_threads(1)
    strategy = HivemindStrategy(
        HivemindOptions(run_id=f"test_accumulate_{mode}", target_batch_size=64, batch_size=16, matchmaking_time=0.5,
                        mode=mode, inner_steps=2, overlap_rounds=False),
        network=DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]),
    )
    seen = _fit(_Regression(), strategy, steps=4, accumulate_grad_batches=2)
    assert len(seen.learning_rates) == 8  # batches
    assert seen.swarm_epoch == 2
    assert strategy.options.batch_size == 16  # put back at teardown


class _RecordingRegression(_Regression):
    """_Regression that records the dtype its layer computed in and each loss."""

    def __init__(self):
        super().__init__()
        self.output_dtypes, self.losses = set(), []

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        outputs = self.layer(inputs)
        self.output_dtypes.add(outputs.dtype)
        loss = torch.nn.functional.mse_loss(outputs.float(), targets)
        self.losses.append(loss.item())
        return loss


def _mixed_precision_fit(precision: str, name: str = "") -> tuple[_RecordingRegression, _WhileTraining, list]:
    """Six steps of a fresh _RecordingRegression alone in a swarm, in Trainer's `precision`."""
    torch.set_num_threads(1)
    module = _RecordingRegression()
    before = [param.detach().clone() for param in module.parameters()]
    strategy = HivemindStrategy(
        HivemindOptions(run_id=f"test_precision_{name or precision}", target_batch_size=32, batch_size=16,
                        matchmaking_time=0.5),
        network=DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]),
    )
    return module, _fit(module, strategy, steps=6, precision=precision), before


def _assert_trained_in_bfloat16(module, seen, before):
    assert module.output_dtypes == {torch.bfloat16}  # autocast ran the layer in bf16
    assert len(module.losses) == 6 and all(torch.isfinite(torch.tensor(module.losses)))
    assert seen.swarm_epoch == 3  # alone, two steps of 16 samples make each swarm epoch of 32
    assert all(param.dtype == torch.float32 for param in module.parameters())  # the weights stay fp32
    assert all(not torch.equal(old, new) for old, new in zip(before, module.parameters()))


def test_a_generic_module_trains_in_bf16_mixed():
    module, seen, before = _mixed_precision_fit("bf16-mixed")
    assert seen.trainer.precision == "bf16-mixed"
    _assert_trained_in_bfloat16(module, seen, before)


def test_16_mixed_on_cpu_is_refused_by_lightning_for_bf16_mixed():
    """Lightning has no fp16 AMP on CPU for Trainer(precision="16-mixed"): it says so and trains in bf16-mixed, without
    hivemind's fp16 gradient scaler. (Its plugin still runs fp16 on CPU: the test below takes the scaler's path.)"""
    with pytest.warns(UserWarning, match=re.escape("AMP with fp16 is not supported on CPU. Using "
                                                   "`precision='bf16-mixed'` instead.")):
        module, seen, before = _mixed_precision_fit("16-mixed")
    assert seen.trainer.precision == "bf16-mixed"
    assert getattr(seen.trainer.precision_plugin, "scaler", None) is None
    _assert_trained_in_bfloat16(module, seen, before)


class _ScalerInUse(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        self.scaler = trainer.precision_plugin.scaler
        self.scale = self.scaler.get_scale()


def test_16_mixed_steps_with_unscaled_gradients_through_hiveminds_scaler():
    """fp16 with hivemind's gradient scaler, the path of volunteers' GPUs without bf16 (Colab's T4). Lightning has no
    fp16 AMP on CPU, but its plugin for the CPU runs it: autocast in fp16, the loss scaled before backward, and the
    swarm's step on unscaled gradients."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    torch.manual_seed(0)  # the same start and batches every run: how many first steps overflow depends on them
    fp32, _, before = _mixed_precision_fit("32-true", name="fp32-reference")
    scaler = _ScalerInUse()
    module = _RecordingRegression()
    module.layer.weight.data.copy_(before[0])  # where the fp32 run started
    module.layer.bias.data.copy_(before[1])
    strategy = HivemindStrategy(
        HivemindOptions(run_id="test_precision_16_mixed", target_batch_size=32, batch_size=16, matchmaking_time=0.5),
        network=DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]),
    )
    seen = _fit(module, strategy, steps=6, plugins=[MixedPrecision("16-mixed", "cpu")], callbacks=[scaler])
    assert module.output_dtypes == {torch.float16}  # autocast ran the layer in fp16
    assert type(scaler.scaler).__module__.startswith("hivemind") and scaler.scaler.is_enabled()
    assert scaler.scale > 1  # the loss was scaled before backward
    # AMP skips the first steps, whose scaled gradients overflow fp16, and halves the scale each time (hivemind counts
    # none of their samples): fewer swarm steps than fp32's 3, each on unscaled gradients. Scaled ones (by 8192 at
    # least) would move the weights thousands of times as far as fp32's steps, or to inf.
    assert 1 <= seen.swarm_epoch < 3
    for fp16, reference, start in zip(module.parameters(), fp32.parameters(), before):
        assert torch.isfinite(fp16).all() and not torch.equal(fp16, start)
        assert (fp16 - start).norm() < (reference - start).norm()


class _ScheduledRegression(_Regression):
    """_Regression with SGD at lr 0.1 and a given torch scheduler, which the module asks Lightning to step per epoch
    (diloco steps it per inner step all the same)."""

    def __init__(self, make_schedule):
        super().__init__()
        self.make_schedule = make_schedule

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return dict(optimizer=optimizer, lr_scheduler=dict(scheduler=self.make_schedule(optimizer), interval="epoch"))


DILOCO_SCHEDULES = {
    "StepLR": lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5),
    "CosineAnnealingLR": lambda optimizer: torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=6, eta_min=0.01),
    "OneCycleLR": lambda optimizer: torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.5, total_steps=10),
}


@pytest.mark.parametrize("name", sorted(DILOCO_SCHEDULES))
def test_diloco_steps_any_torch_schedule_per_inner_step(name):
    """In diloco mode the module's scheduler steps after every inner step, whatever interval the module asked for,
    and the rounds (every 3 inner steps, alone) keep it there: the LR of inner step i is the schedule's i-th value.
    Blocking rounds: an overlapped round due at step 6 may still be in flight when step 7, the last, ends."""
    torch.set_num_threads(1)
    make_schedule = DILOCO_SCHEDULES[name]
    reference_optimizer = torch.optim.SGD(torch.nn.Linear(8, 1).parameters(), lr=0.1, momentum=0.9)
    reference = make_schedule(reference_optimizer)
    expected = []
    for _ in range(7):
        expected.append(reference_optimizer.param_groups[0]["lr"])
        reference_optimizer.step()
        reference.step()

    module = _ScheduledRegression(make_schedule)
    strategy = HivemindStrategy(
        HivemindOptions(run_id=f"test_diloco_schedule_{name}", target_batch_size=16, batch_size=16, mode="diloco",
                        inner_steps=3, matchmaking_time=0.5, overlap_rounds=False),
        network=DHTOptions(host_maddrs=["/ip4/127.0.0.1/tcp/0"]),
    )
    seen = _fit(module, strategy, steps=7)
    assert seen.swarm_epoch == 2  # rounds after inner steps 3 and 6
    assert seen.learning_rates == pytest.approx(expected)
