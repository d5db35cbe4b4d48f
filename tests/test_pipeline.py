"""The pipeline baseline on CPU: one optimizer step of 2 stages in 2 processes (gloo) is the single-process step, under
both schedules and with accumulation; the command trains, validates and writes a result with memory per stage."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file
from test_baselines import env, free_port, results_in
from test_wandb import read_wandb_run

from baselines.pipeline import PipelineTrainer
from hivetrain.config import get_preset
from hivetrain.model import create_model
from hivetrain.optimizer import make_optimizer
from hivetrain.run_result import read_result

ROOT = Path(__file__).resolve().parent.parent
DEMO = get_preset("demo")
BATCH = 32
# (schedule, micro-batches per batch, batches per optimizer step): each takes one step over the same 32 samples.
LAYOUTS = (("1f1b", 4, 1), ("gpipe", 2, 2))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(BATCH, 3, DEMO.model.img_size, DEMO.model.img_size, generator=generator)
    return images, torch.randint(0, DEMO.model.num_classes, (BATCH,), generator=generator)


def pipeline_steps(rank: int, port: int, out: str) -> None:
    """One process of the 2-stage pipeline: one optimizer step per layout, then the whole model's weights."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        images, labels = batch()
        results = {}
        for schedule, microbatches, accumulate in LAYOUTS:
            trainer = PipelineTrainer(DEMO, create_model(DEMO.model, seed=DEMO.seed), torch.device("cpu"), schedule,
                                      microbatches, accumulate)
            part = BATCH // accumulate
            loss = trainer.train_step([(images[i:i + part], labels[i:i + part]) for i in range(0, BATCH, part)])
            results[schedule] = dict(loss=loss, weights=trainer.full_state_dict(), stage=trainer.stage.describe())
        stages = [None, None]
        dist.all_gather_object(stages, {s: r["stage"] for s, r in results.items()})
        if rank == 0:
            torch.save(dict(results=results, stages=stages), out)
    finally:
        dist.destroy_process_group()


def test_two_stages_take_the_single_process_step(tmp_path):
    out = tmp_path / "pipeline.pt"
    mp.start_processes(pipeline_steps, args=(free_port(), str(out)), nprocs=2, start_method="spawn")
    saved = torch.load(out)

    model = create_model(DEMO.model, seed=DEMO.seed)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer, _ = make_optimizer(model, DEMO.optim)
    images, labels = batch()
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    single = model.state_dict()
    # The step is real: AdamW's first step moves each weight by about lr / warmup_steps = 6e-4.
    assert max((single[k] - initial[k]).abs().max().item() for k in single) > 1e-4

    assert saved["stages"][0]["1f1b"] == "embedding, block 0" and saved["stages"][1]["1f1b"] == "block 1, norm, head"
    for schedule, result in saved["results"].items():
        weights = result["weights"]
        assert sorted(weights) == sorted(single), schedule  # the stages together hold every parameter, once
        assert abs(result["loss"] - loss.item()) < 1e-5, schedule
        # Another batch or a wrong average moves weights by ~1e-3; a different order of float sums by ~1e-6.
        assert max((weights[k] - single[k]).abs().max().item() for k in single) < 1e-5, schedule


def test_command_writes_a_result_with_memory_per_stage(tmp_path):
    # 40 validation samples in batches of 32: the second batch is padded for the schedule and the padding left out.
    args = [sys.executable, "baselines/run.py", "--strategy", "pipeline", "--devices", "2", "--preset", "demo",
            "--threads", "1", "--max-steps", "2", "--val-limit", "40", "--progress-bar", "off",
            "--out-dir", str(tmp_path), "--wandb-project", "test"]
    done = subprocess.run(args, cwd=ROOT, env=env(WANDB_MODE="offline"), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (path,) = results_in(tmp_path)
    result = read_result(path)
    # W&B gets what TensorBoard gets, as from the other baselines: each step's loss and each validation
    [run_dir] = (tmp_path / "wandb").glob("offline-run-*")
    _, history, summary = read_wandb_run(run_dir)
    assert [row["trainer/global_step"] for row in history if "train/loss" in row] == [1, 2]
    assert [row["val/top1"] for row in history if "val/top1" in row] == [point.top1 for point in result.validation]
    assert summary["best/top1"] == result.best_top1
    assert (result.strategy, result.world_size, result.global_batch_size) == ("pipeline", 2, DEMO.batch_size)
    assert result.steps == 2 and result.train_samples == 2 * DEMO.batch_size
    assert [m.rank for m in result.memory] == [0, 1] and all(m.peak_rss_bytes > 100 * 2**20 for m in result.memory)
    assert result.pipeline.schedule == "1f1b" and result.pipeline.microbatches == 4 and len(result.pipeline.stages) == 2
    assert sum(result.sharding.per_rank_param_bytes) == result.sharding.total_param_bytes
    assert all(0 < b < result.sharding.total_param_bytes for b in result.sharding.per_rank_param_bytes)
    assert Path(result.tensorboard_dir).is_dir()

    # The pipeline's validation is hivetrain.evaluate's on the same weights (the best checkpoint is the final one).
    from hivetrain.data import make_datamodule
    from hivetrain.evaluate import evaluate

    (point,) = result.validation
    model = create_model(DEMO.model, seed=DEMO.seed)
    model.load_state_dict(load_file(str(tmp_path / "checkpoints" / result.name / "best.safetensors")))
    expected = evaluate(model, make_datamodule(DEMO, val_limit=40).val_dataloader())
    assert expected["samples"] == 40
    assert abs(point.loss - expected["loss"]) < 1e-4
    assert (point.top1, point.top5) == (round(expected["top1"], 6), round(expected["top5"], 6))
