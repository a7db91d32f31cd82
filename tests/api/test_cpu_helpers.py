"""The default of JAX_SMDDP_CPU_HELPERS: the cores a process may use shared among the job's
processes on its host, less the one the last arrival runs on (inprocess_rendezvous.h,
DefaultCpuHelpers), and read from the world the process is in at the time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import engine_probes

probes = engine_probes()

pytestmark = pytest.mark.engine


def reference(cores: int, local_processes: int) -> int:
  """The rule as the registry states it, written out: whole cores per local process, less one."""
  share = max(cores, 1) // max(local_processes, 1)
  return share - 1 if share > 1 else 0


@pytest.mark.timeout(60)
def test_the_default_shares_the_hosts_cores_among_its_processes():
  # The registry's examples: 8 processes on 96 cores get 11 each, not 95 (760 helper threads
  # on the host, the count); 2 processes on 2 cores none.
  assert probes.default_cpu_helpers(96, 8) == 11
  assert probes.default_cpu_helpers(2, 2) == 0
  assert probes.default_cpu_helpers(2, 1) == 1  # one process: cores - 1, as before
  assert probes.default_cpu_helpers(96, 1) == 95
  assert probes.default_cpu_helpers(8, 3) == 1  # whole cores: 2 each, less the last arrival's
  assert probes.default_cpu_helpers(4, 16) == 0  # more processes than cores: none, never < 0
  assert probes.default_cpu_helpers(1, 1) == 0
  assert probes.default_cpu_helpers(0, 0) == 0  # nonsense in, none out
  for cores in range(1, 200):
    for local in range(1, 20):
      assert probes.default_cpu_helpers(cores, local) == reference(cores, local), (cores, local)


# Builds a world of `hosts` (process 0 is this one; no links: none is needed to count) in the
# CPU module, points the probes at it as the CUDA module is pointed, and prints what the
# helpers' hook sees before, during and after it.
_WORLD = """
import json, os, sys
from jax_smddp import _native
import _smddp_testing as probes
engine = _native.engine()
probes.use_world_of(engine.world_source())
hosts = json.loads(sys.argv[1])
seen = {"before": [probes.local_processes(), probes.cpu_helpers()]}
engine.world_begin(0, len(hosts))
for q, host in enumerate(hosts):
  engine.world_set_peer(q, os.getpid() + q, host)
seen["pending"] = [probes.local_processes(), probes.cpu_helpers()]
engine.world_start()
seen["started"] = [probes.local_processes(), probes.cpu_helpers()]
os.environ["JAX_SMDDP_CPU_HELPERS"] = "5"  # set: used as given, whatever the world
seen["set"] = probes.cpu_helpers()
del os.environ["JAX_SMDDP_CPU_HELPERS"]
engine.world_shutdown()
seen["after"] = [probes.local_processes(), probes.cpu_helpers()]
print(json.dumps(seen))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts,local", [(["h", "h", "x", "h"], 3), (["h", "x"], 1),
                                         (["h", "h"], 2)])
def test_the_helpers_follow_the_world_that_starts_later(tmp_path, hosts, local):
  """The rendezvous reads the helpers at each large call (CpuHelpers): a process starts alone
  (1 local process) and takes its host's share once jax_smddp.initialize() starts the world;
  processes on other hosts (another JAX_SMDDP_HOST_ID) take none of its cores."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_SMDDP_")}
  run = subprocess.run([sys.executable, "-c", _WORLD, json.dumps(hosts)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=100)
  assert run.returncode == 0, run.stderr
  seen = json.loads(run.stdout.strip().splitlines()[-1])
  cores = len(os.sched_getaffinity(0))
  alone = [1, reference(cores, 1)]
  assert seen["before"] == alone and seen["pending"] == alone  # no world until it starts
  assert seen["started"] == [local, reference(cores, local)], (cores, seen)
  assert seen["set"] == 5
  assert seen["after"] == alone  # shut down: alone again
