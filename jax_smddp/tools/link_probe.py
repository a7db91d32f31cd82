"""The link between two simulated hosts, measured raw: plain TCP sockets
sending both ways at once, no framework, no libfabric, so the benchmark can
print each row between hosts as a fraction of what the link itself carries
(`python -m jax_smddp.tools.bench --layout 2x1x1` measures it in the same run).

``measure(namespaces, ips)`` starts a server in the second namespace and a
client in the first (``ip netns exec``; without namespaces both run here over
``127.0.0.1``). Each round both ends send `nbytes` and receive the peer's
`nbytes` at once; the client times the round from a one-byte handshake to the
last byte received and sent, and reports each round's rate each way. Every
round's bytes carry a pattern the receiver checks, so a probe that moved
nothing cannot report a rate.

The link's rate is the rounds' median, but on a capped link (``capped``) the
fastest round's: a cap cannot be beaten (but by a token bucket's few KiB), so
a slower round is the machine's noise, not the link; such a probe measures
more rounds (up to ``max_rounds``) until its two fastest agree within 2 %. A
benchmark run right after another read 0.100-0.112 GB/s over five rounds of a
1 Gbit/s link that reads 0.119, and every row of that run above the link.

    python -m jax_smddp.tools.link_probe serve PORT NBYTES MAX_ROUNDS
    python -m jax_smddp.tools.link_probe connect HOST PORT NBYTES ROUNDS [MAX_ROUNDS]
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import threading
import time

BLOCK = 4 << 20  # bytes per send/recv call


def _stamp(round_: int, side: int) -> int:
  """The first and last byte `side` (0 client, 1 server) sends in a round."""
  return (round_ * 2 + side) % 251 + 1


class _Buffers:
  """One side's send and receive buffers, made (and their pages touched) once,
  outside the timed rounds."""

  def __init__(self, nbytes: int):
    self.out = bytearray(b"\x5a" * nbytes)
    self.inbox = bytearray(b"\x00" * nbytes)


def _exchange(sock: socket.socket, nbytes: int, round_: int, side: int,
              buffers: _Buffers | None = None) -> None:
  """Sends this side's round and receives the peer's, at once; checks the peer's stamp."""
  buffers = buffers or _Buffers(nbytes)
  out, inbox = buffers.out, buffers.inbox
  out[0] = out[-1] = _stamp(round_, side)
  inbox[0] = inbox[-1] = 0
  failure: list[BaseException] = []

  def send():
    try:
      view = memoryview(out)
      for at in range(0, nbytes, BLOCK):
        sock.sendall(view[at:at + BLOCK])
    except BaseException as e:  # handed to the caller
      failure.append(e)

  sender = threading.Thread(target=send)
  sender.start()
  view, got = memoryview(inbox), 0
  while got < nbytes:
    n = sock.recv_into(view[got:], min(BLOCK, nbytes - got))
    if n == 0:
      raise ConnectionError(f"link probe: the peer closed the connection after {got} of "
                            f"{nbytes} bytes")
    got += n
  sender.join()
  if failure:
    raise failure[0]
  want = _stamp(round_, 1 - side)
  if inbox[0] != want or inbox[-1] != want:
    raise ValueError(f"link probe: round {round_} received bytes of another round or side")


def _tuned(sock: socket.socket) -> socket.socket:
  sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  return sock


def serve(port: int, nbytes: int, rounds: int) -> None:
  with socket.create_server(("0.0.0.0", port)) as server:
    print("ready", flush=True)
    server.settimeout(60)
    conn, _ = server.accept()
    buffers = _Buffers(nbytes)
    with _tuned(conn):
      conn.settimeout(120)
      for r in range(rounds):
        if conn.recv(1) != b"g":  # the client's go, or its end
          break
        conn.sendall(b"g")
        _exchange(conn, nbytes, r, 1, buffers)


def settled(rates: list[float]) -> bool:
  """Whether a capped link's rounds found its rate: the two fastest within 2 %."""
  top = sorted(rates, reverse=True)[:2]
  return len(top) == 2 and top[1] >= 0.98 * top[0]


def connect(host: str, port: int, nbytes: int, rounds: int, max_rounds: int = 0) -> dict:
  """`rounds` rounds; with `max_rounds` (a capped link), more until settled, up to it."""
  deadline = time.monotonic() + 30
  while True:
    try:
      sock = socket.create_connection((host, port), timeout=5)
      break
    except OSError:
      if time.monotonic() > deadline:
        raise
      time.sleep(0.05)
  rates = []
  buffers = _Buffers(nbytes)
  with _tuned(sock):
    sock.settimeout(120)
    r = 0
    while r < rounds or (r < max_rounds and not settled(rates)):
      t0 = time.perf_counter()
      sock.sendall(b"g")
      sock.recv(1)
      _exchange(sock, nbytes, r, 0, buffers)
      rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
      r += 1
    if r < max(rounds, max_rounds):
      sock.sendall(b"q")  # the server waits for up to that many
  if max_rounds:
    return {"each_way_gbs": max(rates), "rounds_gbs": rates, "bytes": nbytes,
            "method": "TCP sockets, both directions at once, the fastest round (a capped link)"}
  return {"each_way_gbs": statistics.median(rates), "rounds_gbs": rates, "bytes": nbytes,
          "method": "TCP sockets, both directions at once, median of the rounds"}


def measure(namespaces: list[str] | None = None, ips: list[str] | None = None,
            nbytes: int = 64 << 20, rounds: int = 5, timeout: float = 120,
            capped: bool = False, max_rounds: int = 12) -> dict:
  """The link's rate each way, GB/s: between `namespaces[0]` (client) and
  `namespaces[1]` (server, at `ips[1]`), or over loopback without them. `capped`:
  the fastest round's, measuring up to `max_rounds` until settled."""
  most = max(rounds, max_rounds) if capped else rounds
  from jax_smddp.tools.launch import free_port
  port = free_port()  # free here, so free in a fresh namespace too
  host = "127.0.0.1" if namespaces is None else ips[1]
  me = [sys.executable, "-m", "jax_smddp.tools.link_probe"]
  inside = (lambda i: ["ip", "netns", "exec", namespaces[i]]) if namespaces else (lambda i: [])
  server = subprocess.Popen([*inside(1), *me, "serve", str(port), str(nbytes), str(most)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    if server.stdout.readline().strip() != "ready":
      raise RuntimeError(f"link probe: the server did not start: {server.stderr.read()}")
    client = subprocess.run([*inside(0), *me, "connect", host, str(port), str(nbytes),
                             str(rounds), str(most if capped else 0)], capture_output=True,
                            text=True, timeout=timeout)
    if client.returncode != 0:
      raise RuntimeError(f"link probe failed: {client.stderr.strip()[-2000:]}")
    server.wait(timeout=30)
    if server.returncode != 0:
      raise RuntimeError(f"link probe's server failed: {server.stderr.read()[-2000:]}")
    return json.loads(client.stdout)
  finally:
    if server.poll() is None:
      server.kill()
      server.wait()


def main(argv: list[str]) -> int:
  if len(argv) == 4 and argv[0] == "serve":
    serve(int(argv[1]), int(argv[2]), int(argv[3]))
    return 0
  if len(argv) in (5, 6) and argv[0] == "connect":
    print(json.dumps(connect(argv[1], int(argv[2]), int(argv[3]), int(argv[4]),
                             int(argv[5]) if len(argv) == 6 else 0)))
    return 0
  print(__doc__, file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
