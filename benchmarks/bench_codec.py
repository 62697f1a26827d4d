"""Codec throughput against a bare copy of the bf16 bytes.

Baseline: ``dst.copy_(src)`` between two preallocated bf16 tensors of N values (the memory
traffic of handing over the default bf16 payload). Measured: encoding the same N values,
given as float32, plus decoding the payload. Each codec run is interleaved with a baseline
run in this one process; ratios are baseline / (encode + decode), from medians.

The int codecs run twice, on each backend of :mod:`ddiloco.core.quantize` (``CodecSpec``'s
and ``decode``'s ``backend=``): ``jit`` (the numba kernels of :mod:`ddiloco.kernels`) and
``eager`` (the torch loops), side by side in this one run; bf16 has one path. The verdict
is for the path the codec takes by default ("auto"), printed above the table.

Three ways to count the codec, all printed:
  * ratio      ``encode_into`` a reused buffer + ``decode(out=...)`` into a reused tensor:
               like the baseline, no fresh memory. The target applies to this one.
  * bytes      ``encode`` returning new ``bytes`` + ``decode(out=...)``.
  * alloc      ``encode`` + ``decode`` allocating its result. Fresh multi-MB memory costs a
               page fault per 4 KiB, which on a VM can take longer than the codec itself.

    python benchmarks/bench_codec.py [--values 25000000] [--repeats 7] [--threads T]
                                     [--paths jit,eager]

Target: int4 ratio >= 0.25 (an int4 round trip at least a quarter of memcpy speed).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import ddiloco.kernels as kernels
from ddiloco.core.codec import CodecSpec, decode, encode, encode_into, encoded_size

TARGET = 0.25
CODECS = ("bf16", "int8", "int4")
PATHS = ("jit", "eager")


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
    ap.add_argument("--paths", default=",".join(PATHS), help="int codec paths to run")
    args = ap.parse_args()
    if args.values < 1 or args.repeats < 1:
        ap.error("--values and --repeats must be >= 1")
    paths = [p for p in args.paths.split(",") if p]
    if not paths or any(p not in PATHS for p in paths):
        ap.error(f"--paths: a comma-separated subset of {PATHS}")
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.values
    start = time.perf_counter()
    jit_ok = kernels.load("auto") is not None
    load = time.perf_counter() - start
    if "jit" in paths and not jit_ok:
        print(f"numba kernels unavailable ({kernels.unavailable_reason()}): eager only")
        paths = [p for p in paths if p != "jit"]
        if not paths:
            return
    default = "jit" if jit_ok else "eager"
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e-3
    src = x.to(torch.bfloat16)
    dst = torch.empty_like(src)
    out = torch.empty(n)
    specs = {c: CodecSpec(c, args.block_size) for c in CODECS}  # backend set per run below
    runs = [("bf16", ""), *((c, p) for c in CODECS if c != "bf16" for p in paths)]
    sendbuf = bytearray(max(encoded_size((n,), s) for s in specs.values()))
    base: list[float] = []
    times: dict[tuple[str, str], dict[str, list[float]]] = {}
    first: dict[tuple[str, str], float] = {}
    for c, path in runs:  # one codec at a time, each run next to a baseline run
        backend = "jit" if path == "jit" else "eager" if path == "eager" else "auto"
        spec = CodecSpec(c, args.block_size, backend=backend)
        t: dict[str, list[float]] = {"into": [], "bytes": [], "dec": [], "dec_alloc": []}
        times[c, path] = t
        start = time.perf_counter()  # warm up: the first call loads (or compiles) the kernels
        size = encode_into(x, spec, sendbuf)
        payload = memoryview(sendbuf)[:size]
        decode(payload, out=out, backend=backend)
        first[c, path] = time.perf_counter() - start
        for _ in range(args.repeats):
            base.append(_time(lambda: dst.copy_(src)))
            t["into"].append(_time(lambda s=spec: encode_into(x, s, sendbuf)))
            t["dec"].append(_time(lambda p=payload, k=backend: decode(p, out=out, backend=k)))
        for _ in range(args.repeats):
            base.append(_time(lambda: dst.copy_(src)))
            t["bytes"].append(_time(lambda s=spec: encode(x, s)))
            t["dec_alloc"].append(_time(lambda p=payload, k=backend: decode(p, backend=k)))
        payload.release()
    med = statistics.median
    b = med(base)
    print(
        f"N={n:,} values, threads={torch.get_num_threads()}, repeats={args.repeats}, "
        f"block={args.block_size}"
    )
    print(f"baseline bf16 memcpy: {b * 1e3:8.2f} ms  ({4 * n / b / 1e9:.1f} GB/s read+written)")
    why = "numba kernels" if default == "jit" else "torch loops"
    print(f"default int codec path for N values: {default} ({why}); numba load {load:.2f} s")
    head = ("codec", "path", "B/value", "enc_into", "encode", "dec(out)", "dec(new)", "ratio")
    print(
        f"{head[0]:6}{head[1]:>6}{head[2]:>9}"
        + "".join(f"{h:>10}" for h in head[3:])
        + f"{'bytes':>10}{'alloc':>10}{'1st call':>10}"
    )
    ratios: dict[tuple[str, str], float] = {}
    for c, path in runs:
        t = times[c, path]
        ei, eb, d, da = (med(t[k]) for k in ("into", "bytes", "dec", "dec_alloc"))
        ratios[c, path] = b / (ei + d)
        ms = "".join(f"{v * 1e3:10.2f}" for v in (ei, eb, d, da))
        rs = "".join(f"{v:10.3f}" for v in (ratios[c, path], b / (eb + d), b / (eb + da)))
        size = encoded_size((n,), specs[c]) / n
        print(f"{c:6}{path or '-':>6}{size:9.4f}{ms}{rs}{first[c, path] * 1e3:10.1f}")
    for name in ("fp32", "int2", "int1"):
        print(f"{name:6}{'':6}{encoded_size((n,), CodecSpec(name, args.block_size)) / n:9.4f}")
    print("times in ms (medians; 1st call: the warm-up, kernel load or compile included)")
    print("ratio/bytes/alloc: see the module docstring")
    for path in paths:
        print(f"int4 {path:5} ratio {ratios['int4', path]:.3f}")
    key = ("int4", default if default in paths else paths[0])
    verdict = "PASS" if ratios[key] >= TARGET else "BELOW TARGET"
    print(f"int4 ratio {ratios[key]:.3f} ({key[1]} path; target >= {TARGET}): {verdict}")


if __name__ == "__main__":
    main()
