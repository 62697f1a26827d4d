"""Fragment transfer throughput on loopback: pyzmq vs grpcio vs a raw TCP socket.

Why pyzmq: the process runtime needs a transport that carries large fragments without extra
copies, keeps per-peer ordering, reconnects by itself and lets one socket serve many
learners; both candidates do, and this script measures the cost of each against a raw
socket in the same run. The receiver runs in a second process (no shared GIL). Each case
sends ``--count`` messages of ``--mib`` MiB back to back and waits for one reply at the end.
``zmq+wire`` adds this project's framing (BLAKE3 + HMAC-SHA256 on both sides) over a
connection authenticated at the handshake (PLAIN credentials checked by the gatekeeper, as
every ddiloco socket is); ``shm+wire`` is the same-host path. The handshake's own cost is
measured too: connect, authenticate, one round trip, close, with and without credentials.

    .venv/bin/python benchmarks/bench_wire.py --mib 2 --count 200
(grpcio is optional: ``pip install grpcio``; the case is skipped without it.)
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import subprocess
import sys
import time

SECRET = b"k" * 32
RUN = "bench-wire"


WINDOW = 4
FRAGMENTS = 8


def serve(kind: str, port: int, count: int) -> None:
    if kind == "raw":
        srv = socket.create_server(("127.0.0.1", port))
        print("ready", flush=True)
        conn, _ = srv.accept()
        buf = bytearray(64 << 20)
        for _ in range(count):
            (n,) = struct.unpack("<Q", conn.recv(8, socket.MSG_WAITALL))
            view = memoryview(buf)[:n]
            got = 0
            while got < n:
                got += conn.recv_into(view[got:], n - got)
            conn.sendall(b"k")
        return
    if kind != "grpc":
        import zmq

        from ddiloco.runtime.processes.transport.auth import Gatekeeper, serve_plain
        from ddiloco.runtime.processes.transport.wire import Limits, Wire

        ctx = zmq.Context()
        if kind.endswith("+wire"):
            Gatekeeper(ctx, SECRET, RUN, lambda name: name == "L0").start()
        sock = ctx.socket(zmq.ROUTER)
        if kind.endswith("+wire"):
            serve_plain(sock)
        sock.bind(f"tcp://127.0.0.1:{port}")
        wire = Wire(RUN, SECRET, "S", 1, Limits(max_payload=1 << 30))
        print("ready", flush=True)
        for _ in range(count):
            frames = sock.recv_multipart(copy=False)
            if kind.endswith("+wire"):
                wire.decode([f.buffer for f in frames[1:]])
            sock.send_multipart([frames[0].bytes, b"k"])
        time.sleep(0.2)
        return
    from concurrent import futures

    import grpc

    def collect(request_iterator, context):
        n = sum(1 for _ in request_iterator)
        return struct.pack("<Q", n)

    handler = grpc.method_handlers_generic_handler(
        "bench", {"push": grpc.stream_unary_rpc_method_handler(collect)}
    )
    opts = [("grpc.max_receive_message_length", 1 << 30)]
    server = grpc.server(futures.ThreadPoolExecutor(2), options=opts)
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination(timeout=120)


def client(kind: str, port: int, count: int, payloads: list[bytes]) -> float:
    start = time.perf_counter()
    if kind == "raw":
        conn = socket.create_connection(("127.0.0.1", port))
        start = time.perf_counter()
        for i in range(count):
            payload = payloads[i % len(payloads)]
            conn.sendall(struct.pack("<Q", len(payload)))
            conn.sendall(payload)
            if i >= WINDOW:
                conn.recv(1)
        conn.recv(min(count, WINDOW), socket.MSG_WAITALL)
    elif kind != "grpc":
        import zmq

        from ddiloco.runtime.processes.transport.auth import present
        from ddiloco.runtime.processes.transport.shm import ShmWriter
        from ddiloco.runtime.processes.transport.wire import Wire

        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        if "+wire" in kind:
            present(sock, SECRET, RUN, "L0")
        sock.connect(f"tcp://127.0.0.1:{port}")
        shm = ShmWriter(RUN, "L0", 1) if kind == "shm+wire" else None
        wire = Wire(RUN, SECRET, "L0", 1, shm=shm)
        time.sleep(0.2)
        start = time.perf_counter()
        for i in range(count):
            payload = payloads[i % len(payloads)]
            if "+wire" in kind:
                parts = wire.encode("answer", fragment=i % FRAGMENTS, payload=payload)
            else:
                parts = [payload]
            sock.send_multipart(parts, copy=False)
            if i >= WINDOW:
                sock.recv()
        for _ in range(min(count, WINDOW)):
            sock.recv()
        wire.close()
    else:
        import grpc

        opts = [("grpc.max_send_message_length", 1 << 30)]
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=opts)
        grpc.channel_ready_future(channel).result(timeout=10)
        push = channel.stream_unary("/bench/push")
        start = time.perf_counter()
        push(payloads[i % len(payloads)] for i in range(count))
    return time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def handshakes(count: int, authenticated: bool) -> float:
    """Seconds per connection: connect, (authenticate), one round trip, close."""
    import threading

    import zmq

    from ddiloco.runtime.processes.transport.auth import Bounds, Gatekeeper, present, serve_plain

    ctx = zmq.Context()
    unbounded = Bounds(burst=1 << 30, per_second=1e9)  # time the handshake, not its limiter
    gate = Gatekeeper(ctx, SECRET, RUN, lambda n: n == "L0", unbounded) if authenticated else None
    if gate is not None:
        gate.start()
    server = ctx.socket(zmq.ROUTER)
    if authenticated:
        serve_plain(server)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def echo() -> None:
        while not stop.is_set():
            if server.poll(50):
                frames = server.recv_multipart()
                server.send_multipart([frames[0], b"k"])

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    start = time.perf_counter()
    for _ in range(count):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if authenticated:
            present(sock, SECRET, RUN, "L0")
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(b"hi")
        sock.recv()
        sock.close(0)
    seconds = (time.perf_counter() - start) / count
    stop.set()
    thread.join()
    server.close(0)
    if gate is not None:
        gate.close()
    ctx.term()
    return seconds


def measure(kind: str, port: int, count: int, payloads: list[bytes]) -> float | None:
    cmd = [sys.executable, __file__, "--serve", kind, "--port", str(port), "--count", str(count)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if line.strip() != "ready":
            return None
        seconds = client(kind, port, count, payloads)
    finally:
        proc.kill() if kind == "grpc" else proc.wait(timeout=60)
    return count * len(payloads[0]) / seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=2.0, help="message size (a fragment)")
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3, help="rounds over all cases (median)")
    parser.add_argument("--handshakes", type=int, default=200, help="connections timed")
    parser.add_argument("--serve")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.count)
        return
    if args.handshakes:
        plain = statistics.median(handshakes(args.handshakes, False) for _ in range(3))
        auth = statistics.median(handshakes(args.handshakes, True) for _ in range(3))
        print(
            f"connection + round trip: {plain * 1e3:.2f} ms without credentials, "
            f"{auth * 1e3:.2f} ms authenticated (+{(auth - plain) * 1e3:.2f} ms)"
        )
    payloads = [os.urandom(int(args.mib * (1 << 20))) for _ in range(4)]
    kinds = ["raw", "zmq", "zmq+wire", "shm+wire", "grpc"]
    try:
        import grpc  # noqa: F401
    except ImportError:
        print("grpc: skipped (pip install grpcio)")
        kinds.remove("grpc")
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.repeat):  # cases interleaved, so a noisy moment hits all of them
        for kind in kinds:
            rate = measure(kind, free_port(), args.count, payloads)
            if rate is None:
                print(f"{kind}: server failed to start")
                continue
            rates[kind].append(rate)
        print(" ".join(f"{k} {v[-1] / 1e9:.2f}" for k, v in rates.items() if v), "GB/s")
    results = {kind: statistics.median(v) for kind, v in rates.items() if v}
    for kind, rate in results.items():
        print(f"{kind:9s} {rate / 1e9:6.2f} GB/s (median of {len(rates[kind])})")
    from ddiloco.runtime.processes.transport.shm import remove_run_directory

    remove_run_directory(RUN)
    if rates.get("raw"):  # per round, each case against the raw socket of that round
        for kind, values in rates.items():
            if kind != "raw" and len(values) == len(rates["raw"]):
                ratios = [v / r for v, r in zip(values, rates["raw"], strict=True)]
                print(
                    f"{kind:9s} / raw = {statistics.median(ratios):.2f} "
                    f"(rounds {min(ratios):.2f}..{max(ratios):.2f})"
                )


if __name__ == "__main__":
    main()
