"""The README's main command, shortened: a coordinator and two peers, then the page and the swarm's run result."""

import json
import subprocess
import sys

from conftest import ROOT
from hivetrain.run_result import read_result

EPOCHS = 6


def test_demo_writes_its_numbers_and_a_swarm_result(tmp_path):
    page, results = tmp_path / "logbook" / "demo.md", tmp_path / "logbook" / "results"
    done = subprocess.run(
        # The demo's own rounds, paced every 2 s: the coordinator looks every 2 s and validates a state it downloads
        # from a peer; the last state, once the peers stop, from one that keeps it up until then
        [sys.executable, "scripts/demo.py", "--epochs", str(EPOCHS), "--workdir",
         str(tmp_path / "run"), "--logbook", str(page), "--result-dir", str(results)],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stdout
    assert "Dashboard: http://127.0.0.1:" in done.stdout
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["mode"] == "diloco" and result["swarm_epochs"] >= EPOCHS
    assert result["round_seconds"] == 2 and result["config"]["swarm"]["round_seconds"] == 2
    # at least the preset's 60 steps of 128 samples, in inner steps (stretched to what 6 rounds of 2 s hold)
    assert result["config"]["optim"]["total_steps"] >= 120
    # Both peers left right after the same outer round: they hold the same averaged parameters.
    assert result["max_weight_difference"] < 1e-5, _rounds(tmp_path / "run")
    assert result["train_samples"] >= EPOCHS * 32 * 2 and 0 < result["swarm_time_share"] < 1
    assert result["ddp_samples_per_s"] > 0
    # The coordinator validated the shared model while the swarm trained; its best is the checkpoint it kept.
    validations, best = result["validations"], result["best"]
    assert validations and all(v["samples"] == 360 for v in validations)
    # the last peers kept their state up until the coordinator had it (hivetrain.hand_over): the run's last state
    assert validations[-1]["epoch"] == result["swarm_epochs"], validations
    assert best["top1"] == max(v["top1"] for v in validations)
    assert (tmp_path / "run" / "checkpoints" / f"ckpt-{best['epoch']:06d}.tar").is_file()
    assert set(result["contributions"]) == {"peer1", "peer2"}
    text = page.read_text()
    assert f"| swarm epochs (outer rounds) | {result['swarm_epochs']} |" in text
    assert f"{best['top1']:.2%} / {best['top5']:.2%} at swarm epoch {best['epoch']}" in text
    (path,) = results.glob("*.json")
    run_result = read_result(path)
    assert run_result.strategy == "swarm" and run_result.world_size == 2 and run_result.steps == result["swarm_epochs"]
    assert [v.step for v in run_result.validation] == [v["epoch"] for v in validations]
    assert run_result.best_top1 == round(best["top1"], 6)
    assert len(run_result.memory) == 2 and all(m.peak_rss_bytes > 50 * 2**20 for m in run_result.memory)
    assert {s.rank for s in run_result.utilisation} == {0, 1}
    baselines_page = (tmp_path / "logbook" / "demo-baselines.md").read_text()
    assert run_result.name in baselines_page


def _rounds(workdir) -> str:
    """Each peer's log lines about joining, its rounds and leaving: which round of which peer went its own way."""
    lines = []
    for log in sorted(workdir.glob("peer*.log")):
        lines += [f"{log.stem}: {line}" for line in log.read_text().splitlines()
                  if any(word in line for word in ("round", "Round", "Joined", "Leaving", "state", "Waiting"))]
    return "\n".join(lines[-60:])
