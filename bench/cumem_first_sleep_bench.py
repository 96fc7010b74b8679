#!/usr/bin/env python3
"""The first sleep of a process: ways to get pinned backups, against the link.

    python bench/cumem_first_sleep_bench.py [TREE] [--size-gib 8] [--piece-mib 384]
        [--prefault-gib 0] [--threads 4,8,16] [--conf CONF ...] [--json-out FILE]
        [--python-include DIR]

Needs a CUDA GPU and PyTorch. In one process, on SIZE bytes of device memory in pieces
of PIECE bytes (not a power of two, as real weight allocations are not), it measures:

* the ceilings of this run: pinned device-to-host (the sleep's), pinned host-to-device
  into memory already in use, and host-to-device into memory freshly made by
  cuMemCreate + cuMemMap (the wake's real target);
* each candidate way of making the first sleep's backups, timed from nothing to every
  byte copied (what a first sleep pays), with the host memory it took (MemAvailable and
  RSS deltas) against the bytes copied, then the same copies again (a later sleep):
  torch_pin_memory (PyTorch's caching host allocator, what vLLM 0.21.0 does), one exact
  cudaHostAlloc, mmap + N-thread page population + cudaHostRegister, transparent huge
  pages, MAP_HUGETLB (when the host has huge pages), a pipeline that registers piece k+1
  while piece k copies, pageable memory, and the pre-pinned pool (pinned in the
  background before the sleep: the sleep is the copies alone; the pinning is reported
  apart).

``--conf`` reruns torch_pin_memory in a fresh process per PYTORCH_CUDA_ALLOC_CONF value
(e.g. ``pinned_use_cuda_host_register:True,pinned_num_register_threads:16``, PyTorch's
own option). ``--prefault-gib`` first touches and frees that much host memory, so that a
VM that backs its memory on first touch (the H200 machines here) does not charge the
first candidate alone for it; the first-touch rate is reported either way. With TREE,
the selftest's speed scenario also runs on that tree (its extension built alone), as
this bench did before the backup pool.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from sm12x_bundle.enginecheck.vmm import AccessDesc, Location, Prop  # noqa: E402  (the driver's structs)

MiB, GiB = 1 << 20, 1 << 30
PAGE = os.sysconf("SC_PAGE_SIZE")
D2H, H2D = 2, 1  # cudaMemcpyKind
PROT_RW, MAP_PRIVATE_ANON, MAP_HUGETLB = 3, 0x22, 0x40000
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


# --- host memory ------------------------------------------------------------------------------


def used() -> int:
    """Host memory in use. MemTotal grows on these VMs as memory is used, so
    MemAvailable alone would not give a delta."""
    return meminfo("MemTotal") - meminfo("MemAvailable")


def meminfo(key: str = "MemAvailable") -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def host_mmap(size: int, huge: bool = False) -> int:
    addr = libc.mmap(None, size, PROT_RW, MAP_PRIVATE_ANON | (MAP_HUGETLB if huge else 0), -1, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return addr


def populate(addr: int, size: int, threads: int) -> str:
    """Fault every page in, ``threads`` ranges at a time (ctypes calls drop the GIL).
    MADV_POPULATE_WRITE where the kernel has it (5.14+), else a memset."""
    step = -(-size // threads // PAGE) * PAGE
    ranges = [(addr + o, min(step, size - o)) for o in range(0, size, step)]
    how = "madvise" if libc.madvise(addr, min(PAGE, size), MADV_POPULATE_WRITE) == 0 else "memset"

    def one(r):
        if how == "madvise":
            libc.madvise(r[0], r[1], MADV_POPULATE_WRITE)
        else:
            ctypes.memset(r[0], 0, r[1])

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, ranges))
    return how


# --- CUDA through ctypes (what cumem.py does: synchronous cudaMemcpy per allocation) ----------


def loaded_lib(stem: str) -> ctypes.CDLL:
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if stem in os.path.basename(path):
            return ctypes.CDLL(path)
    raise RuntimeError(f"{stem} is not loaded in this process")


class Cuda:
    def __init__(self, torch):
        torch.cuda.init()
        torch.empty(1, device="cuda")
        self.rt = loaded_lib("libcudart.so")
        self.drv = ctypes.CDLL("libcuda.so.1")
        self.dev = torch.cuda.current_device()

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUDA error {rc}")

    def memcpy(self, dst: int, src: int, n: int, kind: int) -> None:
        self.check(self.rt.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(n), kind), "cudaMemcpy")

    def host_alloc(self, n: int) -> int:
        p = ctypes.c_void_p()
        self.check(self.rt.cudaHostAlloc(ctypes.byref(p), ctypes.c_size_t(n), 0), "cudaHostAlloc")
        return p.value

    def free_host(self, p: int) -> None:
        self.check(self.rt.cudaFreeHost(ctypes.c_void_p(p)), "cudaFreeHost")

    def register(self, p: int, n: int) -> None:
        self.check(self.rt.cudaHostRegister(ctypes.c_void_p(p), ctypes.c_size_t(n), 0), "cudaHostRegister")

    def unregister(self, p: int) -> None:
        self.check(self.rt.cudaHostUnregister(ctypes.c_void_p(p)), "cudaHostUnregister")

    def sync(self) -> None:
        self.check(self.rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")


def fresh_map(cuda: Cuda, sizes: list[int]) -> list[tuple[int, int, int]]:
    """cuMemCreate + reserve + map + set access, per piece: what cumem's wake does."""
    d = cuda.drv
    prop = Prop(type=1, requestedHandleTypes=0, location=Location(1, cuda.dev))
    access = AccessDesc(location=Location(1, cuda.dev), flags=3)
    out = []
    for n in sizes:
        h, va = ctypes.c_ulonglong(), ctypes.c_ulonglong()
        cuda.check(d.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(n), ctypes.byref(prop), ctypes.c_ulonglong(0)), "cuMemCreate")
        cuda.check(d.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(n), ctypes.c_size_t(0),
                                         ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        cuda.check(d.cuMemMap(va, ctypes.c_size_t(n), ctypes.c_size_t(0), h, ctypes.c_ulonglong(0)), "cuMemMap")
        cuda.check(d.cuMemSetAccess(va, ctypes.c_size_t(n), ctypes.byref(access), ctypes.c_size_t(1)), "cuMemSetAccess")
        out.append((va.value, n, h.value))
    return out


def fresh_unmap(cuda: Cuda, maps) -> None:
    d = cuda.drv
    for va, n, h in maps:
        cuda.check(d.cuMemUnmap(ctypes.c_ulonglong(va), ctypes.c_size_t(n)), "cuMemUnmap")
        cuda.check(d.cuMemRelease(ctypes.c_ulonglong(h)), "cuMemRelease")
        cuda.check(d.cuMemAddressFree(ctypes.c_ulonglong(va), ctypes.c_size_t(n)), "cuMemAddressFree")


# --- the measurements -------------------------------------------------------------------------


class Bench:
    def __init__(self, torch, size: int, piece: int, reps: int = 3):
        self.torch, self.cuda, self.reps = torch, Cuda(torch), reps
        k = max(1, size // piece)
        self.sizes = [piece] * k
        self.bytes = piece * k
        self.dev = [torch.empty(piece, dtype=torch.uint8, device="cuda").random_(0, 255) for _ in range(k)]
        torch.cuda.synchronize()

    def gbps(self, seconds: float) -> float:
        return self.bytes / seconds / 1e9

    def copies(self, hosts: list[int], kind: int = D2H, devs: list[int] | None = None) -> float:
        devs = devs or [t.data_ptr() for t in self.dev]
        t0 = time.perf_counter()
        for h, d, n in zip(hosts, devs, self.sizes):
            if kind == D2H:
                self.cuda.memcpy(h, d, n, D2H)
            else:
                self.cuda.memcpy(d, h, n, H2D)
        self.cuda.sync()
        return time.perf_counter() - t0

    def offsets(self, base: int) -> list[int]:
        out, o = [], 0
        for n in self.sizes:
            out.append(base + o)
            o += n
        return out

    def ceilings(self) -> dict:
        base = self.cuda.host_alloc(self.bytes)
        hosts = self.offsets(base)
        d2h = min(self.copies(hosts, D2H) for _ in range(self.reps))
        h2d = min(self.copies(hosts, H2D) for _ in range(self.reps))
        fresh, fresh_map_s, again = [], [], []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            maps = fresh_map(self.cuda, self.sizes)
            fresh_map_s.append(time.perf_counter() - t0)
            devs = [m[0] for m in maps]
            fresh.append(self.copies(hosts, H2D, devs))
            again.append(self.copies(hosts, H2D, devs))
            fresh_unmap(self.cuda, maps)
        self.cuda.free_host(base)
        return {"d2h_ceiling_gbps": self.gbps(d2h), "h2d_ceiling_gbps": self.gbps(h2d),
                "fresh_h2d_ceiling_gbps": self.gbps(min(fresh)), "fresh_h2d_copies_s": fresh,
                "fresh_map_s": fresh_map_s, "fresh_h2d_again_gbps": self.gbps(min(again)),
                "fresh_h2d_with_map_gbps": self.gbps(min(f + m for f, m in zip(fresh, fresh_map_s)))}

    def measure(self, name: str, fn) -> dict:
        """fn() -> (hosts, release, extra): builds the backups and copies into them."""
        import gc
        gc.collect()
        used0, rss0 = used(), rss()
        t0 = time.perf_counter()
        hosts, release, extra = fn()
        first = time.perf_counter() - t0
        held, rss_held = used() - used0, rss() - rss0
        later = min(self.copies(hosts) for _ in range(2))
        row = {"candidate": name, "first_sleep_s": first, "first_sleep_gbps": self.gbps(first),
               "later_sleep_s": later, "later_sleep_gbps": self.gbps(later),
               "host_bytes_held": held, "host_ratio": held / self.bytes, "rss_delta": rss_held, **extra}
        release()
        return row


def c_torch_pin(b: Bench):
    torch = b.torch
    ts = []
    t0 = time.perf_counter()
    for d, n in zip(b.dev, b.sizes):
        t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        b.cuda.memcpy(t.data_ptr(), d.data_ptr(), n, D2H)
        ts.append(t)
    b.cuda.sync()
    first = time.perf_counter() - t0
    stats = {}
    if hasattr(torch.cuda, "host_memory_stats"):
        s = torch.cuda.host_memory_stats()
        stats = {"torch_host_reserved_bytes": s.get("reserved_bytes.current", s.get("segment.current"))}

    def release():
        ts.clear()
        if hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()
    return [t.data_ptr() for t in ts], release, {"pin_s": first, **stats}


def c_host_alloc(b: Bench):
    t0 = time.perf_counter()
    base = b.cuda.host_alloc(b.bytes)
    pin = time.perf_counter() - t0
    hosts = b.offsets(base)
    b.copies(hosts)
    return hosts, lambda: b.cuda.free_host(base), {"pin_s": pin}


def c_register(threads: int, huge: str = ""):
    def fn(b: Bench):
        n = -(-b.bytes // PAGE) * PAGE
        t0 = time.perf_counter()
        base = host_mmap(n, huge == "hugetlb")
        if huge == "thp":
            libc.madvise(base, n, MADV_HUGEPAGE)
        how = populate(base, n, threads) if threads > 1 else "by cudaHostRegister"
        t1 = time.perf_counter()
        b.cuda.register(base, n)
        t2 = time.perf_counter()
        hosts = b.offsets(base)
        b.copies(hosts)

        def release():
            b.cuda.unregister(base)
            libc.munmap(base, n)
        return hosts, release, {"populate_s": t1 - t0, "register_s": t2 - t1, "populate": how}
    return fn


def c_pipeline(threads: int):
    """Piece k+1.. populated and registered by workers while piece k copies."""
    def fn(b: Bench):
        def prep(n):
            a = host_mmap(n)
            populate(a, n, 1)
            b.cuda.register(a, n)
            return a
        with ThreadPoolExecutor(threads) as ex:
            futs = [ex.submit(prep, n) for n in b.sizes]
            hosts = []
            for f, d, n in zip(futs, b.dev, b.sizes):
                a = f.result()
                b.cuda.memcpy(a, d.data_ptr(), n, D2H)
                hosts.append(a)
        b.cuda.sync()

        def release():
            for a, n in zip(hosts, b.sizes):
                b.cuda.unregister(a)
                libc.munmap(a, n)
        return hosts, release, {}
    return fn


def c_pageable(b: Bench):
    n = -(-b.bytes // PAGE) * PAGE
    base = host_mmap(n)
    hosts = b.offsets(base)
    b.copies(hosts)
    return hosts, lambda: libc.munmap(base, n), {}


def c_prepinned(threads: int, thp: bool = False):
    """The pool is pinned in a background thread while the model would load; the sleep
    that follows is the copies alone. Both times are reported; first_sleep_s is the
    pinning plus the copies (this bench waits for the pinning), sleep_after_pool_s is
    what the engine's first sleep costs once the pool is ready."""
    def fn(b: Bench):
        n = -(-b.bytes // PAGE) * PAGE
        box = {}

        def pin():
            t0 = time.perf_counter()
            a = host_mmap(n)
            if thp:  # what patch 0005's pool does
                libc.madvise(a, n, MADV_HUGEPAGE)
            populate(a, n, threads)
            b.cuda.register(a, n)
            box.update(base=a, pin_s=time.perf_counter() - t0)
        th = threading.Thread(target=pin)
        th.start()
        th.join()
        hosts = b.offsets(box["base"])
        copy = b.copies(hosts)

        def release():
            b.cuda.unregister(box["base"])
            libc.munmap(box["base"], n)
        return hosts, release, {"pin_s": box["pin_s"], "sleep_after_pool_s": copy,
                                "sleep_after_pool_gbps": b.gbps(copy)}
    return fn


def candidates(threads: list[int]) -> list[tuple[str, object]]:
    out = [("torch_pin_memory", c_torch_pin), ("cudahostalloc_exact", c_host_alloc),
           ("register_1", c_register(1))]
    out += [(f"register_populate_{n}", c_register(n)) for n in threads]
    out += [("thp_populate_16", c_register(16, "thp")), ("hugetlb_populate_16", c_register(16, "hugetlb")),
            ("pipeline_16", c_pipeline(16)), ("pageable", c_pageable), ("prepinned_pool_16", c_prepinned(16)),
            ("prepinned_pool_thp_16", c_prepinned(16, thp=True))]
    return out


def host_facts() -> dict:
    def read(p):
        try:
            return Path(p).read_text().strip()
        except OSError:
            return None
    return {"thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "nr_hugepages": read("/proc/sys/vm/nr_hugepages"), "hugepagesize_kb": meminfo("Hugepagesize") // 1024,
            "mem_total": meminfo("MemTotal"), "mem_available": meminfo(), "cpus": os.cpu_count(),
            "kernel": os.uname().release}


def first_touch(size: int, threads: int) -> dict:
    """Fault in and free SIZE bytes: the rate at which this host backs new memory."""
    a = host_mmap(size)
    t0 = time.perf_counter()
    how = populate(a, size, threads)
    s = time.perf_counter() - t0
    libc.munmap(a, size)
    return {"bytes": size, "threads": threads, "seconds": s, "gbps": size / s / 1e9, "populate": how}


def run_candidates(args, only: str | None = None) -> dict:
    import torch
    doc = {"host": host_facts(), "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    size = int(args.size_gib * GiB)
    doc["first_touch"] = first_touch(size, 16)
    if args.prefault_gib:
        doc["prefault"] = first_touch(int(args.prefault_gib * GiB), 16)
    b = Bench(torch, size, int(args.piece_mib * MiB))
    doc.update(bytes=b.bytes, piece_bytes=b.sizes[0], pieces=len(b.sizes), device=torch.cuda.get_device_name())
    doc["ceilings"] = b.ceilings()
    rows = []
    for name, fn in candidates(args.threads):
        if only and name != only:
            continue
        try:
            row = b.measure(name, lambda fn=fn: fn(b))
        except Exception as exc:  # noqa: BLE001  (e.g. no huge pages on this host: reported, the rest run)
            row = {"candidate": name, "error": f"{type(exc).__name__}: {exc}"}
        rows.append(row)
        print(line(row, doc["ceilings"]), flush=True)
    doc["rows"] = rows
    return doc


def line(row: dict, ceil: dict) -> str:
    if "error" in row:
        return f"{row['candidate']:22s} not run: {row['error']}"
    d2h = ceil["d2h_ceiling_gbps"]
    extra = "".join(f", {k} {row[k]:.2f} s" for k in ("pin_s", "populate_s", "register_s", "sleep_after_pool_s") if k in row)
    return (f"{row['candidate']:22s} first {row['first_sleep_s']:6.2f} s {row['first_sleep_gbps']:5.1f} GB/s "
            f"({row['first_sleep_gbps'] / d2h:4.0%} of D2H) later {row['later_sleep_gbps']:5.1f} GB/s "
            f"({row['later_sleep_gbps'] / d2h:4.0%}); host {row['host_ratio']:.3f}x{extra}")


def scenario_rows(args) -> list[dict]:
    """The selftest's speed scenario on TREE, per PYTORCH_CUDA_ALLOC_CONF (the old bench)."""
    from sm12x_bundle.selftest import plan, runner
    rows = []
    with tempfile.TemporaryDirectory(prefix="cumem-first-sleep-") as tmp:
        work = Path(tmp)
        staged = runner.stage(plan.Target("tree", args.tree.resolve()), work, python_include=args.python_include)
        free = runner.probe(staged, work)["free_bytes"]
        sizes = plan.plan_sizes(free, size_gib=args.size_gib)
        params = runner.scenario_params(sizes, 0.0)
        for i, conf in enumerate(args.conf or [""]):
            r = runner.run_scenario(staged, plan.BY_NAME["speed"], params, work / f"conf{i}", timeout=900,
                                    env={"PYTORCH_CUDA_ALLOC_CONF": conf})
            rows.append({"conf": conf, "outcome": r.outcome, "reason": r.reason, **r.figures})
            print(f"[speed scenario, {conf or 'default'}] {r.outcome}: {r.reason}", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tree", type=Path, nargs="?")
    p.add_argument("--size-gib", type=float, default=8.0)
    p.add_argument("--piece-mib", type=float, default=384.0)
    p.add_argument("--prefault-gib", type=float, default=0.0)
    p.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16])
    p.add_argument("--conf", action="append", help="a PYTORCH_CUDA_ALLOC_CONF value for torch_pin_memory (repeatable)")
    p.add_argument("--only", help=argparse.SUPPRESS)
    p.add_argument("--json-out", type=Path)
    p.add_argument("--python-include", type=Path, help="the folder holding Python.h (default: this Python's)")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(f"cumem_first_sleep_bench: torch {torch.__version__} sees no CUDA GPU; this bench needs one")
        return 1
    if args.only:  # a child: one candidate under the environment it was given
        print(json.dumps(run_candidates(args, args.only)))
        return 0
    doc = run_candidates(args)
    doc["confs"] = []
    for conf in args.conf or []:
        argv = [sys.executable, __file__, "--only", "torch_pin_memory", "--size-gib", str(args.size_gib),
                "--piece-mib", str(args.piece_mib)]
        r = subprocess.run(argv, env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}, capture_output=True, text=True,
                           check=False)
        child = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-2000:]}
        doc["confs"].append({"conf": conf, **child})
        for row in child.get("rows", []):
            print(f"[{conf}] " + line(row, child["ceilings"]), flush=True)
    if args.tree:
        doc["speed_scenario"] = scenario_rows(args)
    c = doc["ceilings"]
    print(f"ceilings: D2H {c['d2h_ceiling_gbps']:.1f} GB/s, H2D {c['h2d_ceiling_gbps']:.1f} GB/s, H2D into fresh "
          f"cuMemCreate memory {c['fresh_h2d_ceiling_gbps']:.1f} GB/s (again into it {c['fresh_h2d_again_gbps']:.1f}); "
          f"host first touch {doc['first_touch']['gbps']:.1f} GB/s with 16 threads", flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(doc, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
