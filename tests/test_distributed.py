"""holmes_jax.distributed: which launcher started us, process facts across processes, and
multi-process training (gloo on CPU) matching one process with the same devices."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from holmes_jax import cli, distributed
from holmes_jax.cli import RunError
from holmes_jax.config import ConfigError
from holmes_jax.mesh import nic
from helpers import REPO, killed_on_exit, launch_env, read_metrics

# --------------------------------------------------------------------------- launch detection


# SLURM's count and index are passed on (process 0 checks its port; a timeout names the process)
SLURM_5_OF_8 = {"num_processes": 8, "process_id": 5, "cluster_detection_method": "slurm"}
# Arguments that name everything: JAX's own detection is off (it filled the local device from SLURM's)
NO_DETECTION = {"cluster_detection_method": "deactivate"}


@pytest.mark.parametrize("env, method, kwargs", [
    ({}, "single", {}),
    ({"HOLMES_NUM_PROCESSES": "1", "HOLMES_PROCESS_ID": "0"}, "single", {}),
    ({"HOLMES_COORDINATOR": "127.0.0.1:1234", "HOLMES_NUM_PROCESSES": "4", "HOLMES_PROCESS_ID": "3"}, "holmes",
     {"coordinator_address": "127.0.0.1:1234", "num_processes": 4, "process_id": 3, **NO_DETECTION}),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, "single", {}),  # a one-task job: no distributed runtime
    # the coordinator is the node list's first host, on JAX's port for the job (7 % 4096 + 61440)
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_PROCID": "5",
      "SLURM_LOCALID": "1"}, "slurm", {"coordinator_address": "n1:61447", **SLURM_5_OF_8}),
    # several bracket groups: JAX's own reading gave 'rack1', a host that does not exist
    ({"SLURM_JOB_ID": "4097", "SLURM_NTASKS": "8", "SLURM_STEP_NODELIST": "rack[1-2]-n[01-04],gpu7",
      "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "JAX_COORDINATOR_PORT": "29500"}, "slurm",
     {"coordinator_address": "rack1-n01:29500", **SLURM_5_OF_8}),
    # an empty port is unset, as JAX reads it (it was refused)
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_PROCID": "5",
      "SLURM_LOCALID": "1", "JAX_COORDINATOR_PORT": ""}, "slurm", {"coordinator_address": "n1:61447", **SLURM_5_OF_8}),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_PROCID": "5",
      "SLURM_LOCALID": "1", "HOLMES_COORDINATOR": "head:1"}, "slurm",
     {"coordinator_address": "head:1", **SLURM_5_OF_8}),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2", "OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1"},
     "ompi", {"cluster_detection_method": "ompi"}),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2", "HOLMES_COORDINATOR": "head:29500"}, "ompi",
     {"coordinator_address": "head:29500", "num_processes": 4, "process_id": 2, **NO_DETECTION}),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "HOLMES_COORDINATOR": "head:29500"}, "ompi",
     {"coordinator_address": "head:29500", "num_processes": 4, "process_id": 3, "local_device_ids": [1],
      **NO_DETECTION}),
    # MPICH / Intel MPI (Hydra's PMI): JAX does not detect them, so without this every rank ran alone
    ({"PMI_SIZE": "4", "PMI_RANK": "3", "MPI_LOCALRANKID": "1", "HOLMES_COORDINATOR": "head:29500"}, "pmi",
     {"coordinator_address": "head:29500", "num_processes": 4, "process_id": 3, "local_device_ids": [1],
      **NO_DETECTION}),
    ({"PMI_SIZE": "1", "PMI_RANK": "0"}, "single", {}),
    # zero-padded ranges and a single number in one bracket group
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8", "SLURM_STEP_NODELIST": "node[001-004,010]", "SLURM_PROCID": "0",
      "SLURM_LOCALID": "0"}, "slurm",
     {"coordinator_address": "node001:61447", "num_processes": 8, "process_id": 0, "cluster_detection_method": "slurm"}),
    # mpirun inside a SLURM allocation: a rank also sees the SLURM variables of the srun step that
    # started Open MPI's daemons (one task per node), so it took process 1 of 2 from SLURM
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_PROCID": "1",
      "SLURM_LOCALID": "0", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1"}, "ompi", {"cluster_detection_method": "ompi"}),
    # Hydra's mpiexec inside a SLURM allocation (its proxies: one srun task per node) ...
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_PROCID": "1",
      "SLURM_LOCALID": "0", "PMI_SIZE": "16", "PMI_RANK": "9", "MPI_LOCALRANKID": "1", "HOLMES_COORDINATOR": "n1:29500"},
     "pmi", {"coordinator_address": "n1:29500", "num_processes": 16, "process_id": 9, "local_device_ids": [1],
             **NO_DETECTION}),
    # ... but srun's own PMI (--mpi=pmi2) counts SLURM's tasks: SLURM's detection, no coordinator needed
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_PROCID": "5",
      "SLURM_LOCALID": "1", "PMI_SIZE": "8", "PMI_RANK": "5"}, "slurm",
     {"coordinator_address": "n1:61447", **SLURM_5_OF_8}),
    # JAX_LOCAL_DEVICE_IDS (all of a node's GPUs in one process) is JAX's to read: a local rank
    # passed as local_device_ids overrode it
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "HOLMES_COORDINATOR": "head:29500", "JAX_LOCAL_DEVICE_IDS": "0,1,2,3"}, "ompi",
     {"coordinator_address": "head:29500", "num_processes": 2, "process_id": 1, **NO_DETECTION}),
    ({"PMI_SIZE": "2", "PMI_RANK": "1", "MPI_LOCALRANKID": "0", "HOLMES_COORDINATOR": "head:29500",
      "JAX_LOCAL_DEVICE_IDS": "0,1"}, "pmi",
     {"coordinator_address": "head:29500", "num_processes": 2, "process_id": 1, **NO_DETECTION}),
    # mpirun -np 1 inside a SLURM allocation of several tasks: its rank carries the batch step's
    # SLURM variables, which read as one task of four (an error line, or a wait for three more)
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
      "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1"}, "single", {}),
    # an IPv6 address in brackets, as jaxlib reads it
    ({"HOLMES_COORDINATOR": "[::1]:29500", "HOLMES_NUM_PROCESSES": "2", "HOLMES_PROCESS_ID": "1"}, "holmes",
     {"coordinator_address": "[::1]:29500", "num_processes": 2, "process_id": 1, **NO_DETECTION}),
    # our launcher's variables win over a scheduler's
    ({"HOLMES_COORDINATOR": "h:1", "HOLMES_NUM_PROCESSES": "2", "HOLMES_PROCESS_ID": "1", "OMPI_COMM_WORLD_SIZE": "4"},
     "holmes", {"coordinator_address": "h:1", "num_processes": 2, "process_id": 1, **NO_DETECTION}),
])
def test_launch_method(env, method, kwargs):
    assert distributed.launch_method(env) == (method, kwargs)


def test_a_start_by_hand_inside_an_srun_step_keeps_every_gpu_of_its_node():
    # One process per node started by hand in a step of one srun task per node: JAX's detection
    # took the task's SLURM_LOCALID as the one local device (jax_cuda_visible_devices '0': GPU 0 of 8)
    script = """
import os, socket, sys
import jax
from holmes_jax import distributed
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
env = dict(os.environ, HOLMES_COORDINATOR=f"127.0.0.1:{port}", HOLMES_NUM_PROCESSES="2", HOLMES_PROCESS_ID="1")
method, kwargs = distributed.launch_method(env)
kwargs.update(num_processes=1, process_id=0)  # alone, so that it starts without a peer
jax.distributed.initialize(**kwargs, initialization_timeout=20)
print(method, jax.config._read("jax_cuda_visible_devices"))
jax.distributed.shutdown()
"""
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "0"}
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, **slurm, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == ["holmes", "all"]


@pytest.mark.parametrize("env, message", [
    ({"HOLMES_NUM_PROCESSES": "two", "HOLMES_PROCESS_ID": "0"}, "HOLMES_NUM_PROCESSES = 'two'"),
    ({"HOLMES_NUM_PROCESSES": "2", "HOLMES_PROCESS_ID": "2", "HOLMES_COORDINATOR": "h:1"}, "HOLMES_PROCESS_ID = 2"),
    ({"HOLMES_NUM_PROCESSES": "2", "HOLMES_PROCESS_ID": "-1", "HOLMES_COORDINATOR": "h:1"}, "HOLMES_PROCESS_ID = '-1'"),
    ({"HOLMES_NUM_PROCESSES": "2", "HOLMES_PROCESS_ID": "0"}, "needs HOLMES_COORDINATOR"),
    ({"HOLMES_NUM_PROCESSES": "2"}, "HOLMES_PROCESS_ID is not"),
    # a stale coordinator exported in the shell, then one process started
    ({"HOLMES_COORDINATOR": "h:1"}, "HOLMES_COORDINATOR = 'h:1' is set but HOLMES_NUM_PROCESSES and HOLMES_PROCESS_ID "
                                    "are not; set all three (or unset HOLMES_COORDINATOR for one process)"),
    # a bare IPv6 address: jaxlib cannot read it, and the processes waited until the timeout
    ({"HOLMES_COORDINATOR": "::1:29500", "HOLMES_NUM_PROCESSES": "2", "HOLMES_PROCESS_ID": "0"},
     "HOLMES_COORDINATOR = '::1:29500' is not allowed; allowed: HOST:PORT, e.g. 10.0.0.1:29500 (an IPv6 address in "
     "brackets, e.g. [fd00::1]:29500)"),
    ({"HOLMES_COORDINATOR": "[head]:29500", "HOLMES_NUM_PROCESSES": "2", "HOLMES_PROCESS_ID": "0"}, "HOST:PORT"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "n1", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
      "HOLMES_COORDINATOR": "fd00::1:29500"}, "HOLMES_COORDINATOR = 'fd00::1:29500' is not allowed"),
    ({"HOLMES_COORDINATOR": "nohost", "HOLMES_NUM_PROCESSES": "2", "HOLMES_PROCESS_ID": "0"}, "HOST:PORT"),
    ({"HOLMES_COORDINATOR": "h:99999", "HOLMES_NUM_PROCESSES": "2", "HOLMES_PROCESS_ID": "0"}, "HOST:PORT"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, "srun"),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0"}, "HOLMES_COORDINATOR=HOST:PORT"),
    # partly set or inconsistent scheduler variables: JAX would raise a KeyError or ValueError, or
    # wait minutes for processes that do not exist
    ({"OMPI_COMM_WORLD_SIZE": "4", "HOLMES_COORDINATOR": "h:1"}, "OMPI_COMM_WORLD_RANK unset"),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "4", "HOLMES_COORDINATOR": "h:1"},
     "OMPI_COMM_WORLD_RANK = 4 is not allowed; allowed: 0 .. OMPI_COMM_WORLD_SIZE - 1 = 3"),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "one",
      "OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1"}, "OMPI_COMM_WORLD_LOCAL_RANK = 'one'"),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1", "JAX_COORDINATOR_PORT": "port"}, "JAX_COORDINATOR_PORT = 'port'"),
    ({"PMI_SIZE": "4", "PMI_RANK": "0"}, "this MPI does not tell JAX the coordinator; pass HOLMES_COORDINATOR"),
    ({"PMI_SIZE": "4", "PMI_RANK": "4", "HOLMES_COORDINATOR": "h:1"}, "PMI_RANK = 4 is not allowed"),
    ({"PMI_SIZE": "4", "HOLMES_COORDINATOR": "h:1"}, "PMI_RANK unset"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "n1", "SLURM_PROCID": "4", "SLURM_LOCALID": "0"},
     "SLURM_PROCID = 4 is not allowed; allowed: 0 .. SLURM_NTASKS - 1 = 3"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "n1", "SLURM_PROCID": "x", "SLURM_LOCALID": "0"},
     "SLURM_PROCID = 'x'"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "n1", "SLURM_PROCID": "1", "SLURM_LOCALID": ""},
     "SLURM_LOCALID = ''"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "", "SLURM_PROCID": "1", "SLURM_LOCALID": "1"},
     "SLURM_STEP_NODELIST = ''"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "[1-4]", "SLURM_PROCID": "1", "SLURM_LOCALID": "1"},
     "SLURM_STEP_NODELIST = '[1-4]'"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "n1", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
      "JAX_COORDINATOR_PORT": "99999"}, "JAX_COORDINATOR_PORT = '99999'"),
    # a superscript two is a digit to str.isdigit(), not to int(): a traceback
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "n1", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
      "JAX_COORDINATOR_PORT": "\u00b2"}, "JAX_COORDINATOR_PORT = '\u00b2'"),
    ({"HOLMES_COORDINATOR": "h:\u00b2", "HOLMES_NUM_PROCESSES": "2", "HOLMES_PROCESS_ID": "0"}, "HOST:PORT"),
    ({"HOLMES_COORDINATOR": "h:\u0662\u0669\u0665\u0660\u0660", "HOLMES_NUM_PROCESSES": "2", "HOLMES_PROCESS_ID": "0"},
     "HOST:PORT"),  # Arabic-Indic digits went on to jaxlib
    # JAX parses it with int() inside jax.distributed.initialize: a traceback
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "n1", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
      "JAX_LOCAL_DEVICE_IDS": "0-3"}, "JAX_LOCAL_DEVICE_IDS = '0-3' is not allowed; allowed: device numbers separated by "
                                      "commas, e.g. 0,1,2,3"),
])
def test_bad_environment_is_a_config_error(env, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        distributed.launch_method(env)


def test_single_process_initialize_is_idempotent():
    info = distributed.initialize(8)  # the test process's backend (8 devices, conftest) is kept
    assert (info.process_index, info.process_count, info.local_devices, info.method) == (0, 1, 8, "single")
    assert distributed.initialize() is info
    assert distributed.exchange_process_facts(info) == [info.facts()]
    assert distributed.exchange_nics(nic.Nic("roce", 100.0)) == [nic.Nic("roce", 100.0)]


# --------------------------------------------------------------------------- several processes


def test_a_node_may_run_one_process_per_device():
    # srun --ntasks-per-node=8 (one task per GPU, as the README's SLURM example): each node of the
    # topology file is several processes; before, only one process per node was accepted
    from types import SimpleNamespace

    import numpy as np

    from holmes_jax.mesh import devices as real
    from holmes_jax.planning.topology import Cluster, Topology

    t = Topology((Cluster("ib", "infiniband", nodes=2, devices_per_node=2),
                  Cluster("roce", "roce", nodes=1, devices_per_node=2)))
    devices = [SimpleNamespace(process_index=p, id=2048 * p) for p in range(6)]
    nics = ["roce", "roce", "infiniband", "infiniband", "infiniband", "infiniband"]
    placed = real.device_array(np.arange(6), t, devices, nics)
    assert [d.process_index for d in placed] == [2, 3, 4, 5, 0, 1]
    # a process whose devices would sit on two nodes
    ib = Topology((Cluster("ib", "infiniband", nodes=2, devices_per_node=2),), name="ib2")
    spread = [SimpleNamespace(process_index=p, id=2048 * p + k) for p, n in enumerate([1, 2, 1]) for k in range(n)]
    # (the message did not say that process 0 holds one of node 0's devices: "... node 0 has 2;")
    with pytest.raises(ConfigError, match=re.escape(
            "node 0 of topology 'ib2' has 2 devices but the infiniband processes that reach it in rank order hold "
            "3: process 0 with 1, process 1 with 2; allowed: a node's devices in one process or several consecutive "
            "ranks, none spread over two nodes (a NIC class's ranks in the topology's node order)")):
        real.device_array(np.arange(4), ib, spread, ["infiniband"] * 3)


def test_launched_jobs_keep_the_compilation_cache_and_no_other_jax_setting(monkeypatch):
    # The session's compilation cache (conftest.py) spares a launched job's process 0 the programs
    # an earlier job compiled; a setting that fixes process ids, the coordinator, platforms or
    # device counts would make the job's processes disagree with what the launcher gives them.
    for name in ("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES", "JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_PORT",
                 "JAX_PROCESS_ID", "JAX_NUM_PROCESSES", "JAX_LOCAL_DEVICE_IDS", "HOLMES_PROCESS_ID"):
        monkeypatch.setenv(name, "1")
    cache = ("JAX_COMPILATION_CACHE_DIR", "JAX_COMPILATION_CACHE_MAX_SIZE",
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    env = launch_env()
    assert {k: v for k, v in env.items() if k.startswith(("HOLMES_", "JAX_"))} == {k: os.environ[k] for k in cache}
    assert env["XLA_FLAGS"] == os.environ["XLA_FLAGS"] and env["PYTHONPATH"] == str(REPO)


def _launch(n: int, devices: int, *cmd: str, extra: tuple = (), timeout: int = 240) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "holmes_jax.launch", "-n", str(n), "--devices-per-process", str(devices),
                        "--timeout", str(timeout - 20), *extra, "--", sys.executable, *cmd],
                       capture_output=True, text=True, timeout=timeout, cwd=REPO, env=launch_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


FACTS = """
import json
from holmes_jax import distributed
from holmes_jax.mesh import nic
info = distributed.initialize()
import jax
# flushed at once, not at exit: CI once saw three lines of four with every process exiting 0
# (not reproduced); a line left in the pipe's buffer is lost if the exit is cut short
print("FACTS", json.dumps({"me": info.process_index, "count": info.process_count, "devices": jax.device_count(),
                           "method": info.method, "all": distributed.exchange_process_facts(info),
                           "nics": [n.nic_class for n in distributed.exchange_nics(nic.detect())],
                           "again": distributed.every_process("again", str(info.process_index))}), flush=True)
"""


def test_every_process_sees_every_process_facts():
    nics = ["infiniband", "infiniband", "roce", "ethernet"]
    r = _launch(4, 2, "-c", FACTS, extra=("--nic-classes", ",".join(nics)), timeout=120)
    seen = [json.loads(line.split("FACTS ", 1)[1]) for line in r.stdout.splitlines() if "FACTS " in line]
    assert sorted(s["me"] for s in seen) == [0, 1, 2, 3]
    for s in seen:
        assert (s["count"], s["devices"], s["method"]) == (4, 8, "holmes")
        assert [f["process_index"] for f in s["all"]] == [0, 1, 2, 3]
        assert [f["nic"] for f in s["all"]] == nics
        assert [f["local_devices"] for f in s["all"]] == [2] * 4
        assert s["all"] == seen[0]["all"]
        assert s["nics"] == nics and s["again"] == ["0", "1", "2", "3"]


TRAIN_ARGS = [
    "--gin.ModelConfig.num_layers=2", "--gin.ModelConfig.hidden=64", "--gin.ModelConfig.num_heads=4",
    "--gin.ModelConfig.ffn_hidden=128", "--gin.DataConfig.seq_len=32", "--gin.DataConfig.global_batch=16",
    "--gin.TrainConfig.steps=3", "--gin.TrainConfig.log_every=1", "--gin.TrainConfig.eval_every=1000",
    "--gin.TrainConfig.eval_batches=1", "--gin.TrainConfig.learning_rate=0.01", "--gin.TrainConfig.warmup_steps=1",
    "--gin.ParallelConfig.pp=2", "--gin.ParallelConfig.microbatches=2",
]


@pytest.fixture(scope="module")
def one_process_losses(tmp_path_factory):
    """The reference: one process, 4 CPU devices, the same global batch."""
    workdir = tmp_path_factory.mktemp("one")
    r = subprocess.run([sys.executable, "-m", "holmes_jax.train", *TRAIN_ARGS, "--gin.ParallelConfig.cpu_devices=4",
                        f"--gin.TrainConfig.workdir={workdir}"], capture_output=True, text=True, timeout=240,
                       cwd=REPO, env=launch_env())
    assert r.returncode == 0, r.stderr[-3000:]
    return [row["loss"] for row in read_metrics(workdir)]


def _train(tmp_path, n: int, devices: int, *args: str) -> list[float]:
    r = _launch(n, devices, "-m", "holmes_jax.train", *TRAIN_ARGS, *args, f"--gin.TrainConfig.workdir={tmp_path}")
    assert "[rank 0] done: step 3" in r.stdout
    assert not [line for line in r.stdout.splitlines() if line.startswith("[rank 1] step")]  # process 0 alone reports
    assert (tmp_path / "checkpoints" / "3").is_dir()
    return [row["loss"] for row in read_metrics(tmp_path)]


def test_two_processes_1f1b_match_one_process(tmp_path, one_process_losses):
    # Stage 0 on process 0, stage 1 on process 1, dp = 2 in each. 1F1B over 4 microbatches has
    # ticks that move activations, gradients, both or neither between the processes (a tick skips
    # a transfer no stage sends); the mean over the global batch is the reference's. GPipe across
    # processes: the four-process test below.
    losses = _train(tmp_path, 2, 2, "--gin.ParallelConfig.schedule=1f1b", "--gin.ParallelConfig.microbatches=4")
    assert losses == pytest.approx(one_process_losses, abs=1e-5)


@pytest.mark.slow
def test_four_processes_pp2_match_one_process(tmp_path, one_process_losses):
    losses = _train(tmp_path, 4, 1)  # each data replica of each stage in its own process
    assert losses == pytest.approx(one_process_losses, abs=1e-5)


def test_processes_given_different_settings_end_in_one_error_line_each(tmp_path):
    # Different settings (here a wrapper that adds a flag for one rank) made the ranks evaluate and
    # save at other steps, and wait for each other's collectives for ever.
    steps = '--gin.TrainConfig.steps=$((6 + 2 * HOLMES_PROCESS_ID))'
    r = subprocess.run([sys.executable, "-m", "holmes_jax.launch", "-n", "2", "--devices-per-process", "1",
                        "--timeout", "100", "--", "sh", "-c",
                        f'exec "$0" -m holmes_jax.train --gin.TrainConfig.workdir={tmp_path} {steps}', sys.executable],
                       capture_output=True, text=True, timeout=120, cwd=REPO, env=launch_env())
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    errors = sorted(line for line in r.stderr.splitlines() if "error:" in line)
    expected = ("error: the processes were given different settings: process 1 has TrainConfig.steps = 8 where "
                "process 0 has TrainConfig.steps = 6 (processes that differ from process 0: 1); allowed: the same "
                "command, flags and gin files (with the same contents) for every process")
    assert errors == [f"[rank 0] {expected}", f"[rank 1] {expected}"]
    assert "Traceback" not in r.stderr and not tmp_path.joinpath("config.gin").exists()


# Whole steps timed once, one step after one untimed (the step timing itself is tested in
# test_profile.py): what is tested here is that the processes measure and agree, not how well.
PROFILE = """
import functools
import sys
from pathlib import Path
from holmes_jax import build, configure, distributed, profile
profile.profile_steps = functools.partial(profile.profile_steps, rounds=1, steps=1, warmup_steps=1)
cfgs = configure.load_configs(sys.argv[2:])
info = distributed.initialize(cfgs.parallel.cpu_devices)
result = profile.profile(build.build(cfgs), repeats=2, splits=2, say=lambda *a: None)
Path(f"{sys.argv[1]}.{info.process_index}").write_text(result.to_json())
"""


@pytest.mark.slow
def test_two_processes_profile_every_stage_and_agree_on_it(tmp_path):
    # Stage 0's data group lives in process 0, stage 1's in process 1: each measures its own and
    # the medians are shared, so both processes hold the same profile with both stages' links,
    # and rank (then time) the same splits.
    out = tmp_path / "profile.json"
    # one microbatch: a shorter pipeline to compile, with the same stages and links to measure
    _launch(2, 2, "-c", PROFILE, str(out), *TRAIN_ARGS, "--gin.ModelConfig.num_layers=4",
            "--gin.ParallelConfig.microbatches=1")
    from holmes_jax.planning.measured import Profile

    prof, other = Profile.load(f"{out}.0"), Profile.load(f"{out}.1")
    assert prof == other
    assert prof.layer_fwd_s > 0 and prof.layer_bwd_s > 0 and prof.update_s_per_param > 0
    assert len(prof.data_links) == 2 and all(link is not None and link.gbps > 0 for link in prof.data_links)
    assert len(prof.stage_links) == 1 and prof.stage_links[0].gbps > 0
    assert len(prof.split_probes) == 2 and all(sum(p.stage_layers) == 4 for p in prof.split_probes)


@pytest.mark.parametrize("launcher", ["holmes", "slurm"])
def test_coordinator_port_in_use_is_one_error_line(launcher):
    # Process 0 cannot open the coordinator's port: an error line naming it, not jaxlib's traceback
    # (or, at times, its segmentation fault). Under srun process 0 did not look (its index was JAX's).
    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        env = dict(launch_env(), HOLMES_COORDINATOR=address, HOLMES_NUM_PROCESSES="2", HOLMES_PROCESS_ID="0")
        if launcher == "slurm":
            env = dict(launch_env(), HOLMES_COORDINATOR=address, SLURM_JOB_ID="7", SLURM_NTASKS="2",
                       SLURM_STEP_NODELIST="127.0.0.1", SLURM_PROCID="0", SLURM_LOCALID="0")
        r = subprocess.run([sys.executable, "-m", "holmes_jax.train", "--gin.TrainConfig.steps=1"], capture_output=True,
                           text=True, timeout=120, cwd=REPO, env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: HOLMES_COORDINATOR = {address!r}: port {address.rpartition(':')[2]} is in use on this host, process 0's, "
        "where the coordinator starts; allowed: a free port (holmes_jax.launch: leave --port out)"]


@pytest.mark.parametrize("sig, line", [(signal.SIGTERM, "stopped by SIGTERM"), (signal.SIGINT, "interrupted")])
def test_a_stop_signal_while_the_processes_wait_to_meet_ends_the_process_at_once(tmp_path, sig, line):
    # jaxlib held the main thread until the processes met: Ctrl-C did nothing for up to 300 s
    with socket.create_server(("127.0.0.1", 0)) as coordinator:  # it accepts, and answers nothing
        env = dict(launch_env(), HOLMES_COORDINATOR=f"127.0.0.1:{coordinator.getsockname()[1]}",
                   HOLMES_NUM_PROCESSES="2", HOLMES_PROCESS_ID="1")
        coordinator.settimeout(120)
        process = subprocess.Popen([sys.executable, "-m", "holmes_jax.train"], stderr=subprocess.PIPE, text=True,
                                   cwd=tmp_path, env=env)
        with killed_on_exit(process):
            connection, _ = coordinator.accept()  # process 1 is inside jax.distributed's start-up
            with connection:
                time.sleep(0.5)
                process.send_signal(sig)
                err = process.communicate(timeout=30)[1]
    assert process.returncode == 128 + sig and err.strip().splitlines() == [line], err


def test_a_port_taken_on_ipv6_only_is_in_use():
    # the coordinator's server binds every address, IPv6 too: a program on [::1] alone took the
    # port from it, and only an IPv4 bind was tried
    from holmes_jax import distributed

    with socket.create_server(("::1", 0), family=socket.AF_INET6) as taken:
        assert distributed._port_in_use(taken.getsockname()[1])
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert distributed._port_in_use(port)
    assert not distributed._port_in_use(port)


@pytest.mark.parametrize("rank, why", [
    (1, "nothing answers at {address}: is process 0 running, on that host and port?"),
    (0, "not every process joined: are they all running, with the same coordinator?"),
])
def test_processes_that_never_meet_end_in_one_error_line(rank, why):
    # jaxlib's own timeout aborts the process with a C++ check failure and a stack dump (status 134)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, never listening: a connection there is refused
        address = f"127.0.0.1:{s.getsockname()[1]}"
        if rank == 0:
            s.close()  # process 0 opens the coordinator there itself
        # Process 1's port stays ours meanwhile: closed, a process of another test (the other
        # worker's) could take it and answer.
        script = "from holmes_jax import distributed; distributed.INIT_TIMEOUT_S = 1; distributed.initialize(1)"
        env = dict(launch_env(), HOLMES_COORDINATOR=address, HOLMES_NUM_PROCESSES="2", HOLMES_PROCESS_ID=str(rank))
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO,
                           env=env)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: jax.distributed did not start within 1 s (holmes, coordinator {address}, process {rank} of 2); "
        + why.format(address=address)]


def test_why_processes_did_not_meet(monkeypatch):
    # Process 0 was told "not every process joined" whatever the address, and the others "nothing
    # answers" for a host name that does not resolve (a typo, or a stale HOLMES_COORDINATOR).
    assert distributed._why_not_met("127.0.0.1:1", 0) == (
        "not every process joined: are they all running, with the same coordinator?")
    # process 0 on another host than the coordinator's (192.0.2.1: a documentation address, bound
    # only to ask whether it is this host's; nothing is sent)
    assert distributed._why_not_met("192.0.2.1:29500", 0) == (
        "process 0 starts the coordinator on its own host, but 192.0.2.1 is another host: is 192.0.2.1:29500 right?")
    assert distributed._why_not_met(None, 0) == (
        "not every process joined: are they all running, with the same coordinator?")

    def no_such_host(*args, **kwargs):  # no DNS query leaves the machine
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_host)
    for rank in (0, 1):
        assert distributed._why_not_met("head-typo:29500", rank) == (
            "the coordinator's host head-typo does not resolve: is head-typo:29500 right?")


def test_bad_distributed_environment_exits_2():
    env = dict(launch_env(), HOLMES_NUM_PROCESSES="two", HOLMES_PROCESS_ID="0")
    r = subprocess.run([sys.executable, "-m", "holmes_jax.train", "--gin.TrainConfig.steps=1"], capture_output=True,
                       text=True, timeout=120, cwd=REPO, env=env)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: HOLMES_NUM_PROCESSES = 'two' is not allowed; allowed: an integer >= 1"]


# --------------------------------------------------------------------------- the step's tasks, the host's GPUs


# `srun --preserve-env -n 2` inside an allocation of 4 tasks: SLURM_NTASKS stays the job's 4, and
# SLURM_STEP_NUM_TASKS is the step's 2
SLURM_STEP_OF_2 = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "n1",
                   "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}


@pytest.mark.parametrize("env, method, kwargs", [
    # the processes waited for 2 ranks that never came, until the start-up timeout
    (SLURM_STEP_OF_2, "slurm",
     {"coordinator_address": "n1:61447", "num_processes": 2, "process_id": 1, "cluster_detection_method": "slurm"}),
    # srun -E -n 1: one process, not one of 4 (it waited for 3 more)
    ({**SLURM_STEP_OF_2, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, "single", {}),
    # srun -E --mpi=pmi2 -n 2: PMI counts the step's tasks, so SLURM's detection (no coordinator needed)
    ({**SLURM_STEP_OF_2, "PMI_SIZE": "2", "PMI_RANK": "1"}, "slurm",
     {"coordinator_address": "n1:61447", "num_processes": 2, "process_id": 1, "cluster_detection_method": "slurm"}),
])
def test_a_slurm_step_counts_its_own_tasks(env, method, kwargs):
    assert distributed.launch_method(env) == (method, kwargs)


def test_a_rank_beyond_the_steps_tasks_names_the_steps_count():
    with pytest.raises(ConfigError, match=re.escape(
            "SLURM_PROCID = 2 is not allowed; allowed: 0 .. SLURM_STEP_NUM_TASKS - 1 = 1")):
        distributed.launch_method({**SLURM_STEP_OF_2, "SLURM_PROCID": "2"})


@pytest.fixture
def four_gpus(tmp_path, monkeypatch):
    """A host whose NVIDIA driver has 4 GPUs and a JAX with a CUDA plugin, as the seams see them:
    the driver's GPUs in a folder of the test's, not /proc (this machine has no GPU)."""
    for bus in ("0000:07:00.0", "0000:0f:00.0", "0000:47:00.0", "0000:4e:00.0"):
        (tmp_path / bus).mkdir()
    monkeypatch.setattr(distributed, "_cuda_plugin_installed", lambda: True)
    monkeypatch.setattr(distributed, "NVIDIA_GPUS", str(tmp_path))


@pytest.mark.parametrize("env, platforms, count", [
    ({}, "", 4),
    ({"CUDA_VISIBLE_DEVICES": "2,3"}, "cuda", 2),
    ({"CUDA_VISIBLE_DEVICES": "GPU-8d2c4a1e-0000-0000-0000-000000000000"}, "", 1),
    ({"CUDA_VISIBLE_DEVICES": "1,7,2"}, "", 1),  # CUDA stops at a GPU the driver does not have
    ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, "", 0),
    ({"CUDA_VISIBLE_DEVICES": "0,\u00b2"}, "", 1),  # a digit to isdigit(), not to int(): was a traceback
    ({"CUDA_VISIBLE_DEVICES": ""}, "", 0),
    ({}, "cpu", None),  # JAX will not start CUDA
])
def test_the_gpus_cuda_shows_are_counted_without_starting_it(four_gpus, env, platforms, count):
    assert distributed.visible_gpus(env, platforms) == count


def test_no_gpus_are_counted_without_a_driver_or_a_cuda_plugin(four_gpus, tmp_path, monkeypatch):
    monkeypatch.setattr(distributed, "_cuda_plugin_installed", lambda: False)
    assert distributed.visible_gpus({}, "") is None
    monkeypatch.setattr(distributed, "_cuda_plugin_installed", lambda: True)
    monkeypatch.setattr(distributed, "NVIDIA_GPUS", str(tmp_path / "no-driver"))
    assert distributed.visible_gpus({}, "") is None


MPIRUN_RANK_5 = {"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "5",
                 "HOLMES_COORDINATOR": "head:29500"}


@pytest.mark.parametrize("method, env, message", [
    # mpirun -npernode 8 on a host of 4 GPUs: jaxlib failed only when its backend started
    ("ompi", MPIRUN_RANK_5,
     "OMPI_COMM_WORLD_LOCAL_RANK = '5': this process would use GPU 5, but CUDA shows it 4 (0 .. 3; every GPU of the "
     "NVIDIA driver); allowed: one process a GPU shown (at most 4 on this host), or JAX_LOCAL_DEVICE_IDS naming GPUs "
     "it shows (e.g. 0 where each process is shown its own)"),
    # srun --gpus-per-task=1: every task is shown one GPU, but takes the GPU of its local rank
    ("slurm", {**SLURM_STEP_OF_2, "CUDA_VISIBLE_DEVICES": "1"},
     "SLURM_LOCALID = '1': this process would use GPU 1, but CUDA shows it 1 (0 .. 0; CUDA_VISIBLE_DEVICES = '1')"),
    ("pmi", {"PMI_SIZE": "8", "PMI_RANK": "6", "MPI_LOCALRANKID": "6", "CUDA_VISIBLE_DEVICES": "0,1"},
     "MPI_LOCALRANKID = '6': this process would use GPU 6, but CUDA shows it 2"),
    ("holmes", {"JAX_LOCAL_DEVICE_IDS": "2,3,4"}, "JAX_LOCAL_DEVICE_IDS = '2,3,4': this process would use GPU 4"),
])
def test_a_process_given_a_gpu_cuda_does_not_show_is_one_error_before_start_up(four_gpus, method, env, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        distributed.check_local_gpus(method, env, "")


@pytest.mark.parametrize("method, env, platforms", [
    ("ompi", {**MPIRUN_RANK_5, "OMPI_COMM_WORLD_LOCAL_RANK": "3"}, ""),  # the last GPU
    ("ompi", {**MPIRUN_RANK_5, "JAX_LOCAL_DEVICE_IDS": "0,1,2,3"}, ""),  # JAX_LOCAL_DEVICE_IDS wins over the rank
    ("ompi", MPIRUN_RANK_5, "cpu"),  # a CPU run on a GPU host
    ("ompi", {**MPIRUN_RANK_5, "CUDA_VISIBLE_DEVICES": ""}, ""),  # no GPU shown: JAX runs on the CPU
    ("holmes", {"HOLMES_NUM_PROCESSES": "8", "HOLMES_PROCESS_ID": "5"}, ""),  # every GPU it is shown
])
def test_a_process_given_a_gpu_cuda_shows_starts(four_gpus, method, env, platforms):
    distributed.check_local_gpus(method, env, platforms)


def test_initialize_checks_the_local_gpu_before_anything_starts(four_gpus, monkeypatch):
    monkeypatch.setattr(distributed, "_info", None)
    monkeypatch.setattr(distributed, "network_settings", lambda local: pytest.fail("started before the check"))
    for name, value in MPIRUN_RANK_5.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="^OMPI_COMM_WORLD_LOCAL_RANK = '5': this process would use GPU 5"):
        distributed.initialize(1)


def test_an_exchange_waits_a_second_at_a_time_until_its_deadline(monkeypatch):
    """One wait of the whole timeout ran no signal handler until it ended: a process whose peer had
    stopped (a SIGTERM to both) waited out INIT_TIMEOUT_S before it stopped too."""
    import jax

    waits = []

    class Client:
        def blocking_key_value_get(self, key, timeout_ms):
            waits.append(timeout_ms)
            if len(waits) < 3:
                raise jax.errors.JaxRuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            return "the value"

        def key_value_dir_get(self, key):  # no process told an error
            return []

    assert distributed._wait_for(Client(), "k", time.monotonic() + 60) == "the value"
    assert len(waits) == 3 and max(waits) <= 1000

    class Never:  # waits as long as it is asked to, for a key never set
        def blocking_key_value_get(self, key, timeout_ms):
            waits.append(timeout_ms)
            time.sleep(timeout_ms / 1000)
            raise jax.errors.JaxRuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")

        def key_value_dir_get(self, key):
            return []

    waits.clear()
    with pytest.raises(jax.errors.JaxRuntimeError, match="DEADLINE_EXCEEDED"):  # at the deadline: as before
        distributed._wait_for(Never(), "k", time.monotonic() + 2.5)
    assert waits[:2] == [1000, 1000] and max(waits) <= 1000 and 2000 < sum(waits) <= 2500  # (a loaded host: a 4th)

    class Broken:
        def blocking_key_value_get(self, key, timeout_ms):
            raise jax.errors.JaxRuntimeError("UNAVAILABLE: the coordination service is gone")

    with pytest.raises(jax.errors.JaxRuntimeError, match="UNAVAILABLE"):  # not waited on
        distributed._wait_for(Broken(), "k", time.monotonic() + 60)


def test_an_exchange_stops_every_process_where_one_holds_a_stop_signal(monkeypatch):
    """A process that stopped alone before the loop left the others waiting for it in a device
    collective (orbax's directory sync) until the launcher's SIGKILL."""
    import jax
    from jax._src import distributed as jax_distributed

    class Store:  # this is process 0; process 1 has set its key, holding `peer_holds`
        def __init__(self):
            self.values, self.peer_holds = {}, 0

        def key_value_set(self, key, value):
            self.values[key] = value
            self.values[key[:-1] + "1"] = f"{self.peer_holds} process 1's"

        def blocking_key_value_get(self, key, timeout_ms):
            return self.values[key]

    store = Store()
    monkeypatch.setattr(jax_distributed.global_state, "client", store)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    with cli.SignalHold():
        assert distributed.every_process("x", "process 0's") == ["process 0's", "process 1's"]
        store.peer_holds = int(signal.SIGTERM)  # process 1 caught one: this process stops here too
        with pytest.raises(cli.Signalled) as stopped:
            distributed.every_process("x", "process 0's")
        assert stopped.value.signum == signal.SIGTERM
        # but not where the stop is under way (a stop's checkpoint, waited for by every process)
        assert distributed.every_process("x", "process 0's", signals=False) == ["process 0's", "process 1's"]
    store.peer_holds = 0
    with cli.SignalHold() as hold:  # this process caught one: it stops here, and process 1 with it
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(cli.Signalled) as stopped:
            distributed.every_process("x", "process 0's")
        assert stopped.value.signum == hold.signum == signal.SIGTERM
        assert [v for k, v in store.values.items() if k.endswith("/0")][-1] == f"{int(signal.SIGTERM)} process 0's"


def test_an_error_on_one_process_ends_the_others_waits_with_its_line(monkeypatch):
    """Process 0 of a second run on a locked workdir stopped on its error; process 1 waited for it
    in orbax's directory sync for ever (at an exchange: INIT_TIMEOUT_S, five minutes)."""
    import jax

    class Store:
        def __init__(self):
            self.values = {}

        def key_value_set(self, key, value):
            self.values[key] = value

        def blocking_key_value_get(self, key, timeout_ms):
            raise jax.errors.JaxRuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")

        def key_value_dir_get(self, prefix):
            return [(k, v) for k, v in self.values.items() if k.startswith(prefix + "/")]

    store = Store()
    monkeypatch.setattr(distributed, "_client", lambda: store)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    with pytest.raises(ConfigError), distributed.errors_told():
        raise ConfigError("TrainConfig.workdir = '/w' is in use by another run\n(a second line)")
    assert store.values == {f"{distributed.FAILED}/0": "ConfigError TrainConfig.workdir = '/w' is in use by another run"}
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"^process 0 stopped on an error \(see its output\): TrainConfig.workdir = "
                                       r"'/w' is in use by another run$"):
        distributed._wait_for(store, "holmes_jax/x/1/0", time.monotonic() + 60)  # bad input there: status 2 here too
    assert time.monotonic() - started < 5
    store.values.clear()
    with pytest.raises(OSError), distributed.errors_told():
        raise OSError(28, "No space left on device")
    with pytest.raises(RunError, match=r"^process 0 stopped on an error \(see its output\): \[Errno 28\] No space"):
        distributed._wait_for(store, "holmes_jax/x/2/0", time.monotonic() + 60)


def test_an_error_in_lockstep_on_one_process_alone_ends_it_without_the_exit_barrier(monkeypatch):
    """An error on one process in the loop left it in JAX's shutdown barrier, the others waiting for
    it in the next step's collective, until the barrier's five-minute timeout."""
    import jax

    monkeypatch.setattr(cli, "_leaving_at_once", None)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    with pytest.raises(RunError), distributed.Lockstep() as lockstep:
        with lockstep.agreed():  # every process raises it at the same point: all leave the normal way
            raise RunError("the loss was not finite for 3 steps in a row")
    assert not lockstep.left and cli._leaving_at_once is None
    with pytest.raises(RuntimeError), distributed.Lockstep() as lockstep:
        with lockstep.agreed():
            pass
        raise RuntimeError("a bug on this process")
    assert lockstep.left and cli._leaving_at_once == 0
    monkeypatch.setattr(jax, "process_index", lambda: 0)  # its end ends the service: it goes last
    with pytest.raises(RuntimeError), distributed.Lockstep() as lockstep:
        raise RuntimeError("a bug on this process")
    assert lockstep.left and cli._leaving_at_once == distributed.LAST_TO_LEAVE_S > 0
    monkeypatch.setattr(cli, "_leaving_at_once", None)
    with distributed.Lockstep() as lockstep:
        pass
    assert not lockstep.left and cli._leaving_at_once is None
    monkeypatch.setattr(jax, "process_count", lambda: 1)  # no one waits for a lone process
    with pytest.raises(RuntimeError), distributed.Lockstep() as lockstep:
        raise RuntimeError("a bug")
    assert not lockstep.left and cli._leaving_at_once is None


def test_a_held_stop_signal_ends_a_wait_for_a_process_that_has_not_come(monkeypatch):
    import jax

    class Never:
        def blocking_key_value_get(self, key, timeout_ms):
            os.kill(os.getpid(), signal.SIGTERM)  # while this process waits
            raise jax.errors.JaxRuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")

    with cli.SignalHold(), pytest.raises(cli.Signalled) as stopped:
        distributed._wait_for(Never(), "k", time.monotonic() + 60)
    assert stopped.value.signum == signal.SIGTERM
