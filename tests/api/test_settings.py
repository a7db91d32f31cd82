"""The settings registries: every JAX_SMDDP_* name the code reads is declared
once, in the user's registry or the test-only one, the docs tables are the
registries', and a bad value is an error naming the setting and what it
accepts, from C++ and Python alike."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import jax_smddp
from jax_smddp import config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
READ_BY_CODE = ("jax_smddp", "xla_ffi", "cuda", "tests", "scripts", "examples")
# JAX_SMDDP_ names that are not environment settings: CMake options and include guards
# (the mock CUDA build's macro is SMDDP_MOCK_CUDA_RUNTIME, outside the settings' prefix).
NOT_SETTINGS = {"JAX_SMDDP_CUDA", "JAX_SMDDP_LIBFABRIC", "JAX_SMDDP_TESTING"}


def names_in_code() -> dict[str, list[str]]:
  """Every JAX_SMDDP_ name the code names: the files naming it."""
  found = {}
  for top in READ_BY_CODE:
    for root, _, files in os.walk(os.path.join(REPO, top)):
      for f in files:
        if not f.endswith((".py", ".cc", ".h", ".cu", ".cuh", ".sh")) or f == "test_settings.py":
          continue  # (this file names settings that do not exist, on purpose)
        path = os.path.join(root, f)
        with open(path, errors="ignore") as fh:
          for name in re.findall(r"JAX_SMDDP_[A-Z0-9_]*[A-Z0-9]", fh.read()):
            if not name.endswith(("_H", "_CUH")) and name not in NOT_SETTINGS:
              where = found.setdefault(name, [])
              if os.path.relpath(path, REPO) not in where:
                where.append(os.path.relpath(path, REPO))
  return found


def all_specs() -> list[dict]:
  """Both registries: the user's and the test-only one."""
  return config.specs() + config.test_specs()


def test_every_setting_the_code_names_is_declared():
  declared = {s["name"] for s in all_specs()}
  missing = {n: where for n, where in names_in_code().items() if n not in declared}
  assert not missing, f"not in the registry (xla_ffi/common/settings.cc): {missing}"


TYPED_READ = re.compile(r'\b(IntSetting|SecondsSetting|DeclaredDefault|IntSettingIfSet|TextSetting)'
                        r'\(\s*"(JAX_SMDDP_[A-Z0-9_]+)"\s*([,)])')


def typed_reads() -> list[tuple[str, str, str, str]]:
  """(file, function, setting, what follows the name) of every typed read in the native code."""
  found = []
  for top in ("xla_ffi", "cuda", os.path.join("tests", "native")):
    for root, _, files in os.walk(os.path.join(REPO, top)):
      for f in files:
        if f.endswith((".cc", ".h", ".cu", ".cuh")) and f not in ("settings.cc", "settings.h"):
          with open(os.path.join(root, f), errors="ignore") as fh:
            for fn, name, after in TYPED_READ.findall(fh.read()):
              found.append((os.path.relpath(os.path.join(root, f), REPO), fn, name, after))
  return found


def test_typed_reads_take_the_registry_default():
  # Each default is stated once, in the registry: IntSetting, SecondsSetting
  # and DeclaredDefault return the declared default, so what they read must
  # declare a value; a setting whose default is worked out at run time
  # ("cores - 1") is read with IntSettingIfSet, and one whose default is a
  # value never is (its caller would state the default again); TextSetting
  # reads choice, list and text settings. No read passes a default of its own.
  specs = {s["name"]: s for s in all_specs()}
  reads = typed_reads()
  assert len(reads) >= 25, reads  # the check sees the code
  assert {fn for _, fn, _, _ in reads} >= {"IntSetting", "IntSettingIfSet", "TextSetting",
                                           "DeclaredDefault"}, reads
  wrong = []
  for path, fn, name, after in reads:
    if fn == "IntSettingIfSet":
      if _declares_a_value(specs[name]):
        wrong.append(f"{path}: IntSettingIfSet(\"{name}\") and a default of the caller's, "
                     f"although the registry declares one ({specs[name]['default']}): IntSetting")
      continue
    if fn == "TextSetting":
      if specs[name]["kind"] not in ("choice", "list", "text"):
        wrong.append(f"{path}: TextSetting(\"{name}\") reads a {specs[name]['kind']} setting")
      continue
    if after == ",":
      wrong.append(f"{path}: {fn}(\"{name}\", ...) states a default beside the registry's")
      continue
    try:
      value = config.parse(name, specs[name]["default"])
    except ValueError as e:
      wrong.append(f"{path}: {fn}(\"{name}\"): its declared default is not a value ({e}); "
                   "read it with IntSettingIfSet and the run-time default")
      continue
    if not isinstance(value, (int, float)):
      wrong.append(f"{path}: {fn}(\"{name}\"): not a numeric setting")
  assert not wrong, "\n".join(wrong)


def _declares_a_value(spec: dict) -> bool:
  try:
    return config.default(spec["name"]) is not None
  except ValueError:  # a description ("cores - 1")
    return False


PY_SECOND_DEFAULT = re.compile(r'config\.get\(\s*"(JAX_SMDDP_[A-Z0-9_]+)"\s*\)\s*or\s*([^\s),]+)')


def test_python_reads_take_the_registry_default(monkeypatch):
  # config.value: the environment's value, else the registry's default (never a second literal).
  for name in ("JAX_SMDDP_GPU_SLOT_BYTES", "JAX_SMDDP_TIMEOUT_S", "JAX_SMDDP_GPU_STREAM",
               "JAX_SMDDP_FABRIC_HMEM", "JAX_SMDDP_REQUIRE", "JAX_SMDDP_MOCK_WAIT_S"):
    monkeypatch.delenv(name, raising=False)
    spec = next(s for s in all_specs() if s["name"] == name)
    want = None if spec["default"].startswith("unset") else config.parse(name, spec["default"])
    assert config.default(name) == want and config.value(name) == want, name
  monkeypatch.setenv("JAX_SMDDP_GPU_SLOT_BYTES", "1M")
  assert config.value("JAX_SMDDP_GPU_SLOT_BYTES") == 1 << 20
  with pytest.raises(ValueError):
    config.default("JAX_SMDDP_CPU_HELPERS")  # "cores - 1": a description, not a value
  with pytest.raises(ValueError, match="not a setting"):
    config.default("JAX_SMDDP_NO_SUCH_SETTING")
  # No Python read states a default beside the registry's: `config.get("X") or <value>`.
  wrong = []
  for root, _, files in os.walk(os.path.join(REPO, "jax_smddp")):
    for f in files:
      if f.endswith(".py"):
        with open(os.path.join(root, f)) as fh:
          for name, fallback in PY_SECOND_DEFAULT.findall(fh.read()):
            if fallback not in ('""', "[]", "None", "()"):
              wrong.append(f"{f}: config.get({name!r}) or {fallback}: use config.value")
  assert not wrong, "\n".join(wrong)


def test_the_docs_table_is_generated_from_the_registry():
  with open(os.path.join(REPO, "docs", "settings.md")) as f:
    docs = f.read()
  assert config.markdown() in docs, "docs/settings.md is stale: regenerate it with " \
                                    "python -m jax_smddp.doctor --settings"


def test_the_test_settings_table_is_generated_from_their_registry():
  with open(os.path.join(REPO, "docs", "architecture.md")) as f:
    docs = f.read()
  assert config.markdown(tests=True) in docs, "docs/architecture.md's test-only settings are " \
      "stale: regenerate the table with python -m jax_smddp.doctor --test-settings"


# A setting is for tests only when its name says so (a TEST or MOCK word) or when only
# tests/ name it (the registries' declarations aside): the rule the registries must follow.
TEST_ONLY_NAME = re.compile(r"^JAX_SMDDP_(?:[A-Z0-9]+_)*(?:TEST|MOCK)(?:_|$)")
REGISTRIES = (os.path.join("xla_ffi", "common", "settings.cc"),
              os.path.join("xla_ffi", "common", "test_settings.cc"))


def test_only_test_settings_are_in_the_test_registry_and_out_of_the_users_docs():
  named = {n: [w for w in where if w not in REGISTRIES] for n, where in names_in_code().items()}
  by_code = {n for n, where in named.items()
             if TEST_ONLY_NAME.match(n) or (where and all(w.startswith("tests" + os.sep)
                                                          for w in where))}
  users = {s["name"] for s in config.specs()}
  tests = {s["name"] for s in config.test_specs()}
  assert len(tests) >= 15 and len(by_code) >= 15, (tests, by_code)  # the check sees them
  assert not by_code & users, "settings only tests set, in the user's registry: move them " \
      f"to xla_ffi/common/test_settings.cc: {sorted(by_code & users)}"
  hidden = {n: named.get(n) for n in tests - by_code}
  assert not hidden, "in the test-only registry but named by code outside tests/ and without " \
      f"TEST or MOCK in its name (a user's setting?): {hidden}"
  assert not set(jax_smddp.settings()) & tests, "jax_smddp.settings() lists test-only settings"
  with open(os.path.join(REPO, "docs", "settings.md")) as f:
    docs = f.read()
  in_docs = sorted(n for n in tests if n in docs)
  assert not in_docs, f"docs/settings.md names test-only settings: {in_docs}"


DECLARATION = re.compile(r'^\s*\{"(JAX_SMDDP_[A-Z0-9_]+)",', re.M)


def test_no_setting_is_declared_twice():
  # Across both registries: the engine's lookup would take the first, silently.
  names = [s["name"] for s in all_specs()]
  twice = sorted({n for n in names if names.count(n) > 1})
  assert not twice, f"declared twice (xla_ffi/common/settings.cc, test_settings.cc): {twice}"
  # The registries' sources declare what the engine lists, each name once.
  declared = []
  for path in REGISTRIES:
    with open(os.path.join(REPO, path)) as f:
      declared += DECLARATION.findall(f.read())
  assert sorted(declared) == sorted(names), "rebuild: the engine's registries differ from " \
      f"their sources: {sorted(set(declared) ^ set(names)) or 'a name declared twice'}"


def test_settings_lists_every_declared_setting_with_its_value(monkeypatch):
  monkeypatch.setenv("JAX_SMDDP_CHUNK_BYTES", "64K")
  monkeypatch.setenv("JAX_SMDDP_GPU_STREAM", " Compute ")
  s = jax_smddp.settings()
  assert set(s) == {d["name"] for d in config.specs()}
  assert s["JAX_SMDDP_CHUNK_BYTES"]["value"] == 65536
  assert s["JAX_SMDDP_GPU_STREAM"]["value"] == "compute"
  assert s["JAX_SMDDP_TIMEOUT_S"]["value"] is None and s["JAX_SMDDP_TIMEOUT_S"]["default"] == "300"


@pytest.mark.parametrize("name,bad,accepts", [
    ("JAX_SMDDP_TIMEOUT_S", "soon", "a number of seconds from 0.001"),
    ("JAX_SMDDP_TIMEOUT_S", "0", "a number of seconds from 0.001"),
    ("JAX_SMDDP_SHM_RING_BYTES", "100", "a byte count from 4096 to 1073741824"),
    ("JAX_SMDDP_CPU_HELPERS", "2x", "an integer from 0 to 1024"),
    ("JAX_SMDDP_HIERARCHICAL", "yes", "one of 0|1"),
    ("JAX_SMDDP_REQUIRE", "efa,gpus", "a comma list of libfabric|efa|cuda|gdrcopy|mps|no-fallback"),
    ("JAX_SMDDP_MOCK_TOPOLOGY", "ring", "one of nvlink|pcie|pcie_nop2p"),  # a test-only one
])
def test_a_bad_value_is_an_error_naming_the_setting(monkeypatch, name, bad, accepts):
  monkeypatch.setenv(name, bad)
  with pytest.raises(ValueError) as e:
    config.validate()
  assert f"{name}='{bad}' is not valid: it takes {accepts}" in str(e.value)
  with pytest.raises(ValueError, match=re.escape(f"{name}='{bad}'")):
    config.get(name)


def test_values_the_engine_reads_parse_alike_in_python():
  assert config.parse("JAX_SMDDP_SHM_RING_BYTES", "1M") == 1 << 20
  assert config.parse("JAX_SMDDP_FABRIC_HMEM", " AUTO ") == "auto"
  assert config.parse("JAX_SMDDP_REQUIRE", "efa, libfabric") == ["efa", "libfabric"]
  assert config.parse("JAX_SMDDP_TIMEOUT_S", "2.5") == 2.5
  assert config.parse("JAX_SMDDP_TIMEOUT_S", "") is None


@pytest.mark.timeout(120)
def test_a_bad_value_fails_the_first_collective_and_the_doctor(tmp_path):
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_SMDDP_")}
  env.update(JAX_SMDDP_SHM_RING_BYTES="lots", JAX_SMDDP_TIMEOUT_SECONDS="5")
  program = ("import jax, jax.numpy as jnp, jax_smddp\n"
             "from jax.sharding import NamedSharding, PartitionSpec as P\n"
             "mesh = jax.make_mesh((1,), ('x',))\n"
             "f = jax.jit(jax.shard_map(lambda v: jax_smddp.psum(v, 'x'), mesh=mesh,\n"
             "                          in_specs=P('x'), out_specs=P('x')))\n"
             "try:\n"
             "  f(jax.device_put(jnp.ones(4), NamedSharding(mesh, P('x'))))\n"
             "except ValueError as e:\n"
             "  print('RAISED', e)\n")
  run = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=100)
  assert "RAISED JAX_SMDDP_SHM_RING_BYTES='lots' is not valid" in run.stdout, run.stdout + run.stderr
  assert "JAX_SMDDP_TIMEOUT_SECONDS is not a jax_smddp setting and is ignored (did you mean " \
         "JAX_SMDDP_TIMEOUT_S?)" in run.stderr, run.stderr
  doctor = subprocess.run([sys.executable, "-m", "jax_smddp.doctor"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=100)
  assert doctor.returncode == 1, doctor.stdout + doctor.stderr
  assert re.search(r"settings\s+FAIL\s+JAX_SMDDP_SHM_RING_BYTES='lots'", doctor.stdout), doctor.stdout


def test_non_default_lists_what_differs_from_the_registry_defaults(monkeypatch):
  for name in [k for k in os.environ if k.startswith("JAX_SMDDP_")]:
    monkeypatch.delenv(name)
  assert config.non_default() == {} and config.format_non_default() == \
      "jax_smddp settings: all defaults"
  # Equal to the default (as parsed: 8M is 8388608 bytes, 1 is the choice's default): left out.
  monkeypatch.setenv("JAX_SMDDP_SHM_RING_BYTES", str(8 << 20))
  monkeypatch.setenv("JAX_SMDDP_HIERARCHICAL", "1")
  monkeypatch.setenv("JAX_SMDDP_TIMEOUT_S", "300")
  assert config.non_default() == {}
  # Different, or a default that is a description: listed as set.
  monkeypatch.setenv("JAX_SMDDP_SHM_RING_BYTES", "4M")
  monkeypatch.setenv("JAX_SMDDP_COLLECTIVES", "xla")
  monkeypatch.setenv("JAX_SMDDP_CPU_HELPERS", "1")
  assert config.non_default() == {"JAX_SMDDP_SHM_RING_BYTES": "4M",
                                  "JAX_SMDDP_COLLECTIVES": "xla", "JAX_SMDDP_CPU_HELPERS": "1"}
  # The deadline changed in the program, not in the environment.
  monkeypatch.delenv("JAX_SMDDP_TIMEOUT_S")
  old = jax_smddp.timeout()
  jax_smddp.set_timeout(42)
  try:
    assert config.non_default()["JAX_SMDDP_TIMEOUT_S"] == "42 (jax_smddp.set_timeout)"
  finally:
    jax_smddp.set_timeout(old)


# --- Each default once: what the code may not restate, and the copies it keeps on purpose ---

# Python constants that mirror a setting's default, each checked here against the
# registry: (module, constant) -> setting. Lines that define them may name their setting
# beside its value; nothing else may.
CHECKED_COPIES = {
    ("jax_smddp.cost_model", "DEFAULT_CHUNK_BYTES"): "JAX_SMDDP_CHUNK_BYTES",
    ("jax_smddp.cost_model", "RING_CHUNK_BYTES"): "JAX_SMDDP_STAGGER_CHUNK_BYTES",
    ("jax_smddp.cost_model", "HELPER_MIN_BYTES"): "JAX_SMDDP_CPU_HELPER_MIN_BYTES",
}

_UNITS = {"K": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GIB": 1 << 30}
_NUM = r"\d(?:'?\d)*"  # C++ digit separators too (300'000)


def _literals(line: str) -> set[float]:
  """The numbers a line of code or comment writes: plain, shifted (1 << 20),
  multiplied (256 * 1024) or with a unit (256 KiB, 8M)."""
  found = set()
  for a, k in re.findall(rf"({_NUM})\s*<<\s*(\d+)", line):
    found.add(float(int(a.replace("'", "")) << int(k)))
  for product in re.findall(rf"{_NUM}(?:\s*\*\s*{_NUM})+", line):
    v = 1
    for factor in re.split(r"\s*\*\s*", product):
      v *= int(factor.replace("'", ""))
    found.add(float(v))
  for n, unit in re.findall(rf"\b({_NUM}(?:\.\d+)?)\s*(KiB|MiB|GiB|K|M|G)\b", line):
    found.add(float(n.replace("'", "")) * _UNITS[unit.upper()])
  for n in re.findall(rf"(?<![\w.]){_NUM}(?:\.\d+)?(?![\w.])", line):
    found.add(float(n.replace("'", "")))
  return found


def restated_defaults(repo: str) -> list[str]:
  """Lines of the native code and the package that write a numeric setting's declared
  default beside the setting's name (on its line, the one before or the one after)."""
  specs = {s["name"]: s for s in all_specs()}
  defaults = {}
  for name, s in specs.items():
    if s["kind"] in ("int", "bytes", "seconds") and _declares_a_value(s):
      value = float(config.default(name))
      defaults[name] = {value, value * 1000} if s["kind"] == "seconds" else {value}  # ms too
  copies = {(m.rsplit(".", 1)[-1] + ".py", c) for m, c in CHECKED_COPIES}
  found = []
  for top in ("xla_ffi", "cuda", "jax_smddp"):
    for root, _, files in os.walk(os.path.join(repo, top)):
      for f in files:
        if not f.endswith((".cc", ".h", ".cu", ".cuh", ".py")) or \
            f in ("settings.cc", "test_settings.cc"):  # the registries
          continue
        path = os.path.join(root, f)
        with open(path, errors="ignore") as fh:
          lines = fh.read().split("\n")
        for i, line in enumerate(lines):
          if any(f == file and re.match(rf"\s*{c}\s*=", line) for file, c in copies):
            continue
          for name in set(re.findall(r"JAX_SMDDP_[A-Z0-9_]*[A-Z0-9]", line)) & set(defaults):
            for near in lines[max(0, i - 1):i + 2]:
              if _literals(near) & defaults[name]:
                found.append(f"{os.path.relpath(path, repo)}:{i + 1}: {name} beside its default "
                             f"({specs[name]['default']}): {near.strip()}")
  return found


def test_no_code_restates_a_default_beside_the_registry():
  found = restated_defaults(REPO)
  assert not found, "defaults stated again (the registry, xla_ffi/common/settings.cc, states " \
                    "each once; read it, or name it without its value):\n" + "\n".join(found)


def test_the_check_finds_a_planted_default(tmp_path):
  # A copy of the tree with one literal default planted where timeout.cc reads the
  # registry: the check above must name it.
  for top in ("xla_ffi", "cuda", "jax_smddp"):
    os.symlink(os.path.join(REPO, top), tmp_path / top)
  assert restated_defaults(str(tmp_path)) == []
  planted = tmp_path / "cuda" / "planted.cc"
  (tmp_path / "cuda").unlink()
  (tmp_path / "cuda").mkdir()
  planted.write_text("// JAX_SMDDP_TIMEOUT_S\nstd::atomic<int64_t> g_timeout_ms{300'000};\n"
                     "const size_t ring = 8 << 20;  // JAX_SMDDP_SHM_RING_BYTES\n")
  found = restated_defaults(str(tmp_path))
  assert len(found) == 2 and "JAX_SMDDP_TIMEOUT_S" in found[0] and \
      "JAX_SMDDP_SHM_RING_BYTES" in found[1], found


def test_python_copies_of_defaults_equal_the_registry():
  import importlib
  for (module, constant), name in CHECKED_COPIES.items():
    assert getattr(importlib.import_module(module), constant) == config.default(name), \
        f"{module}.{constant} differs from {name}'s declared default"


@pytest.mark.engine
def test_typed_reads_in_the_engine(monkeypatch):
  # IntSetting, SecondsSetting, IntSettingIfSet and TextSetting as the engine calls them:
  # unset, the registry's default (IntSettingIfSet: not set; TextSetting: a choice's declared
  # default, "" for a default that is a description); set, the value parsed as Python parses it.
  from helpers import engine_probes
  probes = engine_probes()
  for name in [k for k in os.environ if k.startswith("JAX_SMDDP_")]:
    monkeypatch.delenv(name)
  checked = 0
  for s in all_specs():
    name, kind = s["name"], s["kind"]
    if kind in ("int", "bytes", "seconds"):
      assert probes.typed_setting("int_if_set", name) is None, name
      if _declares_a_value(s):
        how = "seconds" if kind == "seconds" else "int"
        assert probes.typed_setting(how, name) == config.default(name), name
        assert probes.typed_setting("declared", name) == config.default(name), name
        checked += 1
    elif kind == "choice":
      spec_default = s["default"]
      want = spec_default if spec_default in s["choices"].split("|") else ""
      assert probes.typed_setting("text", name) == want, name
      checked += 1
    else:
      assert probes.typed_setting("text", name) == "", name
  assert checked >= 30
  monkeypatch.setenv("JAX_SMDDP_CPU_HELPER_MIN_BYTES", "64K")
  assert probes.typed_setting("int_if_set", "JAX_SMDDP_CPU_HELPER_MIN_BYTES") == 65536
  assert probes.typed_setting("int", "JAX_SMDDP_CPU_HELPER_MIN_BYTES") == 65536
  assert probes.typed_setting("declared", "JAX_SMDDP_CPU_HELPER_MIN_BYTES") == 256 << 10
  monkeypatch.setenv("JAX_SMDDP_CPU_HELPER_MIN_BYTES", "lots")  # invalid: as unset
  assert probes.typed_setting("int_if_set", "JAX_SMDDP_CPU_HELPER_MIN_BYTES") is None
  assert probes.typed_setting("int", "JAX_SMDDP_CPU_HELPER_MIN_BYTES") == 256 << 10
  monkeypatch.setenv("JAX_SMDDP_TIMEOUT_S", "2.5")
  assert probes.typed_setting("seconds", "JAX_SMDDP_TIMEOUT_S") == 2.5
  monkeypatch.setenv("JAX_SMDDP_FABRIC_WAIT", " Sleep ")
  assert probes.typed_setting("text", "JAX_SMDDP_FABRIC_WAIT") == "sleep"
  monkeypatch.setenv("JAX_SMDDP_FABRIC_WAIT", "never")  # invalid: the declared default
  assert probes.typed_setting("text", "JAX_SMDDP_FABRIC_WAIT") == "fd"
  # The computed default of JAX_SMDDP_CPU_HELPERS, from its one hook.
  assert probes.cpu_helpers() == probes.cores_available() - 1
  monkeypatch.setenv("JAX_SMDDP_CPU_HELPERS", "3")
  assert probes.cpu_helpers() == 3


@pytest.mark.engine
@pytest.mark.timeout(60)
def test_the_engine_deadline_starts_at_the_registry_default(tmp_path):
  # Before anyone calls set_timeout (a front end loaded without jax_smddp's Python), the
  # deadline is the declared default, whatever the environment says.
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_SMDDP_")}
  env["JAX_SMDDP_TIMEOUT_S"] = "7"
  run = subprocess.run([sys.executable, "-c", "import _smddp_testing as t; print(t.timeout_seconds())"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=50)
  assert run.returncode == 0, run.stderr
  assert float(run.stdout) == config.default("JAX_SMDDP_TIMEOUT_S")
