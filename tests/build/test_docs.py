"""Documentation that is executed: every Python block of README.md and docs/*.md
runs, and every shell command README.md shows runs from the checkout's root, as
a user types it.

Python blocks (```python) run in a fresh interpreter of this environment, each
with its own settings (no XLA_FLAGS or JAX_SMDDP_* of this suite), from an empty
folder; tracebacks name the Markdown file and its line. Shell commands (lines
indented by 4 spaces, or ```bash blocks) run with bash from the checkout's root,
with this environment's bin/ first on PATH (as an activated environment);
`.venv/py311/bin/python` is this interpreter (so the Python 3.12 suite checks its
own environment; commands under mpirun it leaves to the first suite).

A block that cannot run as it stands says so on the line before it (blank lines
between allowed), with a reason:

  <!-- docs-test: compile-only (needs a GPU) -->           Python: compiled, not run
  <!-- docs-test: fixture NAME (what it supplies) -->       Python: run with FIXTURES[NAME]
  <!-- docs-test: setup (why it is not rerun) -->           shell: the script exists and parses
  <!-- docs-test: usage (what is checked) -->               shell: a synopsis; its --help is run
                                                            and has each --option it shows
  <!-- docs-test: skip (why) -->                            shell: skipped, saying why

A ```text block that follows a Python block (prose between allowed, no other code
block) is what that block prints: its lines must be the block's standard output.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

import helpers
from jax_smddp.tools import launch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]
SHELL_DOCS = ["README.md"]
MARKER = re.compile(r"^<!--\s*docs-test:\s*(?P<kind>[a-z-]+)(?:\s+(?P<arg>[a-z0-9-]+))?"
                    r"\s*(?:\((?P<reason>.+)\))?\s*-->$")
PYTHON_KINDS = {"compile-only", "fixture"}
SHELL_KINDS = {"setup", "usage", "skip"}


@dataclasses.dataclass
class Block:
  doc: str      # path relative to the checkout
  line: int     # 1-based line of the block's first line of code
  lang: str     # "python", "shell" (indented or ```bash), or the fence's language
  code: str
  kind: str | None = None    # the marker's
  arg: str | None = None
  reason: str | None = None
  prints: str | None = None  # a Python block's output, as the ```text block after it shows it

  @property
  def id(self) -> str:
    return f"{self.doc}:{self.line}"


def _list_context(line: str) -> bool:
  """An indented line after this one continues a list item or paragraph, not code."""
  return bool(re.match(r"^\s+\S|^\s*([*+-]|\d+[.)])\s", line))


def parse(doc: str) -> tuple[list[Block], list[str]]:
  """The code blocks of `doc`, each with the marker before it; and the problems
  found with markers (one not followed by a block, one not understood)."""
  lines = open(os.path.join(REPO, doc)).read().split("\n")
  blocks, problems = [], []
  marker = None  # (match, line number) waiting for its block
  prev = ""      # the last non-blank line
  i = 0
  while i < len(lines):
    line = lines[i]
    m = MARKER.match(line.strip())
    if line.strip().startswith("<!--") and "docs-test" in line:
      if m is None or not m["reason"]:
        problems.append(f"{doc}:{i + 1}: not a marker this runner reads (a kind and a reason): {line}")
      elif marker is not None:
        problems.append(f"{doc}:{marker[1]}: marker followed by another marker")
      marker = (m, i + 1) if m else None
      i += 1
      continue
    fence = re.match(r"^(\s*)(```+|~~~+)\s*([\w-]*)", line)  # indented too: inside a list item
    indented = (line.startswith("    ") and i > 0 and not lines[i - 1].strip()
                and not _list_context(prev))
    if fence:
      indent, mark = fence.group(1), fence.group(2)
      end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith(mark)), len(lines))
      lang = fence.group(3).lower()
      lang = "shell" if lang in ("bash", "sh", "shell", "console") else lang
      code = textwrap.dedent("\n".join(l[len(indent):] if l.startswith(indent) else l
                                       for l in lines[i + 1:end]))
      blocks.append(Block(doc, i + 2, lang, code))
      i = end + 1
    elif indented:
      end = i
      while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
        end += 1
      while not lines[end - 1].strip():
        end -= 1
      blocks.append(Block(doc, i + 1, "shell", "\n".join(l[4:] for l in lines[i:end])))
      i = end
    elif line.strip():
      if marker is not None:
        problems.append(f"{doc}:{marker[1]}: marker not followed by a code block")
        marker = None
      prev = line
      i += 1
      continue
    else:
      i += 1
      continue
    if marker is not None:
      blocks[-1].kind, blocks[-1].arg, blocks[-1].reason = marker[0]["kind"], marker[0]["arg"], marker[0]["reason"]
      marker = None
    prev = "code"
  for block, after in zip(blocks, blocks[1:]):
    if block.lang == "python" and after.lang == "text":
      block.prints = after.code
  return blocks, problems


def _all(kind: str) -> list[Block]:
  docs = DOCS if kind == "python" else SHELL_DOCS
  return [b for d in docs for b in parse(d)[0] if b.lang == kind]


# The README's `mpirun -n 2 ...` as it runs for a user: Open MPI refuses root unless told
# (README says so), and a machine of fewer cores than processes needs oversubscription.
MPIRUN_AS_ANYONE = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}


def _env() -> dict:
  """A user's environment: nothing this suite set for itself."""
  env = {k: v for k, v in os.environ.items()
         if k != "XLA_FLAGS" and not k.startswith("JAX_SMDDP_") and k != "PYTHONPATH"}
  env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
  return env


def _source(block: Block) -> str:
  """The block's code at its own line numbers in its file (tracebacks point there)."""
  return "\n" * (block.line - 1) + block.code + "\n"


def _check_editable():
  why = helpers.not_editable()
  if why:
    assert os.environ.get("CI") != "true", why
    pytest.skip(why)


# --- Python blocks -------------------------------------------------------------

RUN = """
import sys
ns = {"__name__": "__main__"}
exec(compile(sys.argv[1], sys.argv[2], "exec"), ns)
"""

# A fixture supplies what a block leaves to its reader: code run before it
# (`before`), code that stands for a line of the block that is only `...` with a
# comment (`fill`), and checks after it (`after`, which sees `raised`: what the
# block raised, or None). `processes` > 1 runs the block in that many processes.
FIXTURE_RUN = """
import sys
ns = {"__name__": "__main__"}
block, where, before, fill, after = sys.argv[1:6]
exec(compile(before, "<fixture: before>", "exec"), ns)
ns["__docs_test_fill__"] = lambda: exec(compile(fill, "<fixture: in place of ...>", "exec"), ns)
try:
  exec(compile(block, where, "exec"), ns)
  ns["raised"] = None
except Exception as e:
  ns["raised"] = e
exec(compile(after, "<fixture: after>", "exec"), ns)
print("DOCS-TEST OK", flush=True)
"""


@dataclasses.dataclass
class Fixture:
  before: str = ""
  fill: str = ""
  after: str = "if raised is not None:\n  raise raised\n"
  processes: int = 1
  devices: int = 1


PEER_FAILED = ("UNAVAILABLE: jax_smddp[peer_failed] all_reduce (op 0 of communicator devices [0 1 2 3]): "
               "process 1 (devices [2 3]) failed (process 15225 exited, over shared memory)")

FIXTURES = {
    # The error-handling snippet: a step whose collective reports a dead peer
    # (the text README.md quotes); the block must checkpoint and re-raise.
    "a-peer-failed": Fixture(
        before=textwrap.dedent(f"""
            import jax, jax_smddp
            state, batch, saved = "state", "batch", []
            def train_step(state, batch):
              raise jax.errors.JaxRuntimeError({PEER_FAILED!r})
            def save_checkpoint(state):
              saved.append(state)
            """),
        after=textwrap.dedent(f"""
            assert saved == ["state"], saved
            assert str(raised) == {PEER_FAILED!r}, repr(raised)
            assert isinstance(jax_smddp.errors.classify(raised), jax_smddp.errors.PeerFailedError)
            """)),
    # The multi-process snippet, started as Open MPI's mpirun starts processes
    # (jax.distributed finds the process count and id in OMPI_* variables; the
    # coordinator's address in JAX_COORDINATOR_ADDRESS); a psum across the
    # processes stands for "shard_map programs as in one process".
    "launched-by-open-mpi": Fixture(
        fill=textwrap.dedent("""
            import numpy as np
            from jax.sharding import NamedSharding, PartitionSpec as P
            assert jax.process_count() == 2 and jax.device_count() == 4
            total = jax.jit(jax.shard_map(lambda v: smddp.psum(v, "x"), mesh=mesh,
                                          in_specs=P("x"), out_specs=P()))
            x = jax.make_array_from_callback((4,), NamedSharding(mesh, P("x")),
                                             lambda i: np.arange(1.0, 5.0, dtype=np.float32)[i])
            assert float(np.asarray(total(x).addressable_shards[0].data)[0]) == 10.0
            assert smddp.traffic()[1 - jax.process_index()]["sent"] > 0, smddp.traffic()
            """),
        processes=2, devices=2),
}


def _run_python(block: Block, cwd) -> None:
  env = _env()
  if block.kind is None:
    args = [sys.executable, "-c", RUN, _source(block), block.doc]
    run = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, f"{block.id} failed:\n{run.stdout[-3000:]}{run.stderr[-5000:]}"
    if block.prints is not None:
      assert run.stdout.strip().splitlines() == block.prints.strip().splitlines(), \
          f"{block.id} prints, not what the text after it shows:\n{run.stdout}"
    return
  fixture = FIXTURES[block.arg]
  code = _source(block)
  placeholder = re.compile(r"^\.\.\.(\s*#.*)?$", re.M)
  if fixture.fill:
    assert placeholder.search(code), f"{block.id}: fixture {block.arg} fills a line of only `...`"
    code = placeholder.sub(lambda m: "__docs_test_fill__()" + (m.group(1) or ""), code, count=1)
  args = [sys.executable, "-c", FIXTURE_RUN, code, block.doc, fixture.before, fixture.fill, fixture.after]
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={fixture.devices}"
  if fixture.processes == 1:
    run = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=280)
    out = run.stdout + run.stderr
    assert run.returncode == 0 and "DOCS-TEST OK" in out, f"{block.id} failed:\n{out[-6000:]}"
    return
  coordinator = f"127.0.0.1:{launch.free_port()}"
  procs = []
  for rank in range(fixture.processes):
    penv = dict(env, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=coordinator,
                OMPI_MCA_orte_hnp_uri="4096.0;tcp://127.0.0.1:1", OMPI_COMM_WORLD_SIZE=str(fixture.processes),
                OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_RANK=str(rank))
    procs.append(subprocess.Popen(args, cwd=cwd, env=penv, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=240)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for rank, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0 and "DOCS-TEST OK" in out, f"{block.id}, process {rank}:\n{out[-6000:]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", _all("python"), ids=lambda b: b.id)
def test_python_block(block, tmp_path):
  if block.kind == "compile-only":
    compile(_source(block), block.doc, "exec")
    return
  assert block.kind in (None, "fixture"), f"{block.id}: {block.kind} is not for Python blocks"
  _run_python(block, tmp_path)


# --- shell commands ------------------------------------------------------------

def _as_user_types(command: str) -> str:
  """The command with `.venv/pyXYZ/bin/python` meaning this interpreter."""
  return re.sub(r"(?<![\w/])\.venv/py3\d+/bin/python\b", shlex.quote(sys.executable), command)


def _help_options(command: str) -> tuple[list[str], str]:
  """A synopsis's options, and the command that prints its help."""
  program = command.split("[", 1)[0].strip()
  return re.findall(r"--[a-z][a-z0-9-]*", command), f"{program} --help"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", _all("shell"), ids=lambda b: b.id)
def test_shell_command(block, example_compile_cache):
  if block.kind == "skip":
    pytest.skip(f"{block.id}: {block.reason}")
  env = _env()
  if "examples/fsdp_train.py" in block.code:  # programs other tests' runs may have compiled
    env.update(example_compile_cache)
  if block.kind == "setup":
    # Not run again: check that what it names is there and parses.
    scripts = re.findall(r"\bbash\s+(\S+\.sh)", block.code)
    assert scripts, f"{block.id}: a setup command runs a script with bash"
    for script in scripts:
      assert os.path.isfile(os.path.join(REPO, script)), f"{block.id}: {script} is missing"
      check = subprocess.run(["bash", "-n", script], cwd=REPO, capture_output=True, text=True, timeout=30)
      assert check.returncode == 0, check.stderr
    return
  _check_editable()
  if block.kind == "usage":
    options, command = _help_options(" ".join(block.code.split()))
    run = subprocess.run(["bash", "-c", _as_user_types(command)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, f"{block.id}: {command}\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
    missing = [o for o in options if o not in run.stdout]
    assert not missing, f"{block.id}: {command} does not list {missing}"
    return
  assert block.kind is None, f"{block.id}: {block.kind} is not for shell commands"
  if re.search(r"\bmpirun\b", block.code):
    # A job of several processes, 25-35 s each: the second suite's own tests run the same
    # programs under mpirun on its jax (tests/multiprocess/test_launchers.py,
    # tests/tools/test_bench_nccl_tests.py).
    if os.environ.get("SMDDP_FIRST_SUITE_RAN") == "1":
      pytest.skip(f"{block.id}: a command under mpirun, run as written by the first suite; this "
                  "suite runs its programs under mpirun in their own tests")
  env.update(MPIRUN_AS_ANYONE)
  script = "set -euo pipefail\n" + _as_user_types(block.code)
  run = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
  assert run.returncode == 0, f"{block.id}: {block.code}\n{run.stdout[-3000:]}{run.stderr[-3000:]}"


@pytest.mark.timeout(120)
def test_the_main_command_names_options_the_example_has():
  """`bash scripts/run.sh  # add --collectives xla ..., --mesh 2x4 ...`: run.sh passes its
  arguments to examples/fsdp_train.py, whose --help (run from the root) lists them."""
  _check_editable()
  (main,) = [b for b in _all("shell") if "scripts/run.sh" in b.code]
  options = re.findall(r"--[a-z][a-z0-9-]*", main.code)
  assert options, main.code
  run = subprocess.run([sys.executable, "examples/fsdp_train.py", "--help"], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=110)
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  assert '/fsdp_train.py "$@"' in open(os.path.join(REPO, "scripts", "run.sh")).read()
  assert not [o for o in options if o not in run.stdout], (options, run.stdout)


# --- the runner itself ---------------------------------------------------------

def test_markers_are_read_and_the_blocks_found():
  problems = [p for d in DOCS for p in parse(d)[1]]
  assert not problems, problems
  for b in (b for d in DOCS for b in parse(d)[0] if b.kind):
    allowed = PYTHON_KINDS if b.lang == "python" else SHELL_KINDS if b.lang == "shell" else set()
    assert b.kind in allowed, f"{b.id}: a {b.kind} marker on a {b.lang} block"
    assert b.kind != "fixture" or b.arg in FIXTURES, f"{b.id}: no fixture {b.arg!r}"
  python, shell = _all("python"), _all("shell")
  # The README's own: the Use snippet runs as written, the doctor command as written.
  assert any("smddp.all_gather" in b.code and b.kind is None for b in python), [b.id for b in python]
  assert any(b.code.strip() == ".venv/py311/bin/python -m jax_smddp.doctor" and b.kind is None
             for b in shell), [(b.id, b.code) for b in shell]


def test_a_broken_block_fails(tmp_path):
  """The runner reports a block that raises, at its line in its file."""
  block = Block("README.md", 7, "python", "x = 1\nassert x == 2, 'planted'")
  with pytest.raises(AssertionError, match=r"README.md:7 failed:[\s\S]*README.md\", line 8[\s\S]*planted"):
    _run_python(block, tmp_path)
