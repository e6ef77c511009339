"""scripts/slurm/train.sbatch on a real SLURM cluster: scripts/slurm/local_cluster.sh's nodes
n1 and n2 (two slurmd on this machine, everything on 127.0.0.1), the debug model on CPU with
2 ranks per node, submitted as a user would (``sbatch --nodes=2 --gpus-per-node=0``):

1. node loss: kill -9 of n2's slurmd and of the job's processes on n2 mid-run; the training
   ends, SLURM requeues the job (``--requeue``) once n2 is DOWN, n2 comes back, and the job
   resumes from the last good checkpoint with the losses of an uninterrupted run;
2. the job trains to the end with the losses of a single-node 4-rank run of the same config
   (``tide``: 2 nodes x 2 ranks as TIDE sees them, cross-node phases over gloo, within 1e-6
   relative; ``fsdp2`` bitwise: ``assert_same_losses``);
3. ``scancel`` leaves no process of the job on either node and no partial checkpoint that a
   resume would take for a good one;
4. ``train.sbatch --preflight`` runs the preflight on both nodes (TIDE: 2 nodes x 2, the
   one-sided stress between the cross-node pairs on the CPU stand-in) and passes.

The cluster is the one SLURM_CONF names when local_cluster.sh started it (.ci/run does),
else one started here (and stopped at the end). The tests skip only when local_cluster.sh
says this machine cannot host one (exit status 3: not root, no apt-get, install failed).
"""

import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from train_helpers import REPO, SMALL_RUN, cpu_env, free_port, losses, read_metrics, train

from torchtitan_tide.checkpoint import MANIFEST, select_step, verify_step

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

LOCAL_CLUSTER = REPO / "scripts" / "slurm" / "local_cluster.sh"
SBATCH = REPO / "scripts" / "slurm" / "train.sbatch"
CANNOT_HOST = 3  # local_cluster.sh's exit status when this machine cannot run a cluster
NODES, RANKS_PER_NODE = ("n1", "n2"), 2
TIMEOUT_S = 10  # --comm.train_timeout_seconds (and the TIDE watchdog's deadline)
STEPS, INTERVAL, KILL_AFTER = 8, 3, 4  # checkpoints at 3 and 6; node loss after step 4
RUN = [*SMALL_RUN, "--training.steps", str(STEPS), "--checkpoint.enable",
       "--checkpoint.interval", str(INTERVAL), "--checkpoint.no-last-save-model-only",
       "--comm.train_timeout_seconds", str(TIMEOUT_S)]  # fmt: skip
# The GPU lines of the template overridden for CPU nodes, as docs/guide/slurm-and-preflight.md says.
CPU_PARTITION = ["--nodes=2", "--gpus-per-node=0"]
JOB_TIMEOUT_S = 300


@dataclass
class Cluster:
    folder: Path  # local_cluster.sh's LOCAL_SLURM_DIR

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    def run(self, *command: str) -> str:
        """A SLURM command's stdout (raises with its stderr on failure)."""
        result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False,
                                env={**os.environ, "SLURM_CONF": str(self.conf)})  # fmt: skip
        assert result.returncode == 0, f"{command}: {result.stderr}"
        return result.stdout

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, ...)."""
        line = self.run("scontrol", "show", "job", "-o", str(job_id))
        return dict(field.split("=", 1) for field in line.split() if "=" in field)

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t")
        return dict(line.split() for line in out.splitlines())

    def slurmd_pid(self, node: str) -> int:
        return int((self.folder / "pids" / f"slurmd-{node}").read_text())

    def local_cluster(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(LOCAL_CLUSTER), *args], capture_output=True, text=True, timeout=900,
            env={**os.environ, "LOCAL_SLURM_DIR": str(self.folder), **env}, check=False,
        )  # fmt: skip


def _free_port_block(count: int) -> int:
    """A port p with p .. p + count - 1 free on 127.0.0.1 (slurmctld and one slurmd each)."""
    for _ in range(50):
        base = free_port()
        if base + count > 65535:
            continue
        try:
            socks = []
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise AssertionError("no block of free ports for the cluster")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    conf = os.environ.get("SLURM_CONF")
    if conf and (Path(conf).parent / "pids" / "slurmctld").is_file():  # started by .ci/run
        existing = Cluster(Path(conf).parent)
        assert all(existing.node_states().get(n) == "idle" for n in NODES), existing.node_states()
        yield existing
        return
    ours = Cluster(tmp_path_factory.mktemp("slurm"))
    port = _free_port_block(len(NODES) + 1)
    up = ours.local_cluster("up", str(len(NODES)), LOCAL_SLURM_PORT=str(port))
    if up.returncode == CANNOT_HOST:
        pytest.skip(up.stderr.strip().splitlines()[-1])
    try:
        assert up.returncode == 0, up.stderr
        yield ours
    finally:
        down = ours.local_cluster("down")
        assert down.returncode == 0, down.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted single-node 4-rank runs of RUN, one per comm mode, run when first asked."""
    runs: dict[str, dict[int, float]] = {}

    def get(comm: str) -> dict[int, float]:
        if comm not in runs:
            folder = tmp_path_factory.mktemp(f"reference_{comm}") / "run"
            runs[comm] = losses(train(folder, *RUN, "--tide.comm", comm, nproc=4))
        return runs[comm]

    return get


@dataclass
class Job:
    id: int
    folder: Path  # the dump folder
    output: Path  # sbatch --output
    submitted: float  # time.time() at submission

    def text(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else ""


def submit(cluster: Cluster, tmp_path: Path, comm: str, *sbatch_options: str,
           script_args: tuple[str, ...] = ()) -> Job:  # fmt: skip
    """``CONFIG=debug_model ... sbatch --nodes=2 --gpus-per-node=0 [options] train.sbatch RUN``
    (then ``script_args``) from the repository, as the guide's CPU example."""
    folder, output = tmp_path / "run", tmp_path / "job.out"
    env = cpu_env(RANKS_PER_NODE, SLURM_CONF=str(cluster.conf), CONFIG="debug_model",
                  DUMP_FOLDER=str(folder), MASTER_PORT=str(free_port()))  # fmt: skip
    submitted = time.time()
    result = subprocess.run(
        ["sbatch", "--parsable", *CPU_PARTITION, f"--output={output}", *sbatch_options,
         str(SBATCH), *RUN, "--tide.comm", comm, *script_args],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return Job(int(result.stdout.strip().split(";")[0]), folder, output, submitted)


def wait_for(condition, timeout: float, what: str, job: Job | None = None, period: float = 0.2):
    """Poll ``condition()`` until truthy (returned); fails naming ``what`` with the job output."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            tail = job.text()[-6000:] if job else ""
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{tail}")
        time.sleep(period)


def wait_finished(cluster: Cluster, job: Job) -> dict[str, str]:
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
    return wait_for(lambda: (s := cluster.job(job.id))["JobState"] in ended and s,
                    JOB_TIMEOUT_S, f"job {job.id} finished", job, period=1.0)  # fmt: skip


def last_step(folder: Path) -> int:
    try:
        return max((r["step"] for r in read_metrics(folder)), default=0)
    except (OSError, ValueError, KeyError):
        return 0


def _proc(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def alive(pid: int) -> bool:
    stat = _proc(pid, "stat").decode(errors="replace")
    return bool(stat) and stat.rsplit(")", 1)[1].split()[0] != "Z"


def job_processes(job_id: int, node: str | None = None) -> dict[int, str]:
    """Live processes of the job (pid: command line): its tasks (SLURM_JOB_ID in their
    environment; on ``node`` only: SLURMD_NODENAME) and its slurmstepd daemons (on
    ``node``: the parents of its tasks there)."""
    tasks, steps = {}, {}
    want = {f"SLURM_JOB_ID={job_id}".encode()}
    if node is not None:
        want.add(f"SLURMD_NODENAME={node}".encode())
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or not alive(pid := int(entry)):
            continue
        cmdline = _proc(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
        if cmdline.startswith(f"slurmstepd: [{job_id}."):
            steps[pid] = cmdline
        elif want <= set(_proc(pid, "environ").split(b"\0")):
            tasks[pid] = cmdline
    if node is not None:
        parents = {int(_proc(pid, "stat").decode().rsplit(")", 1)[1].split()[1]) for pid in tasks}
        steps = {pid: cmd for pid, cmd in steps.items() if pid in parents}
    return {**tasks, **steps}


def training_ranks(job_id: int, node: str) -> list[int]:
    return [pid for pid, cmd in job_processes(job_id, node).items()
            if "-m torchtitan_tide.train" in cmd]  # fmt: skip


def test_node_loss_requeues_and_resumes(cluster, reference, tmp_path):
    job = submit(cluster, tmp_path, "tide", "--requeue")
    wait_for(lambda: last_step(job.folder) >= KILL_AFTER, JOB_TIMEOUT_S, f"step {KILL_AFTER}",
             job, period=0.1)  # fmt: skip
    victims = {cluster.slurmd_pid("n2"): "slurmd -N n2", **job_processes(job.id, "n2")}
    assert any("-m torchtitan_tide.train" in cmd for cmd in victims.values()), victims
    for pid in victims:
        os.kill(pid, 9)
    killed = time.monotonic()
    # The survivors' training ends by a gloo error (the peer's sockets closed) or at the
    # latest by the train timeout / TIDE watchdog, plus torchrun's 5 s grace.
    wait_for(lambda: not training_ranks(job.id, "n1"), TIMEOUT_S + 15, "n1's ranks ended", job)
    ranks_gone_s = time.monotonic() - killed
    good = select_step(str(job.folder / "checkpoint"), "stop")  # what a resume should load
    assert good >= INTERVAL, good
    # SLURM ends and requeues the job once n2 is DOWN: SlurmdTimeout (10 s) after its last
    # answer to slurmctld's pings (25 s measured).
    wait_for(lambda: int(cluster.job(job.id).get("Restarts", 0)) >= 1, 60, "requeue", job)
    requeued_s = time.monotonic() - killed
    assert cluster.node_states()["n2"].startswith("down"), cluster.node_states()
    print(f"node loss: n1's ranks gone {ranks_gone_s:.1f} s, job requeued {requeued_s:.1f} s "
          f"after the kill; last good checkpoint step {good}")  # fmt: skip
    restart = cluster.local_cluster("slurmd", "n2")
    assert restart.returncode == 0, restart.stderr
    wait_for(lambda: cluster.node_states()["n2"] in ("idle", "alloc"), 60, "n2 back", job)
    # SLURM holds a requeued job for cred_expire (90 s, local_cluster.sh): the uninterrupted
    # single-node runs (this test's and the next test's) run meanwhile.
    expected = reference("tide")
    reference("fsdp2")
    state = wait_finished(cluster, job)
    output = job.text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", (state, output[-6000:])
    # The first attempt's cause, then the second attempt's resume, in the one output file.
    assert "Connection reset by peer" in output or "TIDE watchdog: rank 0" in output
    assert "srun: error: Node failure on n2" in output, output[-8000:]
    # slurmstepd's "*** JOB ... CANCELLED ... DUE TO NODE FAILURE ***" reaches the file only
    # when the batch step still runs as n2 goes DOWN: a race (absent in 1 of 5 CI runs,
    # 2026-12-03), so not asserted; the srun line above names the failure every time.
    assert "[train.sbatch] requeued 1 time(s)" in output, output[-8000:]
    assert f"Loading the checkpoint from {job.folder}/checkpoint/step-{good}." in output
    lines = (job.folder / "metrics.jsonl").read_text().splitlines()
    resumes = [r for r in map(json.loads, lines) if r.get("event") == "resume"]
    assert [r["first_step"] for r in resumes] == [good + 1], resumes
    assert_same_losses(losses(read_metrics(job.folder)), expected, "tide")


def assert_same_losses(got: dict[int, float], single_node: dict[int, float], comm: str) -> None:
    """The 2 x 2 job's losses against the uninterrupted 1 x 4 run's: bitwise for fsdp2
    (gloo's reduce-scatter adds the 4 ranks in one order whatever the nodes); for tide within
    1e-6 relative: TIDE-RS adds a node's rows, then the other node's partial, so 1 x 4 and
    2 x 2 sum a rank's 4 fp32 gradients in different orders (measured on the CI machine,
    2026-12-04, with this and with a750dfd's code: step 8 6.899961948 vs 6.899961471, 7e-8
    relative; earlier CI machines happened to round alike)."""
    assert sorted(got) == sorted(single_node), (got, single_node)
    if comm == "fsdp2":
        assert got == single_node, (got, single_node)
        return
    for step, loss in single_node.items():
        assert got[step] == pytest.approx(loss, rel=1e-6, abs=0.0), (step, got, single_node)


@pytest.mark.parametrize("comm", ["tide", "fsdp2"])
def test_job_on_two_nodes_trains_with_single_node_losses(cluster, reference, tmp_path, comm):
    job = submit(cluster, tmp_path, comm)
    wait_for(lambda: last_step(job.folder) >= 1, JOB_TIMEOUT_S, "step 1", job, period=0.1)
    first_step_s = time.time() - job.submitted
    state = wait_finished(cluster, job)
    output = job.text()
    assert state["JobState"] == "COMPLETED", (state, output[-6000:])
    records = read_metrics(job.folder)
    step_s = [r["time_metrics/end_to_end(s)"] for r in records if r["step"] > 1]
    print(f"{comm}: first step {first_step_s:.1f} s after sbatch, "
          f"{len(step_s) / sum(step_s):.2f} steps/s after it")  # fmt: skip
    assert_same_losses(losses(records), reference(comm), comm)
    assert ("[train.sbatch] 2 node(s) x 2 ranks, rendezvous 127.0.0.1:"
            in output and "(NodeAddr of n1, whose name does not resolve)" in output), output[:2000]  # fmt: skip
    for node_rank in range(2):
        assert (f"{node_rank}: [run_train] world       4 = 2 node(s) x 2 CPU processes (gloo); "
                f"this node rank {node_rank}, rendezvous 127.0.0.1:") in output  # fmt: skip
    if comm == "tide":  # TIDE's own view of the layout: 2 nodes of 2 ranks, p2p over gloo
        assert "transport=p2p (auto: 2 nodes x 2 but not CUDA" in output, output[-6000:]
        assert "torch.float32 gradients, 2 nodes x 2" in output, output[-6000:]


def test_scancel_leaves_no_process_and_no_partial_checkpoint_taken_for_good(cluster, tmp_path):
    job = submit(cluster, tmp_path, "tide")
    checkpoint = job.folder / "checkpoint"
    # Cancel as a save starts (its folder appears), to catch it half-written where possible.
    wait_for(lambda: (checkpoint / f"step-{INTERVAL}").is_dir(), JOB_TIMEOUT_S,
             f"checkpoint step-{INTERVAL} started", job, period=0.02)  # fmt: skip
    assert job_processes(job.id, "n1") and job_processes(job.id, "n2")
    cluster.run("scancel", str(job.id))
    cancelled = time.monotonic()
    # KillWait (10 s) between SIGTERM and SIGKILL, torchrun's 5 s grace, and a loaded machine.
    try:
        wait_for(lambda: not job_processes(job.id), 45, f"every process of job {job.id} gone", job)
    except AssertionError as e:
        raise AssertionError(f"{e}\nleft: {job_processes(job.id)}") from None
    gone_s = time.monotonic() - cancelled
    state = wait_finished(cluster, job)
    assert state["JobState"] == "CANCELLED", state
    steps = sorted(p.name for p in checkpoint.iterdir() if p.name.startswith("step-"))
    chosen = select_step(str(checkpoint), "stop")
    print(f"scancel: every process gone {gone_s:.1f} s after it; checkpoints {steps}, "
          f"a resume would load step {chosen}")  # fmt: skip
    for name in steps:
        step_dir = checkpoint / name
        if (step_dir / ".metadata").is_file() and (step_dir / MANIFEST).is_file():
            assert verify_step(str(step_dir)) is None, name
    if chosen >= 0:  # what a resume loads is complete, and verified where it has a manifest
        assert (checkpoint / f"step-{chosen}" / ".metadata").is_file()
    wait_for(lambda: set(cluster.node_states().values()) == {"idle"}, 60, "nodes idle", job)


def test_preflight_through_sbatch_on_two_nodes(cluster, tmp_path):
    job = submit(cluster, tmp_path, "tide", script_args=("--preflight",))
    state = wait_finished(cluster, job)
    output = job.text()
    assert state["JobState"] == "COMPLETED", (state, output[-6000:])
    assert "config debug_model, preflight (checks, no training)" in output, output[:2000]
    assert "0: [rank0]:| preflight | result | ok | every check passed |" in output, output[-6000:]
    (path,) = (job.folder / "preflight").glob("preflight-*.json")
    record = json.loads(path.read_text())
    rows = {(r["check"], r["what"]): r for r in record["rows"]}
    assert "4 ranks on 2 launcher node(s)" in rows["ranks", "world"]["detail"]
    assert "2 nodes x 2" in rows["ranks", "TIDE nodes"]["detail"]
    assert "2 tier(s), 2 pair(s)" in rows["one_sided", "transport"]["detail"]
    assert rows["parity", "losses and sharded gradients"]["status"] == "ok"
    assert not list(job.folder.glob("checkpoint*")), "the preflight trained"
