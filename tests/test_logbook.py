"""Run results and the logbook: strict decoding that names the bad field, and pages rendered from fixture results
that carry their numbers, plots and commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import logbook
from hivetrain.config import get_preset
from hivetrain.run_result import (
    PipelineLayout,
    RankMemory,
    RunResult,
    Sharding,
    UtilisationSample,
    ValidationPoint,
    read_result,
    write_result,
)

ROOT = Path(__file__).resolve().parent.parent
DEMO = get_preset("demo")


def make_result(strategy: str, name: str, top1: float, samples_per_s: float, **changes) -> RunResult:
    world = 1 if strategy == "single" else 2
    fields = dict(
        name=name, experiment="demo", strategy=strategy, preset="demo", config=json.loads(DEMO.to_json()),
        fingerprint=DEMO.fingerprint, command=f"python baselines/run.py --strategy {strategy} --preset demo",
        started_at="2026-11-22T00:00:00Z", host="vm", accelerator="cpu", device_name="test CPU",
        versions={"torch": "2.14.1"}, num_nodes=1, devices_per_node=world, world_size=world, threads=1,
        precision="32", batch_size=64, batch_size_auto=False, accumulate=1, global_batch_size=64 * world, epochs=2,
        steps=44, train_samples=2816, wall_time_s=12.5, train_time_s=11.0, samples_per_s=samples_per_s,
        validation=[ValidationPoint(1, 22, 6.0, 0.61, top1 - 0.05, 0.99),
                    ValidationPoint(2, 44, 12.5, 0.2468, top1, 1.0)],
        memory=[RankMemory(r, "vm", (900 + r) * 2**20) for r in range(world)],
        utilisation=[UtilisationSample(float(t), r, 95.0, 90.0, 900 * 2**20)
                     for t in range(1, 4) for r in range(world)],
        best_checkpoint=f"runs/baselines/checkpoints/{name}/best.safetensors", best_top1=top1,
        tensorboard_dir=f"runs/baselines/tensorboard/demo/{name}", cpu_count=2,
    )
    fields.update(changes)
    return RunResult(**fields)


@pytest.fixture
def results(tmp_path) -> Path:
    directory = tmp_path / "results"
    write_result(make_result("single", "demo-single-a", 0.9125, 1234.5), directory)
    write_result(make_result("ddp", "demo-ddp-bb", 0.9375, 2345.6), directory)
    write_result(make_result("fsdp", "demo-fsdp-ccc", 0.8875, 1111.1,
                             sharding=Sharding(total_param_bytes=2_000_000, per_rank_param_bytes=[1_000_100, 999_900])),
                 directory)
    return directory


# --- results ------------------------------------------------------------------------------------------------------


def test_result_round_trip(tmp_path):
    result = make_result("fsdp", "r", 0.5, 10.0, sharding=Sharding(100, [50, 50]))
    path = write_result(result, tmp_path)
    assert path == tmp_path / "r.json"
    again = read_result(path)
    assert again == result and again.sharding.max_fraction == 0.5 and again.final.top1 == 0.5


@pytest.mark.parametrize("change, message", [
    (lambda raw: raw.pop("wall_time_s"), "field 'wall_time_s' is missing"),
    (lambda raw: raw.update(steps="44"), "field 'steps': expected an integer, got str"),
    (lambda raw: raw.update(steps=True), "field 'steps': expected an integer, got bool"),
    (lambda raw: raw["validation"][1].update(top1="high"), "field 'validation[1].top1': expected a number"),
    (lambda raw: raw["memory"][0].pop("peak_rss_bytes"), "field 'memory[0].peak_rss_bytes' is missing"),
    (lambda raw: raw.update(colour="blue"), "field 'colour' is not part of a RunResult"),
    (lambda raw: raw.update(strategy="horovod"), "field 'strategy': 'horovod' is not one of"),
    (lambda raw: raw.update(validation={}), "field 'validation': expected a list"),
    (lambda raw: raw.update(sharding=[1, 2]), "sharding: expected an object"),
])
def test_result_validation_names_the_field(change, message):
    raw = make_result("single", "r", 0.5, 10.0).to_dict()
    change(raw)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        RunResult.from_json(json.dumps(raw))


def test_result_rejects_non_json():
    with pytest.raises(ValueError, match="not JSON"):
        RunResult.from_json("{oops")


# --- the logbook --------------------------------------------------------------------------------------------------


def test_page_holds_the_results_numbers(results, tmp_path):
    out = tmp_path / "logbook"
    assert logbook.main(["build", "--results", str(results), "--out", str(out)]) == 0
    page = (out / "demo-baselines.md").read_text()
    for text in ("91.25%", "93.75%", "88.75%", "1234.5 samples/s", "2345.6", "1111.1", "0.2468",
                 "runs/baselines/checkpoints/demo-ddp-bb/best.safetensors", "`demo-fsdp-ccc`",
                 "python baselines/run.py --strategy fsdp --preset demo",
                 f"python -m benchmarks.logbook build --results {results} --out {out}",
                 "tensorboard --logdir runs/baselines/tensorboard/demo",
                 "900.0 MiB", "977 KiB, 976 KiB of 1.9 MiB", "No swarm result for this experiment yet",
                 "fingerprint `" + DEMO.fingerprint + "`", "(../results/demo-single-a.json)",
                 "| other programs' CPU meanwhile (mean) | 0.85 cores | 0.00 cores |"):
        assert text in page, text
    side_by_side = page.split("## Side by side")[1].split("## Plots")[0]
    assert "| Single device | DDP | FSDP | Swarm |" in side_by_side and "no result yet" in side_by_side
    for png in ("demo-baselines-metrics.png", "demo-baselines-utilisation.png"):
        assert f"]({png})" in page
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_swarm_result_fills_its_column(results, tmp_path):
    write_result(make_result("swarm", "demo-swarm-d", 0.9, 99.9, world_size=2, devices_per_node=1), results)
    out = tmp_path / "logbook"
    assert logbook.main(["build", "--results", str(results), "--out", str(out)]) == 0
    page = (out / "demo-baselines.md").read_text()
    assert "No swarm result" not in page and "2 peers" in page and "99.9 samples/s" in page
    assert "## Swarm" in page


def test_pipeline_result_fills_its_column_with_memory_per_stage(results, tmp_path):
    pipeline = make_result("pipeline", "demo-pipeline-e", 0.9, 77.7, global_batch_size=64,
                           memory=[RankMemory(0, "vm", 700 * 2**20), RankMemory(1, "vm", 650 * 2**20)],
                           sharding=Sharding(total_param_bytes=3 * 2**20, per_rank_param_bytes=[2 * 2**20, 2**20]),
                           pipeline=PipelineLayout("1f1b", 4, ["embedding, block 0", "block 1, norm, head"]))
    write_result(pipeline, results)
    out = tmp_path / "logbook"
    assert logbook.main(["build", "--results", str(results), "--out", str(out)]) == 0
    page = (out / "demo-baselines.md").read_text()
    side_by_side = page.split("## Side by side")[1].split("## Plots")[0]
    assert "| Single device | DDP | FSDP | Pipeline | Swarm |" in side_by_side
    memory_row = ("| peak memory per pipeline stage (GPU, or RSS on CPUs) | – | – | – |"
                  " stage 0: 700.0 MiB, stage 1: 650.0 MiB |")
    assert memory_row in side_by_side
    assert "2.0 MiB, 1.0 MiB of 3.0 MiB" in side_by_side and "2 stages (1f1b, 4 micro-batches) on 1 node" in page
    assert "## Pipeline" in page and "stage 1 runs block 1, norm, head (1.0 MiB of parameters)" in page
    assert "77.7 samples/s" in page


def test_malformed_result_fails_naming_file_and_field(results, tmp_path, capsys):
    bad = results / "broken.json"
    raw = make_result("ddp", "broken", 0.5, 1.0).to_dict()
    raw["validation"][0]["loss"] = None
    bad.write_text(json.dumps(raw))
    assert logbook.main(["build", "--results", str(results), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error:") and len(error.splitlines()) == 1
    assert str(bad) in error and "validation[0].loss" in error
    assert not (tmp_path / "out" / "demo-baselines.md").exists()


def test_cli_exit_code_on_malformed_result_and_empty_folder(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.json").write_text('{"name": "x"}')
    (tmp_path / "empty").mkdir()
    cli_env = dict(os.environ, PYTHONPATH=str(ROOT))
    for folder, message in (("bad", "x.json: field 'experiment' is missing"), ("empty", "no run results")):
        done = subprocess.run([sys.executable, "-m", "benchmarks.logbook", "build", "--results",
                                 str(tmp_path / folder), "--out", str(tmp_path / "out")],
                                cwd=ROOT, env=cli_env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_the_repos_run_results_all_load():
    """make demo rebuilds its pages from logbook/results: every file there must be a run result."""
    loaded = logbook.load_results([Path(logbook.__file__).resolve().parent.parent / "logbook" / "results"])
    assert {item.result.strategy for item in loaded} >= {"single", "ddp", "swarm"}
