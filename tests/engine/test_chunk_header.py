"""The libfabric links' chunk-header parser (xla_ffi/transports/fabric_wire.h),
fuzzed through _smddp_testing against a reference written here from the wire
format: tens of thousands of chunks (random bytes, valid headers, and valid
headers mutated: bits flipped, fields overwritten, cut short, lengthened, from
strangers, of another protocol version). The parser must accept exactly what a
peer writes, with its fields; refuse everything else with a protocol error
naming the sender (its name when the chunk names a peer, the id it claims
otherwise); and never read past a chunk's end: each chunk lies against a
PROT_NONE page, so a read past it kills the probe, run in a child process."""

from __future__ import annotations

import os
import pickle
import random
import struct
import subprocess
import sys

import pytest

from helpers import engine_probes, ran_in_first_suite

ran_in_first_suite("the engine's C++, through its probes")

_testing = engine_probes()

HEADER = struct.Struct("<IIQQQQQQII")  # magic version sender seq tag total offset len kind reserved
assert HEADER.size == 64
MAGIC = 0x46444D53
DATA, ABORT, RTS, CTS = 1, 2, 3, 4
CAPACITY = 4096  # the receive buffer (a small JAX_SMDDP_FABRIC_CHUNK_BYTES)
VERSION = _testing.wire_protocol_version()
GROUP = {0x1111111111111111: "process 0", 0x9E3779B97F4A7C15: "process 3",
         0xFFFFFFFFFFFFFFFE: "the parent"}
STRANGER = 0x0123456789ABCDEF
U64 = (1 << 64) - 1


def reference(chunk: bytes) -> tuple[bool, str | None, int]:
  """(accepted, the name an error must carry, the sender an error blames: 0 for none)."""
  n = len(chunk)
  sender = int.from_bytes(chunk[8:16], "little") if n >= 16 else None
  if sender is None:
    named, blame = "an unknown sender", 0
  elif sender in GROUP:
    named, blame = GROUP[sender], sender
  else:
    named, blame = f"an unknown sender (id 0x{sender:016x})", 0
  if n < 64 or n > CAPACITY:
    return False, named, blame
  magic, version, sender, seq, tag, total, offset, length, kind, reserved = HEADER.unpack_from(chunk)
  if (magic != MAGIC or version != VERSION or sender not in GROUP or kind not in (DATA, ABORT, RTS, CTS)
      or reserved != 0 or length != n - 64):
    return False, named, blame
  if kind == DATA:
    ok = offset <= total and length <= total - offset and (length > 0 or total == 0)
  elif length != 0:
    ok = False
  elif kind == ABORT:
    ok = offset <= total
  elif kind == CTS:
    ok = offset <= 1
  else:
    ok = total > 0 and offset == 0
  return ok, named, blame


def header(kind, *, sender, seq=0, tag=0, total=0, offset=0, length=0, magic=MAGIC, version=VERSION,
           reserved=0) -> bytes:
  return HEADER.pack(magic, version, sender, seq, tag, total, offset, length, kind, reserved)


def valid_chunk(rng: random.Random) -> bytes:
  kind = rng.choice((DATA, DATA, ABORT, RTS, CTS))
  sender = rng.choice(sorted(GROUP))
  seq, tag = rng.getrandbits(rng.choice((3, 24, 64))), rng.getrandbits(64)
  if kind == DATA:
    if rng.random() < 0.05:
      total, offset, length = 0, 0, 0
    else:
      length = rng.randint(1, CAPACITY - 64)
      total = rng.choice((length, length + rng.randint(0, 10**6), U64))
      offset = rng.randint(0, total - length)
    payload = rng.randbytes(length)
  else:
    payload, length = b"", 0
    if kind == ABORT:
      total = rng.choice((0, rng.getrandbits(40), U64))
      offset = rng.randint(0, total)
    elif kind == CTS:
      total, offset = rng.getrandbits(40), rng.randint(0, 1)
    else:
      total, offset = rng.randint(1, U64), 0
  return header(kind, sender=sender, seq=seq, tag=tag, total=total, offset=offset,
                length=length) + payload


FIELDS = [("I", 0), ("I", 4), ("Q", 8), ("Q", 16), ("Q", 24), ("Q", 32), ("Q", 40), ("Q", 48),
          ("I", 56), ("I", 60)]


def mutated_chunk(rng: random.Random) -> bytes:
  c = bytearray(valid_chunk(rng))
  how = rng.randrange(8)
  if how == 0:  # bits flipped in the header
    for _ in range(rng.randint(1, 3)):
      c[rng.randrange(64)] ^= 1 << rng.randrange(8)
  elif how == 1:  # a field overwritten with a boundary or random value
    fmt, at = rng.choice(FIELDS)
    top = U64 if fmt == "Q" else (1 << 32) - 1
    total, length = struct.unpack_from("<Q", c, 32)[0], struct.unpack_from("<Q", c, 48)[0]
    value = rng.choice((0, 1, 2, 3, 4, 5, top, top - 1, total, total + 1, length + 1,
                        len(c) - 64, len(c), CAPACITY, rng.getrandbits(64)))
    struct.pack_into("<" + fmt, c, at, value & top)
  elif how == 2:  # cut short, header included
    del c[rng.randrange(len(c)):]
  elif how == 3:  # lengthened: more bytes than the header announces, perhaps past the buffer
    c += rng.randbytes(rng.choice((1, 63, 64, rng.randint(1, CAPACITY))))
  elif how == 4:  # from a stranger
    struct.pack_into("<Q", c, 8, rng.choice((STRANGER, rng.getrandbits(64))))
  elif how == 5:  # another protocol version
    struct.pack_into("<I", c, 4, rng.choice((VERSION + 1, VERSION - 1, 0, (1 << 32) - 1)))
  elif how == 6:  # a length past the chunk's end
    struct.pack_into("<Q", c, 48, struct.unpack_from("<Q", c, 48)[0] + rng.choice((1, 64, CAPACITY, 1 << 40)))
  else:  # payload bytes flipped (still valid)
    if len(c) > 64:
      c[rng.randrange(64, len(c))] ^= 0xFF
  return bytes(c)


def random_chunk(rng: random.Random) -> bytes:
  n = rng.choice((rng.randint(0, 80), rng.randint(0, 300), rng.randint(CAPACITY - 8, CAPACITY + 8)))
  c = bytearray(rng.randbytes(n))
  if n >= 16 and rng.random() < 0.5:  # random bytes behind a plausible start
    struct.pack_into("<IIQ", c, 0, MAGIC, VERSION, rng.choice(sorted(GROUP)))
    if n >= 64 and rng.random() < 0.5:
      struct.pack_into("<QII", c, 48, n - 64, rng.randint(0, 5), 0)
  return bytes(c)


def cases(count: int, seed: int) -> list[bytes]:
  rng = random.Random(seed)
  makers = (valid_chunk, mutated_chunk, mutated_chunk, mutated_chunk, random_chunk)
  return [rng.choice(makers)(rng) for _ in range(count)]


def parse_in_child(chunks: list[bytes], tmp_path) -> list:
  """The probe's verdicts, from a child process: a read past a chunk's end
  hits the guard page there instead of killing the test run."""
  src, out = tmp_path / "chunks.pickle", tmp_path / "verdicts.pickle"
  src.write_bytes(pickle.dumps(chunks))
  code = ("import pickle, sys, _smddp_testing as t\n"
          f"chunks = pickle.load(open({str(src)!r}, 'rb'))\n"
          f"v = t.fabric_chunk_probe(chunks, {CAPACITY}, {VERSION}, {GROUP!r})\n"
          f"pickle.dump(v, open({str(out)!r}, 'wb'))\n")
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
  assert run.returncode == 0, (
      f"the parser probe died (exit {run.returncode}; a signal is negative: SIGSEGV -11 means "
      f"a read past a chunk's end, onto the guard page): {run.stderr[-2000:]}")
  return pickle.loads(out.read_bytes())


def check(chunks: list[bytes], verdicts: list) -> tuple[int, int]:
  accepted = 0
  for chunk, (ok, message, blame, fields) in zip(chunks, verdicts, strict=True):
    want_ok, named, want_blame = reference(chunk)
    assert ok == want_ok, (f"{'accepted' if ok else 'refused'} a chunk the reference "
                           f"{'refuses' if ok else 'accepts'}: {chunk[:64].hex()} ({len(chunk)} bytes): {message}")
    if ok:
      accepted += 1
      assert list(fields) == list(HEADER.unpack_from(chunk)), chunk[:64].hex()
      assert message == "" and blame == HEADER.unpack_from(chunk)[2]
    else:
      assert list(fields) == [], f"refused, but not as a protocol error: {message}"
      assert message.startswith(f"malformed chunk from {named}: "), (message, named)
      assert blame == want_blame, (message, blame, want_blame)
  return accepted, len(chunks) - accepted


@pytest.mark.timeout(300)
def test_the_parser_accepts_exactly_what_peers_write_and_names_the_sender(tmp_path):
  chunks = cases(30000, seed=36)
  accepted, refused = check(chunks, parse_in_child(chunks, tmp_path))
  # Neither side of the verdict is starved: the fuzz reaches every check.
  assert accepted > 3000 and refused > 15000, (accepted, refused)


@pytest.mark.timeout(120)
def test_each_check_names_what_was_wrong(tmp_path):
  """One chunk per check, with the message a user would read."""
  ok = header(DATA, sender=0x1111111111111111, seq=7, tag=9, total=100, offset=0, length=10) + b"x" * 10
  examples = [
      (b"", "from an unknown sender: only 0 bytes, shorter than the 64-byte header"),
      (ok[:40], "from process 0: only 40 bytes, shorter than the 64-byte header"),
      (ok + b"y" * CAPACITY, f"more than the {CAPACITY}-byte buffer"),
      (struct.pack("<I", 0x12345678) + ok[4:], "from process 0: magic 0x12345678 instead of jax_smddp's 0x46444d53"),
      (ok[:4] + struct.pack("<I", VERSION + 1) + ok[8:],
       f"wire protocol version {VERSION + 1}, but this process speaks {VERSION}"),
      (ok[:8] + struct.pack("<Q", STRANGER) + ok[16:],
       "from an unknown sender (id 0x0123456789abcdef): not a peer of this endpoint"),
      (ok[:56] + struct.pack("<I", 9) + ok[60:], "from process 0: unknown kind 9"),
      (ok[:60] + struct.pack("<I", 1) + ok[64:], "reserved header field 0x00000001 is not zero"),
      (ok[:48] + struct.pack("<Q", 10 + CAPACITY) + ok[56:],
       f"the header announces {10 + CAPACITY} payload bytes, the chunk holds 10"),
      (header(DATA, sender=0x1111111111111111, seq=7, tag=9, total=100, offset=95, length=10) + b"x" * 10,
       "message 7 (tag 9): 10 bytes at offset 95 of a 100-byte message"),
      (header(CTS, sender=0x9E3779B97F4A7C15, seq=3, offset=2), "from process 3: message 3 (tag 0): a clear-to-send answering 2"),
      (header(RTS, sender=0x9E3779B97F4A7C15, seq=3), "a ready-to-send of 0 bytes at offset 0"),
      (header(ABORT, sender=0x9E3779B97F4A7C15, seq=3, total=5, offset=6), "an abort after 6 bytes of a 5-byte message"),
  ]
  verdicts = parse_in_child([c for c, _ in examples] + [ok], tmp_path)
  for (chunk, want), (accepted, message, _, _) in zip(examples, verdicts):
    assert not accepted and want in message, (want, message)
  assert verdicts[-1][0], verdicts[-1]


def test_the_build_speaks_the_protocol_version_declared_once():
  from jax_smddp import capabilities
  built = capabilities.build()
  assert built["protocol_built"] == VERSION
  if "JAX_SMDDP_TEST_PROTOCOL_VERSION" not in os.environ:
    assert built["protocol"] == VERSION
  assert built["version"] and len(built["source_hash"]) == 16 and built["jaxlib"], built
