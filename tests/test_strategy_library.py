"""HivemindStrategy as a library piece: anyone's LightningModule, as the README shows it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from hivetrain import DHTOptions, HivemindOptions, HivemindStrategy

ROOT = Path(__file__).resolve().parent.parent
README_SECTION = "## Your own LightningModule in a swarm"


def _readme_example() -> str:
    """The first Python block of the README's section on bringing your own LightningModule."""
    readme = (ROOT / "README.md").read_text()
    assert README_SECTION in readme, f"README.md has no section {README_SECTION!r}"
    section = readme.split(README_SECTION, 1)[1]
    match = re.search(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert match is not None, f"no Python block under {README_SECTION!r}"
    return match.group(1)


def test_readme_example_trains_in_a_swarm(tmp_path):
    """The README's example runs as written, in a fresh process, and takes every step it asks for."""
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
    assert result.stdout.split() == ["[]", "True", "hivetrain.swarm", "hivetrain.strategy"]


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


def _fit(module: pl.LightningModule, strategy, steps: int) -> _WhileTraining:
    seen = _WhileTraining()
    # no accelerator flag: Lightning refuses one beside a strategy instance that has its accelerator from a fit before
    trainer = pl.Trainer(strategy=strategy, max_steps=steps, max_epochs=-1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[seen])
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
