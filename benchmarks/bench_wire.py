"""Fragment transfer throughput on loopback: pyzmq vs grpcio vs a raw TCP socket.

Why pyzmq: the process runtime needs a transport that carries large fragments without extra
copies, keeps per-peer ordering, reconnects by itself and lets one socket serve many
learners; both candidates do, and this script measures the cost of each against a raw
socket in the same run. The receiver runs in a second process (no shared GIL). Each case
sends ``--count`` messages of ``--mib`` MiB back to back and waits for one reply at the end.
``zmq+wire`` adds this project's framing (crc32 + HMAC-SHA256 on both sides).

    .venv/bin/python benchmarks/bench_wire.py --mib 2 --count 200
(grpcio is optional: ``pip install grpcio``; the case is skipped without it.)
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import subprocess
import sys
import time

SECRET = b"k" * 32


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
    if kind.startswith("zmq"):
        import zmq

        from ddiloco.runtime.processes.wire import Limits, Wire

        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(f"tcp://127.0.0.1:{port}")
        wire = Wire("bench", SECRET, "S", 1, Limits(max_payload=1 << 30))
        print("ready", flush=True)
        for _ in range(count):
            frames = sock.recv_multipart(copy=False)
            if kind == "zmq+wire":
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


def client(kind: str, port: int, count: int, payload: bytes) -> float:
    start = time.perf_counter()
    if kind == "raw":
        conn = socket.create_connection(("127.0.0.1", port))
        start = time.perf_counter()
        for _ in range(count):
            conn.sendall(struct.pack("<Q", len(payload)))
            conn.sendall(payload)
        conn.recv(1)
    elif kind.startswith("zmq"):
        import zmq

        from ddiloco.runtime.processes.wire import Wire

        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{port}")
        wire = Wire("bench", SECRET, "L0", 1)
        time.sleep(0.2)
        start = time.perf_counter()
        for _ in range(count):
            parts = wire.encode("answer", payload=payload) if kind == "zmq+wire" else [payload]
            sock.send_multipart(parts, copy=False)
        sock.recv()
    else:
        import grpc

        opts = [("grpc.max_send_message_length", 1 << 30)]
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=opts)
        grpc.channel_ready_future(channel).result(timeout=10)
        push = channel.stream_unary("/bench/push")
        start = time.perf_counter()
        push(payload for _ in range(count))
    return time.perf_counter() - start


def measure(kind: str, port: int, count: int, payload: bytes) -> float | None:
    cmd = [sys.executable, __file__, "--serve", kind, "--port", str(port), "--count", str(count)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if line.strip() != "ready":
            return None
        seconds = client(kind, port, count, payload)
    finally:
        proc.kill() if kind == "grpc" else proc.wait(timeout=60)
    return count * len(payload) / seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=float, default=2.0, help="message size (a fragment)")
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--serve")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.count)
        return
    payload = os.urandom(int(args.mib * (1 << 20)))
    results: dict[str, float] = {}
    for i, kind in enumerate(("raw", "zmq", "zmq+wire", "grpc")):
        if kind == "grpc":
            try:
                import grpc  # noqa: F401
            except ImportError:
                print("grpc: skipped (pip install grpcio)")
                continue
        rate = measure(kind, 39_000 + i + os.getpid() % 1000, args.count, payload)
        if rate is None:
            print(f"{kind}: server failed to start")
            continue
        results[kind] = rate
        print(f"{kind:9s} {rate / 1e9:6.2f} GB/s", flush=True)
    raw = results.get("raw")
    if raw:
        for kind, rate in results.items():
            if kind != "raw":
                print(f"{kind:9s} / raw = {rate / raw:.2f}")


if __name__ == "__main__":
    main()
