"""The drop-in switch changes who runs the collectives, nothing else: a program that sets its
own XLA_FLAGS (with os.environ.setdefault, by assignment, or from the shell) gets the same
devices, shapes and answers with JAX_SMDDP_COLLECTIVES unset, `all` and `xla`. Each case is a
fresh interpreter, as a user starts one (the switch acts at start-up, through jax_smddp.pth)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(240)

DEVICES = "--xla_force_host_platform_device_count=8"

# A jax.lax program on 8 CPU devices, as a user writes one; `SET_FLAGS` is how it sets XLA_FLAGS.
PROGRAM = """
    import json, os, re
    SET_FLAGS
    import numpy as np
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    x = np.arange(jax.device_count() * 64 * 3, dtype=np.float32).reshape(-1, 3) % 23 - 11

    def body(b):
      return (jax.lax.all_gather(b, "x", tiled=True), jax.lax.psum_scatter(b, "x", tiled=True),
              jax.lax.psum(b, "x"))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x"), P())))
    xs = jax.device_put(x, NamedSharding(mesh, P("x")))
    outs = [np.asarray(o) for o in f(xs)]
    n = jax.device_count()
    blocks = x.reshape(n, -1, 3)
    # every device's gathered copy, side by side; psum_scatter's shards in device order: the sum
    want = [np.tile(x, (n, 1)), blocks.sum(0), blocks.sum(0)]
    print("RESULT " + json.dumps({
        "devices": n,
        "shapes": [list(o.shape) for o in outs],
        "right": [o.shape == w.shape and bool(np.array_equal(o, w)) for o, w in zip(outs, want)],
        "sums": [float(o.sum()) for o in outs],
        "smddp": sorted(set(re.findall(r"custom_call @(smddp_\\w+)", f.lower(xs).as_text()))),
        "xla_flags": os.environ.get("XLA_FLAGS"),
    }))
    """

WAYS = {
    "setdefault": f'os.environ.setdefault("XLA_FLAGS", "{DEVICES}")',
    "assignment": f'os.environ["XLA_FLAGS"] = "{DEVICES}"',
    "shell": "",
}


def _run(way: str, switch: str | None, cwd) -> dict:
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "PYTHONPATH") and not k.startswith("JAX_SMDDP_")}
  env["JAX_PLATFORMS"] = "cpu"
  if way == "shell":
    env["XLA_FLAGS"] = DEVICES
  if switch is not None:
    env["JAX_SMDDP_COLLECTIVES"] = switch
  code = textwrap.dedent(PROGRAM).replace("SET_FLAGS", WAYS[way])
  run = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=200)
  assert run.returncode == 0, f"{way}, switch {switch}: {run.stderr[-3000:]}"
  line = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")][-1]
  return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("way", list(WAYS))
def test_the_switch_keeps_the_programs_xla_flags(way, tmp_path):
  """Off, `all` and `xla`: 8 devices, the same shapes and answers (exact, against numpy), and
  XLA_FLAGS as the program set it; with `all` the collectives are jax_smddp's custom calls."""
  off = _run(way, None, tmp_path)
  assert off["devices"] == 8 and off["right"] == [True, True, True], off
  assert off["shapes"] == [[4096, 3], [64, 3], [64, 3]], off
  assert off["smddp"] == [] and off["xla_flags"] == DEVICES, off
  for switch in ("all", "xla"):
    on = _run(way, switch, tmp_path)
    assert {k: on[k] for k in ("devices", "shapes", "right", "sums", "xla_flags")} == \
        {k: off[k] for k in ("devices", "shapes", "right", "sums", "xla_flags")}, (switch, on, off)
    if switch == "all":
      assert on["smddp"] == ["smddp_all_gather", "smddp_all_reduce", "smddp_reduce_scatter"], on
