"""The drop-in backend swap: jax.lax collectives lowered through jax_smddp,
with jax_smddp.use in this process and with JAX_SMDDP_COLLECTIVES through the
jax_plugins entry point in a fresh process."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_smddp as smddp
from helpers import mesh_1d, shard
from swap_programs import PROGRAMS, compiled, plugin_calls_in, run, xla_collectives_in

TESTS = pathlib.Path(__file__).parent


def assert_close(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
    if np.issubdtype(w.dtype, np.floating):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    else:
      np.testing.assert_array_equal(g, w)


@pytest.fixture(autouse=True)
def no_swap_left_over():
  assert not smddp.swap.active()
  yield
  assert not smddp.swap.active(), "a test left collectives swapped"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_three_ways(name):
  want, lax_text = run(name, jax.lax)
  assert not plugin_calls_in(lax_text)
  got_api, _ = run(name, smddp)
  with smddp.use("all"):
    got_swap, text = run(name, jax.lax)
  assert_close(got_api, want)
  assert_close(got_swap, want)
  assert plugin_calls_in(text) == sorted(PROGRAMS[name]["calls"])
  assert xla_collectives_in(text) == [], text


@pytest.mark.timeout(120)
def test_use_restores_and_clears_caches():
  f, args = compiled("reductions", jax.lax)
  want = [np.asarray(o) for o in jax.tree_util.tree_leaves(f(*args))]
  assert f._cache_size() == 1
  with smddp.use("all_reduce") as u:
    assert smddp.swap.active() == {"all_reduce"}
    assert "all_reduce" in repr(u)
    assert f._cache_size() == 0  # compiled again with the new lowering
    text = f.lower(*args).as_text()
    assert plugin_calls_in(text) == ["smddp_all_reduce"]
    assert "stablehlo.reduce_scatter" in text  # not swapped
    got = [np.asarray(o) for o in jax.tree_util.tree_leaves(f(*args))]
    with smddp.use("none"):  # nested: nothing swapped inside
      assert not plugin_calls_in(f.lower(*args).as_text())
    assert smddp.swap.active() == {"all_reduce"}
  assert_close(got, want)
  assert not plugin_calls_in(f.lower(*args).as_text())


@pytest.mark.timeout(120)
def test_use_as_a_function():
  f, args = compiled("exchanges", jax.lax)
  try:
    smddp.use("all_to_all,all_gather")
    assert smddp.swap.active() == {"all_to_all", "all_gather"}
    assert plugin_calls_in(f.lower(*args).as_text()) == ["smddp_all_gather", "smddp_all_to_all"]
    smddp.use("psum", "psum_scatter")  # sets exactly these (jax.lax names accepted)
    assert smddp.swap.active() == {"all_reduce", "reduce_scatter"}
    assert not plugin_calls_in(f.lower(*args).as_text())
  finally:
    smddp.use()
  assert not plugin_calls_in(f.lower(*args).as_text())


def test_use_rejects_unknown_names():
  with pytest.raises(ValueError, match="unknown collective 'allgather'"):
    smddp.use("allgather")
  with pytest.raises(TypeError):
    smddp.use(3)


def test_one_parser_of_jax_smddp_collectives():
  """_startup.parse_collectives reads the variable for the start-up hook, the
  plugin's entry point and jax_smddp.use alike, aliases included."""
  from jax_smddp import _startup
  every = frozenset(smddp.swap.OPS)
  for value, ops, xla_swap in [
      ("", frozenset(), False), ("none", frozenset(), False), ("0,off", frozenset(), False),
      ("all", every, True), ("1", every, True), (" TRUE ", every, True), ("on,yes", every, True),
      ("xla", frozenset(), True), ("xla,psum", {"all_reduce"}, True),
      ("pmax,all_gather_invariant", {"all_reduce", "all_gather"}, False)]:
    parsed = _startup.parse_collectives(value)
    assert (parsed.ops, parsed.xla_swap) == (ops, xla_swap), value
    assert smddp.swap.parse(value) == ops and _startup.requested(value) == xla_swap, value
  with pytest.raises(ValueError, match="unknown collective 'bogus'"):
    _startup.parse_collectives("xla,bogus")
  assert _startup.requested("xla,bogus")  # at start-up an unknown name never raises


@pytest.mark.timeout(120)
def test_xla_swap_cannot_start_after_the_cpu_client():
  """use("xla") once JAX's CPU client exists: it cannot change its collectives, and says so."""
  jax.block_until_ready(jnp.zeros(2) + 1)  # the CPU client exists
  with pytest.raises(RuntimeError, match="CPU client already exists"):
    smddp.use("xla")
  assert smddp.swap.active() == frozenset()


def test_xla_swap_in_a_process_started_without_it_raises_at_client_creation(tmp_path):
  """A fresh process that asks for the XLA-level swap from code, without
  MPITRAMPOLINE_LIB at start-up: creating the CPU client raises with what to do,
  rather than running on another implementation."""
  code = textwrap.dedent("""
      import jax_smddp, jax
      jax_smddp.use("xla")
      try:
        jax.devices()
      except RuntimeError as e:
        print("RAISED", e)
  """)
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_SMDDP_COLLECTIVES", "MPITRAMPOLINE_LIB")}
  out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
  assert "RAISED" in out.stdout and "MPITRAMPOLINE_LIB" in out.stdout, out.stdout + out.stderr


def test_unsupported_cases_keep_lax_lowering():
  """complex sums, boolean max, int16 gathers: lax's own lowering, right answers."""
  m = mesh_1d()
  rng = np.random.default_rng(0)
  z = (rng.standard_normal((8, 4)) + 1j * rng.standard_normal((8, 4))).astype(np.complex64)
  b = rng.integers(0, 2, (8, 4)).astype(bool)
  h = rng.integers(-9, 9, (8, 4)).astype(np.int16)

  def body(z, b, h, x):
    return (jax.lax.psum(z, "x"), jax.lax.pmax(b, "x"), jax.lax.all_gather(h, "x", tiled=True),
            jax.lax.psum(x, "x"))

  specs = (P("x"),) * 4
  f = jax.jit(jax.shard_map(body, mesh=m, in_specs=specs, out_specs=(P(), P(), P("x"), P())))
  args = [shard(a, m, P("x")) for a in (z, b, h, z.real.copy())]
  want = [np.asarray(o) for o in f(*args)]
  with smddp.use("all"):
    text = f.lower(*args).as_text()
    got = [np.asarray(o) for o in f(*args)]
  assert_close(got, want)
  assert "stablehlo.all_reduce" in text and "stablehlo.all_gather" in text
  assert plugin_calls_in(text) == ["smddp_all_reduce"]  # the float32 psum only


@pytest.mark.timeout(120)
def test_swap_under_explicit_fsdp_types():
  """lax's all_gather(to="reduced") / unreduced_psum_scatter pair (explicit
  sharding FSDP) is swapped too."""
  from jax.sharding import AxisType, NamedSharding
  m = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
  w = jax.device_put(np.arange(64 * 4, dtype=np.float32).reshape(64, 4) / 100,
                     NamedSharding(m, P("x")))
  x = jax.device_put(np.ones((16, 64), np.float32), NamedSharding(m, P("x")))

  def loss(w, x):
    full = jax.shard_map(lambda b: jax.lax.all_gather(b, "x", tiled=True, to="reduced"), mesh=m,
                         in_specs=P("x"), out_specs=P(None, reduced={"x"}))(w)
    return jnp.sum(jnp.tanh(x @ full))

  f = jax.jit(jax.value_and_grad(loss))
  with jax.set_mesh(m):
    want = f(w, x)
    with smddp.use("all"):
      text = f.lower(w, x).as_text()
      got = f(w, x)
  assert {"smddp_all_gather", "smddp_reduce_scatter"} <= set(plugin_calls_in(text))
  assert "stablehlo.all_gather" not in text and "stablehlo.reduce_scatter" not in text
  for g, v in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(v), rtol=1e-5, atol=1e-5)


# --- the environment variable, read by the jax_plugins entry point ------------

_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    import jax
    jax.config.update("jax_enable_x64", True)
    assert "jax_smddp" not in sys.modules
    jax.devices()  # backends initialise: JAX imports the jax_plugins entry points
    plugin_loaded = "jax_smddp" in sys.modules
    from jax_smddp import swap
    from swap_programs import PROGRAMS, run
    out = {{"plugin_loaded": plugin_loaded, "active": sorted(swap.active()), "texts": {{}}}}
    arrays = {{}}
    for name in {names!r}:
      results, text = run(name, jax.lax)  # plain jax.lax code
      out["texts"][name] = text
      for i, r in enumerate(results):
        arrays[f"{{name}}/{{i}}"] = r
    np.savez({npz!r}, **arrays)
    print(json.dumps(out))
""")


def _child(tmp_path, value, names):
  npz = str(tmp_path / "results.npz")
  script = tmp_path / "child.py"
  script.write_text(_CHILD.format(tests=str(TESTS), names=list(names), npz=npz))
  env = dict(os.environ)
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  env["JAX_PLATFORMS"] = "cpu"
  env["JAX_SMDDP_COLLECTIVES"] = value
  proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                        timeout=200, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  with np.load(npz) as data:
    arrays = {k: data[k] for k in data.files}
  return out, arrays, proc.stderr


@pytest.mark.timeout(300)
def test_env_var_swaps_unmodified_lax_program(tmp_path):
  names = ["fsdp_layer", "reductions", "exchanges", "hybrid_2d"]
  out, arrays, _ = _child(tmp_path, "all", names)
  assert out["plugin_loaded"], "the jax_plugins entry point did not run at backend init"
  assert out["active"] == ["all_gather", "all_reduce", "all_to_all", "collective_permute",
                           "reduce_scatter"]
  for name in names:
    text = out["texts"][name]
    assert plugin_calls_in(text) == sorted(PROGRAMS[name]["calls"]), name
    assert xla_collectives_in(text) == [], name
    want, _ = run(name, jax.lax)  # this process: jax.lax's own lowering
    api, _ = run(name, smddp)
    got = [arrays[f"{name}/{i}"] for i in range(len(want))]
    assert_close(got, want)
    assert_close(api, want)


@pytest.mark.timeout(200)
def test_env_var_subset_and_bad_value(tmp_path):
  out, _, _ = _child(tmp_path, "all_gather, psum_scatter", ["fsdp_layer"])
  assert out["active"] == ["all_gather", "reduce_scatter"]
  text = out["texts"]["fsdp_layer"]
  assert plugin_calls_in(text) == ["smddp_all_gather", "smddp_reduce_scatter"]
  assert xla_collectives_in(text) == ["stablehlo.all_reduce"]

  out, _, stderr = _child(tmp_path, "allgather", ["reductions"])
  assert out["active"] == []  # the program still runs, on jax.lax
  assert "JAX_SMDDP_COLLECTIVES" in stderr and "unknown collective" in stderr
