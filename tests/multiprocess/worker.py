"""One process of a multi-process test job (started by jax_smddp.tools.launch).

Usage: worker.py SCENARIO PROCESS_ID NUM_PROCESSES COORDINATOR DEVICES_PER_PROCESS

Prints one line `RESULT <json>` at the end: {"ok": true} or {"ok": false,
"error": "..."}. Scenarios check jax_smddp's collectives against numpy on
data that reveals misplaced blocks (every element distinct). They live in
scenarios_collectives.py, scenarios_job.py, scenarios_faults.py and scenarios_xla.py, on the
shared harness.py (the process's set-up and helpers).
"""

from __future__ import annotations

import os
import sys
import traceback

# First: it sets XLA_FLAGS and starts jax.distributed before any scenario file imports jax.
import harness
import scenarios_collectives
import scenarios_faults
import scenarios_job
import scenarios_xla

import jax

import jax_smddp as smddp

SCENARIOS = {name[len("scenario_"):]: fn
             for module in (scenarios_collectives, scenarios_job, scenarios_faults, scenarios_xla)
             for name, fn in vars(module).items() if name.startswith("scenario_")}

if __name__ == "__main__":
  try:
    SCENARIOS[harness.scenario]()
  except Exception as e:  # noqa: BLE001
    traceback.print_exc()
    harness.result(ok=False, error=f"{type(e).__name__}: {e}")
    sys.stdout.flush()
    os._exit(1)
  smddp.shutdown()
  jax.distributed.shutdown()
