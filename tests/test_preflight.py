"""``run_train.sh --preflight`` (torchtitan_tide/preflight, docs/design/2026-12-04-preflight.md).

Fast: the launcher's preflight command, the rows' logic (versions that differ, the one-sided
classification of a received slot), the test hooks' parsing, the cluster file the simulator
reads, and the time bound that ends a check. Slow (marker ``slow``, through the real
launcher on CPU, gloo): 2 ranks on the debug config pass (bitwise gradients, one-sided
skipped on one node); 4 ranks as 2 TIDE nodes x 2 pass (the stand-in's stress between the
cross-node pairs, float64-referenced gradients, every tier timed); 2 ranks as 2 nodes x 1
with three planted faults (another NCCL reported on rank 1, a reordered signal on rank 0's
puts, a late source read on rank 1's) fail naming each check and rank, with a non-zero exit.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_launch import dry_main
from train_helpers import REPO, cpu_env

from torchtitan_tide.comm.base.watchdog import FAILURES_FILE
from torchtitan_tide.config import Tide
from torchtitan_tide.preflight import facts, one_sided, rates
from torchtitan_tide.preflight.report import EXIT_TIMEOUT, Row, failure_lines, ranks_text, table
from torchtitan_tide.simulator.cluster import load_cluster


def test_launcher_starts_the_preflight_entry_on_the_training_world(monkeypatch, capsys):
    code, out, _ = dry_main(monkeypatch, capsys, "--preflight", "--tide.comm", "tide")
    assert code == 0
    command = [line for line in out.splitlines() if "torchtitan_tide.torchrun" in line][-1]
    assert "-m torchtitan_tide.preflight --job.config_file" in command
    assert "torchtitan_tide.train" not in command
    assert "[run_train] preflight   checks of TIDE's assumptions" in out
    assert out.strip().splitlines()[-1].endswith("(drop --dry-run to run the preflight)")
    code, out, _ = dry_main(monkeypatch, capsys)
    assert "-m torchtitan_tide.train --job.config_file" in out


def test_ranks_text_and_table():
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7, 8"
    rows = [Row("rates", "x", "info", "a|b"), Row("ranks", "torch", "FAIL", "differs", [1], "fix it")]
    text = table(rows)
    assert text.splitlines()[2] == "| ranks | torch | FAIL | differs |"  # check order, not input
    assert "a/b" in text
    assert failure_lines(rows) == ["FAIL rank 1: ranks / torch: differs -- fix: fix it"]
    with pytest.raises(ValueError, match="status"):
        Row("ranks", "x", "bad", "")


def _facts(rank: int, **over) -> dict:
    base = {"rank": rank, "host": "h", "torch": "2.13.0", "cuda_runtime": "13.0",
            "nccl": "2.29.7", "driver": "580 (CUDA 13.0)", "gpu": "H200", "gpu_uuid": f"u{rank}",
            "launcher_node": "0", "local_rank": str(rank)}  # fmt: skip
    return {**base, **over}


def test_a_version_that_differs_is_a_failure_naming_the_odd_rank():
    layouts = [{"shard_ranks": [0, 1, 2], "tide_shape": "1 node x 3", "tide_source": "detected"}]
    rows = facts.rows([_facts(0), _facts(1, nccl="2.27.3"), _facts(2)], layouts * 3)
    nccl = next(r for r in rows if r.what == "NCCL (loaded library)")
    assert (nccl.status, nccl.ranks) == ("FAIL", [1])
    assert "rank 1: 2.27.3" in nccl.detail and "ranks 0, 2: 2.29.7" in nccl.detail
    assert "classic cause of a stall" in nccl.fix
    assert next(r for r in rows if r.what == "torch").status == "ok"
    shared = facts.rows([_facts(0), _facts(1, gpu_uuid="u0")], layouts * 2)
    assert [r.status for r in shared if r.what == "one GPU per rank"] == ["warn"]


def test_test_hooks_parse_and_refuse_bad_entries():
    env = {facts.FAKE_VERSIONS_ENV: "1:nccl=2.27.3,2:torch=2.10.0"}
    assert facts.fake_versions(1, env) == {"nccl": "2.27.3"}
    assert facts.fake_versions(0, env) == {}
    with pytest.raises(ValueError, match=facts.FAKE_VERSIONS_ENV):
        facts.fake_versions(0, {facts.FAKE_VERSIONS_ENV: "1:bogus=1"})
    env = {one_sided.FAULT_ENV: "0:signal_before_data,1:late_source_read"}
    assert one_sided.planted_fault(1, env) == "late_source_read"
    assert one_sided.planted_fault(2, env) is None
    with pytest.raises(ValueError, match=one_sided.FAULT_ENV):
        one_sided.planted_fault(0, {one_sided.FAULT_ENV: "0:drop_everything"})


def test_a_received_slot_is_classified_by_what_it_holds():
    pair, numel = 3, 16

    def code(got: torch.Tensor, round_index: int = 5) -> int:
        want = one_sided._payload(pair, round_index, numel, got.device)
        return int(one_sided._classify(got, want, pair, round_index))

    assert code(one_sided._payload(pair, 5, numel, torch.device("cpu"))) == one_sided.OK
    stale = torch.full((numel,), one_sided.POISON_RECEIVE, dtype=torch.int64)
    assert code(stale) == one_sided.STALE
    assert code(one_sided._payload(pair, 3, numel, torch.device("cpu"))) == one_sided.STALE
    source = torch.full((numel,), one_sided.POISON_SOURCE, dtype=torch.int64)
    assert code(source) == one_sided.SOURCE_REUSED
    assert code(one_sided._payload(pair, 6, numel, torch.device("cpu"))) == one_sided.SOURCE_REUSED
    torn = one_sided._payload(pair, 5, numel, torch.device("cpu"))
    torn[7] = 0
    assert code(torn) == one_sided.CORRUPT


def test_one_sided_unavailable_fails_only_where_the_config_asks_for_it():
    gathered = [{"tier": [0, 1], "skip": "NCCL 2.28.9 is loaded; needs NCCL >= 2.29",
                 "error": None, "fault": None, "counts": {}, "transport": "NCCL 2.28.9"}] * 2
    (auto,) = one_sided.rows(gathered, Tide(comm="tide"))
    assert (auto.status, auto.what) == ("skip", "cross-node puts")
    assert "TIDE's 'auto' takes send/recv" in auto.detail
    (asked,) = one_sided.rows(gathered, Tide(comm="tide", cross_node_transport="nccl_one_sided"))
    assert (asked.status, asked.ranks) == ("FAIL", [0, 1])
    assert "cross_node_transport = 'nccl_one_sided' needs it" in asked.fix


def test_cluster_file_is_one_the_simulator_reads(tmp_path):
    tiers = [{"tier": "cross-node", "ranks": 4, "shard_numel": 2**20, "param_bytes": 2,
              "ag_backend_ms": 1.0}]  # fmt: skip
    values = rates.cluster_file(tmp_path / "c.toml", tiers, 8, "2.30.7", "cuda")
    cluster = load_cluster(tmp_path / "c.toml")
    # 3 peers x 2 MiB received in 1 ms
    assert cluster.nic_gbps_per_gpu == pytest.approx(3 * 2 * 2**20 * 8 / 1e-3 / 1e9, rel=1e-5)
    assert (cluster.gpus_per_node, cluster.nccl_version) == (8, "2.30.7")
    assert "measured" in values["notes"][0]
    values = rates.cluster_file(tmp_path / "d.toml", [], 2, "none (CPU: gloo)", "cpu")
    assert load_cluster(tmp_path / "d.toml").nic_gbps_per_gpu == 400.0
    assert any("NOT measured" in n for n in values["notes"])


def test_a_check_past_its_bound_ends_the_rank_with_its_name(tmp_path):
    code = ("import time; from torchtitan_tide.preflight.bounds import bounded\n"
            f"with bounded('one_sided', 1.0, 3, {str(tmp_path)!r}, print):\n"
            "    time.sleep(30)\n")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd=REPO, check=False)  # fmt: skip
    assert result.returncode == EXIT_TIMEOUT, result.stderr
    assert "rank 3: check 'one_sided' did not finish within 1 s" in result.stdout  # on_timeout
    assert "check 'one_sided' did not finish" in (tmp_path / FAILURES_FILE).read_text()


# ---------------------------------------------------------------- through the launcher


def preflight(folder: Path, nproc: int, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``./run_train.sh --config debug_model --preflight`` on ``nproc`` CPU ranks."""
    return subprocess.run(
        [str(REPO / "run_train.sh"), "--config", "debug_model", "--preflight",
         "--job.dump_folder", str(folder), *args],
        capture_output=True, text=True, env=cpu_env(nproc, **env), timeout=600, cwd=REPO,
        check=False,
    )  # fmt: skip


def report_of(folder: Path) -> dict:
    (path,) = (folder / "preflight").glob("preflight-*.json")
    return json.loads(path.read_text())


def row(record: dict, check: str, what: str) -> dict:
    return next(r for r in record["rows"] if (r["check"], r["what"]) == (check, what))


@pytest.mark.slow
def test_two_ranks_pass_with_bitwise_gradients(tmp_path):
    result = preflight(tmp_path / "run", 2)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    out = result.stdout
    assert "[preflight] " in out and "| check | what | status | detail |" in out
    assert "| preflight | result | ok | every check passed |" in out
    record = report_of(tmp_path / "run")
    assert record["failed"] == []
    assert row(record, "ranks", "NCCL (loaded library)")["detail"] == (
        "none (CPU: gloo) on all 2 ranks")
    assert "bitwise (2 ranks add in fp32)" in row(record, "parity", "losses and sharded gradients")["detail"]
    assert row(record, "paths", "TIDE-AG")["detail"].startswith("gloo on 3 group(s) (1 node x 2)")
    assert row(record, "one_sided", "cross-node puts")["status"] == "skip"
    assert "CPU figures" in row(record, "rates", "node-local TIDE-AG")["detail"]
    assert load_cluster(record["cluster"]["path"]).gpus_per_node == 2
    assert record["simulator"]["rows"][0]["mode"] == "fsdp2"


@pytest.mark.slow
def test_four_ranks_as_two_nodes_pass_every_check(tmp_path):
    result = preflight(tmp_path / "run", 4, "--tide.comm", "tide", "--tide.local_world_size", "2")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    record = report_of(tmp_path / "run")
    assert record["failed"] == []
    assert "2 nodes x 2" in row(record, "ranks", "TIDE nodes")["detail"]
    transport = row(record, "one_sided", "transport")["detail"]
    assert "CPU stand-in" in transport and "2 tier(s), 2 pair(s) x 24 rounds" in transport
    for what in ("signal after data", "source read before reuse", "data intact"):
        assert row(record, "one_sided", what)["status"] == "ok"
    assert "against float64, 4 ranks add" in row(record, "parity", "losses and sharded gradients")["detail"]
    assert {t["tier"] for t in record["rates"]} == {"node-local", "cross-node", "FSDP group"}
    assert "measured" in record["cluster"]["notes"][0]


@pytest.mark.slow
def test_planted_faults_fail_by_check_and_rank(tmp_path):
    result = preflight(
        tmp_path / "run", 2, "--tide.local_world_size", "1",
        TIDE_PREFLIGHT_FAKE_VERSIONS="1:nccl=2.27.3",
        TIDE_PREFLIGHT_FAKE_RMA_FAULT="0:signal_before_data,1:late_source_read",
    )  # fmt: skip
    assert result.returncode != 0, result.stdout[-6000:]
    out = result.stdout
    assert "FAIL rank 1: ranks / NCCL (loaded library): ranks differ" in out
    assert "FAIL rank 0: one_sided / signal after data: rank 1 from rank 0" in out
    assert "FAIL rank 1: one_sided / source read before reuse: rank 0 from rank 1" in out
    assert "one_sided / data intact" not in out  # each fault is named as what it is
    assert "run_train.sh: cause: preflight: 3 check(s) failed" in result.stderr
    record = report_of(tmp_path / "run")
    assert {(r["check"], r["what"]) for r in record["failed"]} == {
        ("ranks", "NCCL (loaded library)"), ("one_sided", "signal after data"),
        ("one_sided", "source read before reuse")}
    assert row(record, "parity", "losses and sharded gradients")["status"] == "ok"
