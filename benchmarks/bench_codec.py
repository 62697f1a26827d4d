"""Codec throughput against a bare copy of the bf16 bytes.

Baseline: ``dst.copy_(src)`` between two preallocated bf16 tensors of N values (the memory
traffic of handing over the default bf16 payload). Measured: encoding the same N values,
given as float32, plus decoding the payload. Each codec run is interleaved with a baseline
run in this one process; ratios are baseline / (encode + decode), from medians.

Three ways to count the codec, all printed:
  * ratio      ``encode_into`` a reused buffer + ``decode(out=...)`` into a reused tensor:
               like the baseline, no fresh memory. The target applies to this one.
  * bytes      ``encode`` returning new ``bytes`` + ``decode(out=...)``.
  * alloc      ``encode`` + ``decode`` allocating its result. Fresh multi-MB memory costs a
               page fault per 4 KiB, which on a VM can take longer than the codec itself.

    python benchmarks/bench_codec.py [--values 25000000] [--repeats 7] [--threads T]

Target: int4 ratio >= 0.25 (an int4 round trip at least a quarter of memcpy speed).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from ddiloco.core.codec import CodecSpec, decode, encode, encode_into, encoded_size

TARGET = 0.25
CODECS = ("bf16", "int8", "int4")


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", type=int, default=25_000_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=128)
    args = ap.parse_args()
    if args.values < 1 or args.repeats < 1:
        ap.error("--values and --repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.values
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e-3
    src = x.to(torch.bfloat16)
    dst = torch.empty_like(src)
    out = torch.empty(n)
    specs = {c: CodecSpec(c, args.block_size) for c in CODECS}
    sendbuf = bytearray(max(encoded_size((n,), s) for s in specs.values()))
    base: list[float] = []
    times: dict[str, dict[str, list[float]]] = {}
    for c, spec in specs.items():  # one codec at a time, each run next to a baseline run
        t: dict[str, list[float]] = {"into": [], "bytes": [], "dec": [], "dec_alloc": []}
        times[c] = t
        size = encode_into(x, spec, sendbuf)  # warm up
        payload = memoryview(sendbuf)[:size]
        decode(payload, out=out)
        for _ in range(args.repeats):
            base.append(_time(lambda: dst.copy_(src)))
            t["into"].append(_time(lambda s=spec: encode_into(x, s, sendbuf)))
            t["dec"].append(_time(lambda p=payload: decode(p, out=out)))
        for _ in range(args.repeats):
            base.append(_time(lambda: dst.copy_(src)))
            t["bytes"].append(_time(lambda s=spec: encode(x, s)))
            t["dec_alloc"].append(_time(lambda p=payload: decode(p)))
        payload.release()
    med = statistics.median
    b = med(base)
    print(
        f"N={n:,} values, threads={torch.get_num_threads()}, repeats={args.repeats}, "
        f"block={args.block_size}"
    )
    print(f"baseline bf16 memcpy: {b * 1e3:8.2f} ms  ({4 * n / b / 1e9:.1f} GB/s read+written)")
    head = ("codec", "B/value", "enc_into", "encode", "dec(out)", "dec(new)", "ratio", "bytes")
    print(f"{head[0]:6}{head[1]:>9}" + "".join(f"{h:>10}" for h in head[2:]) + f"{'alloc':>10}")
    ratios: dict[str, float] = {}
    for c, spec in specs.items():
        t = times[c]
        ei, eb, d, da = (med(t[k]) for k in ("into", "bytes", "dec", "dec_alloc"))
        ratios[c] = b / (ei + d)
        ms = "".join(f"{v * 1e3:10.2f}" for v in (ei, eb, d, da))
        rs = "".join(f"{v:10.3f}" for v in (ratios[c], b / (eb + d), b / (eb + da)))
        print(f"{c:6}{encoded_size((n,), spec) / n:9.4f}{ms}{rs}")
    for name in ("fp32", "int2", "int1"):
        print(f"{name:6}{encoded_size((n,), CodecSpec(name, args.block_size)) / n:9.4f}")
    print("times in ms (medians); ratio/bytes/alloc: see the module docstring")
    verdict = "PASS" if ratios["int4"] >= TARGET else "BELOW TARGET"
    print(f"int4 ratio {ratios['int4']:.3f} (target >= {TARGET}): {verdict}")


if __name__ == "__main__":
    main()
