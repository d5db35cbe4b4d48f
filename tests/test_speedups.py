"""The inner loop's GPU speedups without a GPU: which are chosen for a device and precision, how TF32 is set, that the
swarm's rebuilt optimizer keeps fusing to CUDA, that a compiled module keeps its parameters and clean state_dict keys,
and that baselines/run.py --compile trains on CPU and records what was on."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from safetensors import safe_open
from torch.utils._python_dispatch import TorchDispatchMode

from hivetrain.config import get_preset
from hivetrain.model import create_model
from hivetrain.module import ImageClassifier
from hivetrain.optimizer import make_optimizer
from hivetrain.run_result import RunResult, read_result
from hivetrain.speedups import FiniteSteps, all_finite, apply_tf32, inner_loop_speedups
from hivetrain.swarm_optimizer import _fused_on_cuda_only, optimizer_recipe

ROOT = Path(__file__).resolve().parent.parent
DEMO = get_preset("demo")


@pytest.mark.parametrize("device, precision, capability, expected", [
    ("cuda", "32", (8, 0), dict(tf32=True, fused_adamw=True, pinned_memory=True, compile=False)),
    ("cuda", "32", (9, 0), dict(tf32=True, fused_adamw=True, pinned_memory=True, compile=False)),
    ("cuda", "32", (7, 5), dict(tf32=False, fused_adamw=True, pinned_memory=True, compile=False)),  # no TF32 cores
    ("cuda", "bf16-mixed", (8, 0), dict(tf32=False, fused_adamw=True, pinned_memory=True, compile=False)),
    ("cuda", "16-mixed", (8, 6), dict(tf32=False, fused_adamw=True, pinned_memory=True, compile=False)),
    ("cpu", "32", None, dict(tf32=False, fused_adamw=False, pinned_memory=False, compile=False)),
    ("cpu", "bf16-mixed", None, dict(tf32=False, fused_adamw=False, pinned_memory=False, compile=False)),
])
def test_speedups_follow_device_precision_and_card(device, precision, capability, expected):
    assert inner_loop_speedups(device, precision, cuda_capability=capability) == expected
    assert inner_loop_speedups(device, precision, compile=True, cuda_capability=capability) == dict(expected,
                                                                                                     compile=True)


@pytest.fixture
def matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def test_tf32_is_set_only_when_chosen(matmul_precision):
    torch.set_float32_matmul_precision("highest")
    apply_tf32(inner_loop_speedups("cuda", "bf16-mixed", cuda_capability=(8, 0)))
    assert torch.get_float32_matmul_precision() == "highest"
    apply_tf32(inner_loop_speedups("cuda", "32", cuda_capability=(8, 0)))
    assert torch.get_float32_matmul_precision() == "high" and torch.backends.cuda.matmul.allow_tf32


def test_cpu_optimizer_is_unfused_and_the_swarm_recipe_unfuses_host_copies():
    model = create_model(DEMO.model, seed=0)
    optimizer, scheduler = make_optimizer(model, DEMO.optim)
    assert all(not group["fused"] for group in optimizer.param_groups)  # CPU: torch's default kernels
    # On a GPU the module's optimizer is fused; hivemind rebuilds it from the recipe on offloaded host copies
    fused, _ = make_optimizer(model, DEMO.optim)
    for group in fused.param_groups:
        group["fused"] = True  # as make_optimizer sets it for parameters on CUDA
    param_groups, make_inner, _ = optimizer_recipe(fused)
    host_copies = [dict(group, params=[p.detach().clone() for p in group["params"]]) for group in param_groups]
    inner = make_inner(host_copies)
    assert [group["fused"] for group in inner.param_groups] == [None, None]
    assert [group["weight_decay"] for group in inner.param_groups] == [DEMO.optim.weight_decay, 0.0]
    # parameters that stay on CUDA (offload_optimizer=False) keep the fused kernel
    on_cuda = SimpleNamespace(device=torch.device("cuda", 0))
    assert _fused_on_cuda_only([dict(params=[on_cuda], fused=True)]) == [dict(params=[on_cuda], fused=True)]


def test_compiled_module_keeps_its_parameters_and_clean_state_dict_keys():
    model = create_model(DEMO.model, seed=0)
    parameters = list(model.parameters())
    keys = list(ImageClassifier(DEMO, create_model(DEMO.model, seed=0)).state_dict())
    module = ImageClassifier(DEMO, model, compile_model=True)
    assert model._compiled_call_impl is not None  # nn.Module.compile: in place, no wrapper module
    assert list(module.model.parameters()) == parameters and all(
        a is b for a, b in zip(module.parameters(), parameters))
    assert list(module.state_dict()) == keys and not any("_orig_mod" in key for key in keys)


@pytest.fixture(scope="module")
def torch_compile_works() -> None:
    """torch.compile on CPU needs a working C++ toolchain (inductor builds its kernels): try one small compile."""
    try:
        compiled = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2)
        assert torch.allclose(compiled(torch.ones(4)), torch.nn.functional.gelu(torch.ones(4)) * 2)
    except Exception as e:  # inductor's errors (a missing compiler, headers) have no common base class
        pytest.skip(f"torch.compile does not work on this machine: {type(e).__name__}: {str(e)[:300]}")


def test_baseline_with_compile_trains_and_records_the_speedups(tmp_path, torch_compile_works):
    weights = tmp_path / "final.safetensors"
    result = subprocess.run(
        [sys.executable, "baselines/run.py", "--strategy", "single", "--preset", "demo", "--compile", "--threads", "2",
         "--max-steps", "2", "--val-limit", "0", "--progress-bar", "off", "--out-dir", str(tmp_path),
         "--save-final-weights", str(weights)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "speedups: compile" in result.stdout
    (path,) = (tmp_path / "results").glob("*.json")
    run_result = read_result(path)
    assert run_result.steps == 2
    assert run_result.speedups == dict(tf32=False, fused_adamw=False, pinned_memory=False, compile=True)
    with safe_open(str(weights), "pt") as saved:
        assert sorted(saved.keys()) == sorted(create_model(DEMO.model).state_dict())


def test_compile_is_refused_where_the_baseline_does_not_train_the_module(tmp_path):
    result = subprocess.run([sys.executable, "baselines/run.py", "--strategy", "fsdp", "--devices", "2", "--compile",
                             "--out-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert result.returncode == 2 and "--compile is for --strategy single or ddp" in result.stderr


def test_peer_accepts_compile():
    from hivetrain.roles.peers.join import parse_args

    assert parse_args(["--compile"]).compile and not parse_args([]).compile


def test_results_from_before_the_speedups_still_read():
    raw = json.loads((ROOT / "logbook" / "results" / "demo-single-1x1-20261122-021428.json").read_text())
    assert "speedups" not in raw and RunResult.from_dict(raw).speedups is None
    assert RunResult.from_dict(dict(raw, speedups=dict(tf32=True))).speedups == dict(tf32=True)
    with pytest.raises(ValueError, match="speedups.tf32"):
        RunResult.from_dict(dict(raw, speedups=dict(tf32="yes")))


def test_finite_steps_tell_each_non_finite_verdict_once():
    """On the CPU a verdict is known at once, as a bool or a tensor; each is told by the next settled() only, and
    clear() forgets those not yet read."""
    steps = FiniteSteps()
    steps.add(True)
    steps.add(torch.isfinite(torch.tensor(1.0)).all())
    assert steps.settled() and steps.settled(wait=True)
    steps.add(torch.isfinite(torch.tensor(float("nan"))).all())
    steps.add(True)
    assert not steps.settled()
    assert steps.settled()  # told once
    steps.add(False)
    steps.clear()
    assert steps.settled(wait=True)


class HostReads(TorchDispatchMode):
    """Every read of a tensor's value on the host (aten._local_scalar_dense: .item(), bool(), float()), by the first
    frame of the caller's own code: on a GPU each one waits until the GPU has run everything queued before it."""

    def __init__(self):
        super().__init__()
        self.sites: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            frames = [f.filename for f in traceback.extract_stack() if "/torch/optim/" in f.filename or (
                "/torch/" not in f.filename and not f.filename.endswith("test_speedups.py"))]
            self.sites.append(frames[-1] if frames else "torch")
        return func(*args, **(kwargs or {}))


def test_all_finite_reads_one_value_back_for_many_tensors():
    """A sync peer asks whether its loss and every gradient are finite at each step: one read on the host, not one
    per tensor (each a wait for the GPU)."""
    gradients = [torch.ones(3) for _ in range(150)]
    for tensors, expected in ((gradients, True), (gradients + [torch.tensor([1.0, float("inf")])], False),
                              ([torch.tensor(float("nan"))] + gradients, False), ([], True)):
        with HostReads() as reads:
            assert all_finite(tensors) is expected
        assert len(reads.sites) == (1 if tensors else 0)


def test_the_training_step_reads_nothing_back_to_the_host():
    """Lightning's loop with the module, its logging and metrics included, leaves the GPU to run ahead: no value is
    read back at a step (a progress-bar metric, torchmetrics' label checks and a float() of the loss each did). Only
    torch.optim's own code may read, as its CPU AdamW does (its step counts live on the CPU; fused AdamW on a GPU
    reads nothing)."""
    from hivetrain.data import make_datamodule

    # As a GPU peer loads (device_transforms), with no augmentation: torchvision's crop reads CPU tensors of its own,
    # in DataLoader workers on a GPU
    config = DEMO.replace(data=dataclasses.replace(DEMO.data, augment=False))
    model = create_model(config.model, seed=0)
    module = ImageClassifier(config, model)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, limit_val_batches=0, num_sanity_val_steps=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    reads = HostReads()

    class Watch(pl.Callback):  # from the third step on: the loop's first steps set things up once
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2:
                reads.__enter__()

        def on_train_end(self, trainer, pl_module):
            reads.__exit__(None, None, None)

    trainer.callbacks.append(Watch())
    torch.set_num_threads(1)
    trainer.fit(module, datamodule=make_datamodule(config, seed=0, device_transforms=True))
    assert trainer.global_step == 6
    outside_the_optimizer = [site for site in reads.sites if "/torch/optim/" not in site]
    assert not outside_the_optimizer, outside_the_optimizer
