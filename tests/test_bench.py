"""The benchmark suites run (a smoke-sized run of each) and write their section of the logbook page."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT
from benchmarks import bench, harness, report


def smoke(suite: str) -> tuple[dict, str]:
    """Run a suite's smoke version; returns the result in the bench result it printed, and the section it rendered."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench", suite, "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result_text, section = done.stdout[done.stdout.index("\n{\n") + 1:].split("\n}\n", 1)
    bench_result = json.loads(result_text + "\n}")
    assert bench_result["suite"] == suite and bench_result["command"] == f"python -m benchmarks.bench {suite} --smoke"
    return bench_result["result"], section


def test_join_suite_smoke():
    result, section = smoke("join")
    [run] = result["runs"]
    assert run["preset"] == "demo" and 0 < run["joiners"][0]["state_loaded_s"] <= run["joiners"][0]["first_step_s"]
    assert section.startswith("## join") and "| 0 |" in section
    [lone] = result["lone"]["joiners"]  # a lone joiner: wall and CPU seconds to its first step
    assert 0 < lone["first_step_cpu_s"] and 0 < lone["first_step_s"] and "### A lone joiner (`demo`)" in section


def test_throughput_suite_smoke():
    result, section = smoke("throughput")
    assert result["single_samples_per_s"] > 0 and result["ddp_samples_per_s"] > 0
    [swarm] = result["swarms"]
    assert swarm["target_batch_size"] == 4 * result["batch_size"]  # the coordinator's setting reached the peers
    assert swarm["samples_per_s"] > 0 and swarm["epochs"] >= 1
    assert all(0 < share < 1 for share in swarm["swarm_time_share"])
    assert 0 < swarm["training_cores"] <= 2.5 and 0 < swarm["background_cores"] <= 2.5  # two cores, sampling jitter
    assert "| swarm, target batch 128 (4x), state averaged every 1 |" in section


def test_communication_suite_smoke():
    result, section = smoke("communication")
    plain, fp16 = result["results"]
    assert plain["compression"] == "none" and fp16["compression"] == "fp16"
    # the compression chosen by the coordinator really reaches the wire: half-size tensors in every round
    assert 0 < fp16["bytes_per_sample"] < plain["bytes_per_sample"]
    assert all(0.1 < top1 <= 1 for run in result["results"] for top1 in run["top1"])  # trained, not chance
    assert "| fp16 |" in section


def test_convergence_suite_smoke():
    result, section = smoke("convergence")
    curves = result["curves"]
    assert set(curves) == {"single", "DDP", "swarm", "diloco", "diloco-blocking", "diloco-grouped"}
    for name, curve in curves.items():
        assert curve and curve[-1][1] > 0.2, name  # well above chance (0.1) after one pass over the data
    # a swarm's samples seen are its peers' own counts by each validated epoch: more with each later validation
    assert result["swarm_samples"] == "trained" and "counted by its peers" in section
    for name in ("swarm", "diloco", "diloco-blocking", "diloco-grouped"):
        samples = [count for count, _ in curves[name]]
        assert samples == sorted(samples) and samples[-1] > 0, (name, samples)
    assert result["grouped"] == dict(peers=4, target_group_size=2)
    assert "benchmarks-convergence.png" in section
    assert "| samples seen | single | DDP | swarm | diloco | diloco-blocking | diloco-grouped |" in section
    assert "groups of at most 2" in section and "diloco-blocking: **" in section  # a verdict for each variant
    assert [len(runs) for runs in result["seed_curves"].values()] == [1, 1]  # one data order each in the smoke
    assert result["baseline_seed_curves"]["DDP"] == [curves["DDP"]] and "DDP mean" in section  # mean against mean
    # what a peer trained per epoch or round, beside the run's nominal share of it
    assert {name: figures["nominal"] for name, figures in result["samples_per_epoch"].items()} == {
        "swarm": 64, "diloco": 256, "diloco-blocking": 256, "diloco-grouped": 256}
    assert "Samples a peer trained per swarm epoch" in section
    # diloco's verdict validates its peers' own weights, saved as they stopped at the round
    finals = result["seed_finals"]
    assert set(finals["runs"]) == {"diloco", "diloco-blocking"} and finals["round"] >= 1
    for [[samples, top1]] in finals["runs"].values():
        assert samples > 0 and len(top1) == 2 and min(top1) > 0.2, finals
    assert "its peers' weights at round" in section


@pytest.mark.netns  # its two linked namespaces (conftest.py)
def test_links_suite_smoke():
    result, section = smoke("links")
    [row] = result["results"]
    assert row["rate_mbit"] == 100
    for kind in ("ddp", "sync", "diloco", "diloco-overlapped"):
        assert row[kind]["samples_per_s"] > 0 and row[kind]["bytes_per_sample"] > 0, kind
    # DDP's gradients really crossed the veth: each step all-reduces ViT-Tiny's 5.4M float32 gradients between the
    # two namespaces, at least 5.4M x 4 bytes per 64 samples
    assert row["ddp"]["bytes_per_sample"] > 5.4e6 * 4 / 64 * 0.9
    assert section.startswith("## links") and "| 100 Mbit/s |" in section
    assert "diloco-overlapped samples/s" in section and "with overlapped rounds keeps" in section


def test_a_suite_rewrites_only_its_own_section(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "PAGE", tmp_path / "benchmarks.md")
    bench.write_section("join", "## join\n\nfirst\n")
    bench.write_section("throughput", "## throughput\n\nS\n")
    bench.write_section("join", "## join\n\nsecond\n")
    page = (tmp_path / "benchmarks.md").read_text()
    assert page.startswith("# Benchmarks") and "second" in page and "first" not in page and "S\n" in page
    assert page.index("## join") < page.index("## throughput")
    # the attacks suite's section goes under the faults tests/test_faults.py wrote, which stay as they were
    (tmp_path / "reliability.md").write_text("# Reliability\n\n| fault |\n")
    bench.write_section("attacks", "## attacks\n\nA\n")
    bench.write_section("attacks", "## attacks\n\nB\n")
    assert (tmp_path / "reliability.md").read_text() == "# Reliability\n\n| fault |\n\n## attacks\n\nB\n"
    assert "attacks" not in (tmp_path / "benchmarks.md").read_text()


def test_page_rebuilds_from_the_newest_result_without_measuring(tmp_path, monkeypatch):
    """--page: a section, or the scale suite's whole page, again from the suite's newest result; nothing runs."""
    monkeypatch.setattr(bench, "PAGE", tmp_path / "benchmarks.md")
    monkeypatch.setattr(report, "RESULTS", tmp_path / "results")
    (tmp_path / "results").mkdir()

    def measure(work, smoke):
        raise AssertionError("--page measured")

    monkeypatch.setitem(bench.SUITES, "scale", (measure, bench.SUITES["scale"][1]))
    monkeypatch.setitem(bench.SUITES, "join",
                        (measure, lambda result, env, out: f"## join\n\n{result} by {env['command']}\n"))
    for time, value in (("20260101T000000", "old"), ("20260102T000000", "new")):
        (tmp_path / "results" / f"bench-join-{time}.json").write_text(json.dumps(dict(
            suite="join", command="python -m benchmarks.bench join", environment={}, result=value)))
    kept = ROOT / "logbook" / "bench-results" / "bench-scale-20261126T065735.json"
    relay = ROOT / "logbook" / "bench-results" / "bench-relay-20261128T131526.json"  # its last section quotes it
    for bench_result in (kept, relay):
        (tmp_path / "results" / bench_result.name).write_text(bench_result.read_text())
    assert bench.main(["join", "--page"]) == 0 and bench.main(["scale", "--page"]) == 0
    assert (tmp_path / "benchmarks.md").read_text().endswith("## join\n\nnew by python -m benchmarks.bench join\n")
    page = (tmp_path / "scale.md").read_text()
    # the page names the command and commit that measured the result, and its result
    assert page.startswith("# Scale") and "Written by `python -m benchmarks.scale` from the bench result" in page
    assert f"{tmp_path / 'results' / kept.name}`: measured on 2026-11-26 06:50 UTC at commit 538edd2" in page
    assert "`python -m benchmarks.bench scale --page` rebuilds this page" in page
    assert "## The coordinator as a relay for unreachable peers" in page and relay.name in page


def test_monitor_suite_smoke():
    result, section = smoke("monitor")
    [row] = result["results"]
    assert row["publishers"] == 16 and row["looks"] >= 3
    assert row["counted_median"] == 16  # every simulated peer's records reach the coordinator and count
    assert 0 < row["look_median_s"] <= row["look_max_s"]
    assert section.startswith("## monitor") and "| 16 |" in section


@pytest.mark.netns  # its two NATs (conftest.py)
def test_relay_suite_smoke():
    result, section = smoke("relay")
    [row] = result["results"]
    # two peers behind two NATs: the coordinator led their rounds, and they averaged with each other
    assert row["trainers"] == 2 and row["relayed"] >= 1 and row["averaged_together"] >= 1
    assert row["bytes_per_round"] == 2 * 2 * row["parameters"] * 4  # each copy in and the average back, fp32
    assert section.startswith("## relay") and "| 2 |" in section


def test_churn_suite_smoke():
    result, section = smoke("churn")
    assert result["steady_samples_per_s"] > 0 and result["churn_samples_per_s"] > 0
    assert result["rounds_steady"]["averaged"] > 0  # the undisturbed peers really averaged
    [event, *_] = result["events"]
    assert event["kind"] in ("leave", "kill") and event["stopped_counting_s"] is not None
    assert 0 < event["join_state_loaded_s"] <= event["join_first_step_s"]
    assert 0 < event["join_cpu_s"]  # its imports alone take seconds of CPU
    assert 0 < event["exit_s"] and event["exit_cpu_s"] >= 0  # it is gone, and what it used after the signal
    assert 0 < result["steady_busy_cores"] <= result["cpu_cores"]
    assert section.startswith("## churn") and f"| {event['kind']} |" in section
    assert "CPU: the machine's" in section


def test_attacks_suite_smoke():
    result, section = smoke("attacks")
    honest, attacked = result["runs"]
    assert honest["attack"] is None and attacked["attack"] == "scale:1000"
    assert honest["defence"] == attacked["defence"] == "centered-clip"
    assert len(honest["top1"]) == 4 and len(attacked["top1"]) == 3  # the attacker's own weights are not judged
    assert attacked["attacker_rounds"] >= 1  # it averaged with the honest peers: the figures are its doing
    assert all(run["samples_per_s"] > 0 for run in result["runs"])
    assert section.startswith("## attacks") and "| scale:1000 | centered-clip |" in section


def test_rollback_recovery_counts_from_the_first_poisoned_state_to_the_last_peer_back():
    from benchmarks.attacks import rollback_recovery

    def epochs(*pairs):
        return [dict(epoch=epoch, time=t) for epoch, t in pairs]

    honest = [dict(epochs=epochs((3, 100.0), (4, 104.0), (5, 108.0)), rollbacks=[dict(time=115.0), dict(time=140.0)]),
              dict(epochs=epochs((3, 101.0), (4, 105.5)), rollbacks=[dict(time=117.5)])]
    rollbacks = [dict(time=112.0, top1=0.09, best_top1=0.91), dict(time=138.0, top1=0.1, best_top1=0.91)]
    found = rollback_recovery([96.0, 100.0, 104.0, 108.0, 112.0, 130.0], rollbacks, honest, from_round=3)
    # the attacker's round 3 went into swarm epoch 4: poisoned at 104 s, rolled back at 112 s, the last peer back at
    # 117.5 s; validations every 4 s (the median gap)
    assert found == dict(rollbacks=2, fell_to=0.09, restored_top1=0.91, detected_s=8.0, reloaded_s=5.5,
                         recovery_s=13.5, validation_interval_s=4.0)
    # a peer that never took the rollback: no recovery time, and nothing to divide by
    missed = rollback_recovery([96.0], [], [dict(epochs=epochs((4, 104.0)), rollbacks=[])], from_round=3)
    assert missed == dict(rollbacks=0, fell_to=None, restored_top1=None, detected_s=None, reloaded_s=None,
                          recovery_s=None, validation_interval_s=None)


def test_a_page_names_its_commit_and_marks_changed_code_not_its_own_pages(tmp_path, monkeypatch):
    """`make logbook` writes the demo's page before the tests that write the reliability page: those pages are the
    command's outputs, and the reliability page named its commit "with uncommitted changes" for them."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "logbook").mkdir()
    (tmp_path / "code.py").write_text("a = 1\n")
    (tmp_path / "logbook" / "demo.md").write_text("first\n")
    git("add", ".")
    git("commit", "-qm", "one")
    monkeypatch.setattr(harness, "ROOT", tmp_path)
    head = git("rev-parse", "HEAD")
    assert harness.git_commit() == head
    (tmp_path / "logbook" / "demo.md").write_text("second\n")
    assert harness.git_commit() == head
    (tmp_path / "code.py").write_text("a = 2\n")
    assert harness.git_commit() == f"{head} with uncommitted changes"
