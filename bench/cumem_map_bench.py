#!/usr/bin/env python3
"""Where a wake's maps spend their time: per allocation, per driver call, per thread.

    python bench/cumem_map_bench.py TREE [--count 200] [--size-mib 32] [--threads 2 4 8]
        [--reps 3] [--json-out FILE] [--python-include DIR]

Needs a CUDA GPU and libcuda.so.1; reads the driver's enum values from cuda.h
(CUDA_HOME, default /usr/local/cuda). Loads TREE's own cumem.py against its extension
(built alone), allocates COUNT allocations of SIZE MiB under one tag and puts them to
sleep with nothing offloaded: their physical memory is released and their address
ranges stay reserved, as in a sleeping engine. Then, over all COUNT address ranges,
best of REPS, each timed on the host clock:

- ``extension``: the tree's create_and_map for each (what wake_up calls), then its
  unmap_and_release;
- ``attributes``: the two cuDeviceGetAttribute calls create_and_map makes each time
  (GPUDirect RDMA with VMM, fabric handles);
- ``create as the extension does``: cuMemCreate with the handle type and RDMA flag the
  extension asks for (fabric where the attribute says so, then POSIX file descriptors
  when fabric is refused: the refusals are counted);
- ``create, no handle type``: cuMemCreate asking for no shareable handle and no RDMA flag;
- ``map`` and ``set access``: cuMemMap and cuMemSetAccess of each range;
- ``unmap and release``;
- ``threads T``: create (no handle type), map and set access split over T host threads
  (ctypes releases the GIL), each with the primary context current.

With ``--probe`` it runs the engine check's map probe instead (enginecheck/vmm.py), in
this bare process: the same calls, the extension's create_and_map also while 8 GiB of
host-to-device copies are queued (by the copy engine, then by a kernel reading the pinned
memory), each copy kind's rate alone, and one set-access and one unmap call over
back-to-back ranges against one for each. A map waits for the copies queued before it
(docs/results.md).

An engine's weights are hundreds of allocations: in engine runs a wake's maps cost about
half a millisecond per allocation (docs/results.md), where 16 allocations of 512 MiB
mapped in 4-11 ms. This bench says which call that time is in, and whether threads or
another handle type would take it away. It changes nothing: it measures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from sm12x_bundle import native  # noqa: E402
from sm12x_bundle.selftest import loader  # noqa: E402

from sm12x_bundle.enginecheck.vmm import (  # noqa: E402  (the probe sm12x_maps times the same calls)
    Driver, QueuedCopies, VmmError, as_the_extension, call_times, cuda_enums, cuda_header, plain_create, timed)


def one_rep(drv: Driver, cumem, datas, ranges, threads: list[int], rdma: bool, fabric: bool) -> dict:
    import torch

    row = {"extension": timed(lambda: [cumem.create_and_map(d.handle) for d in datas])}
    torch.cuda.synchronize()
    for d in datas:
        cumem.unmap_and_release(d.handle)
    row["attributes"] = timed(lambda: [drv.attribute(n) for _ in ranges for n in (
        "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED",
        "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED")])
    got: dict = {}
    row["create as the extension does"] = timed(lambda: got.update(r=as_the_extension(drv, ranges, rdma, fabric)))
    handles, row["fabric refusals"] = got["r"]
    for (addr, size), h in zip(ranges, handles):
        drv.release(h)
    row["create, no handle type"] = timed(lambda: got.update(h=plain_create(drv, ranges)))
    handles = got["h"]
    row["map"] = timed(lambda: [drv.map(a, s, h) for (a, s), h in zip(ranges, handles)])
    row["set access"] = timed(lambda: [drv.set_access(a, s) for a, s in ranges])
    torch.cuda.synchronize()
    row["unmap and release"] = timed(lambda: [drv.unmap_release(a, s, h) for (a, s), h in zip(ranges, handles)])
    for t in threads:
        row[f"threads {t}"] = threaded(drv, ranges, t)
    return row


def threaded(drv: Driver, ranges, t: int) -> float:
    """create (no handle type), map and set access of every range over T threads."""
    import torch

    parts = [ranges[i::t] for i in range(t)]

    def work(part):
        drv.in_thread()
        hs = plain_create(drv, part)
        for (a, s), h in zip(part, hs):
            drv.map(a, s, h)
            drv.set_access(a, s)
        return hs

    with ThreadPoolExecutor(t) as pool:
        start = time.perf_counter()
        handles = list(pool.map(work, parts))
        seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    for part, hs in zip(parts, handles):
        for (a, s), h in zip(part, hs):
            drv.unmap_release(a, s, h)
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tree", type=Path)
    p.add_argument("--count", type=int, default=200)
    p.add_argument("--size-mib", type=int, default=32)
    p.add_argument("--threads", type=int, nargs="*", default=[2, 4, 8])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json-out", type=Path)
    p.add_argument("--python-include", type=Path)
    p.add_argument("--probe", action="store_true",
                   help="time the engine check's probe (sm12x_maps: vmm.call_times, on fresh address "
                        "ranges) in this bare process instead, with the same code an engine's worker runs")
    args = p.parse_args()
    try:
        enums = cuda_enums(cuda_header())
    except VmmError as exc:
        raise SystemExit(f"cumem_map_bench: {exc}") from None
    work = Path(tempfile.mkdtemp(prefix="cumem-map-bench-"))
    ext = native.build_cumem_extension(args.tree.resolve(), work, python_include=args.python_include)
    cumem = loader.load(args.tree.resolve(), ext).cumem
    import torch

    if args.probe:
        return probe(args, torch)
    alloc = cumem.CuMemAllocator.get_instance()
    size = args.size_mib << 20
    with alloc.use_memory_pool("map-bench"):
        ts = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(args.count)]
    alloc.sleep(offload_tags=())  # nothing offloaded: every range released, still reserved
    datas = [alloc.pointer_to_data[t.data_ptr()] for t in ts]
    ranges = [(d.handle[2], d.handle[1]) for d in datas]
    drv = Driver(torch.cuda.current_device(), enums)
    rdma = bool(drv.attribute("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED"))
    fabric = bool(drv.attribute("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"))
    reps = [one_rep(drv, cumem, datas, ranges, args.threads, rdma, fabric) for _ in range(args.reps)]
    alloc.wake_up()  # the allocator's own state again: every range mapped by it
    best = {k: min(r[k] for r in reps) for k in reps[0]}
    result = {"gpu": torch.cuda.get_device_name(), "count": args.count, "size_mib": args.size_mib,
              "rdma_with_vmm": rdma, "fabric_supported": fabric, "best_s": best, "reps": reps}
    print(f"{args.count} allocations of {args.size_mib} MiB on {result['gpu']} "
          f"(RDMA with VMM: {rdma}, fabric handles: {fabric}), best of {args.reps}:")
    for k, v in best.items():
        if k == "fabric refusals":
            print(f"  {k:<30} {v}")
        else:
            print(f"  {k:<30} {v * 1e3:8.2f} ms  {v / args.count * 1e6:8.1f} us each")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1, sort_keys=True))
    return 0


def probe(args, torch) -> int:
    from vllm import cumem_allocator as ext  # the tree's extension, as the loader placed it

    torch.zeros(1, device="cuda")  # the primary context, as an engine's worker has it
    device = torch.cuda.current_device()
    copies = {by: QueuedCopies(torch, device, by=by) for by in QueuedCopies.BY}
    rates = {by: c.gbps() for by, c in copies.items()}
    result = {"gpu": torch.cuda.get_device_name(), "copy_gbps": rates,
              **call_times(device, args.count, args.size_mib << 20, ext, args.reps,
                           busy={f"copies by the {by}": c.start for by, c in copies.items()})}
    print("host-to-device copies alone: " + ", ".join(f"by the {by} {r:.1f} GB/s" for by, r in rates.items()))
    run = result["back_to_back_run"]
    print(f"the probe's calls in a bare process, {args.count} x {args.size_mib} MiB on {result['gpu']}, "
          f"best of {args.reps}; {run} of the ranges back to back, one call over them: "
          f"{result.get('one_call_over_the_run_cuda_result')} (CUresult, 0: taken)")
    for k, v in result["best_s"].items():
        each = run if "back-to-back" in k or "over the run" in k else args.count
        print(f"  {k:<48} {v}" if k == "fabric refusals" else
              f"  {k:<48} {v * 1e3:8.2f} ms  {v / each * 1e6:8.1f} us per range")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
