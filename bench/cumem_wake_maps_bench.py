#!/usr/bin/env python3
"""A tree's own wake with an engine's allocation layout, outside any engine: what each map costs.

    python bench/cumem_wake_maps_bench.py TREE [--weights 500x12] [--kv 123x25] [--reps 3]
        [--other none,release,release-hog] [--order as-is[,maps-first,...]]
        [--pause-ms 0[,10,...]] [--json-out FILE] [--python-include DIR]

Needs a CUDA GPU. Loads TREE's own cumem.py against its extension (built alone), allocates
the weights (COUNTxMIB allocations, tag ``weights``) and the KV cache (tag ``kv_cache``)
as a rank of an engine-check model does (0.21.0, TP=2, 12 GiB: about 500 weight allocations
of 12 MiB and 123 KV-cache allocations of 25 MiB), then REPS times: sleep (the weights
offloaded), wake, and the wake's own stage record (``last_wake_up_stages``: the maps of the
restored and of the emptied allocations, the copies' span), with every ``create_and_map``
call timed on the host clock; each sleep is timed too, with its own record
(``last_sleep_stages``: its unmaps, how many). The environment's switches apply
(``VLLM_CUMEM_SKIP_UNCHANGED``, ``VLLM_CUMEM_MERGE_RUNS``: each is recorded).

``--other`` says what happens between the sleep and the wake:

- ``none``: nothing (the bench's process made and released every page itself);
- ``release``: another process takes as many bytes as the sleep released (``cudaMalloc``,
  written), then frees them just before the wake, as the other engine of a rotation does;
- ``release-hog``: the same, with the rest of the card's free memory held by that process
  throughout, so that the wake can only have the pages the other process has just freed.
- ``engine``: the other engine of a rotation, with the same tree's allocator and the same
  layout: before each wake it wakes, then sleeps (its weights unchanged: the sleep a
  steady swap makes), as a rotation puts the awake engine to sleep before it wakes the
  other. Both processes' heaps are frozen (``gc.freeze()``), as an engine's are. Its
  sleeps are recorded.
  With ``--other-sleep kv-first`` it unmaps its discarded allocations before its sleep
  proper (its checksum and the weights' unmaps): what releasing the KV cache first would
  give the wake.

``--pause-ms`` says how long the wake waits after the other process's free (0: at once, as
a rotation's wake follows the other engine's sleep). A comma-separated list of pauses, or
of orders, is measured in one process, the settings taking turns within each rep.

``--order`` says in what order the wake maps and copies (a series' tree only; the maps'
spread is the tree's own record); what the wake maps at once is the tree's own unit (an
allocation, or a merged run where the tree merges them):

- ``as-is``: the tree's own wake (each allocation with a backup mapped, its copy queued at
  once, then the discarded ones mapped);
- ``groupN``: N units with a backup mapped, then their copies queued, and so on;
- ``maps-first``: every unit with a backup mapped, then all their copies queued, then
  the discarded ones mapped while those copies run;
- ``kv-after-copies``: the tree's own wake of the allocations with a backup, waited for,
  then the discarded ones mapped.

Each rep also records the first write into a discarded allocation after the wake (what a
wake leaves to the engine's first step), and the copies' rate against the pinned
host-to-device ceiling measured in the same process, before and after the reps (4 GiB into
device memory in use, best of 3).

The driver's map calls wait for the copies queued before them: with ``group4`` the first
map of each four waits for the four copies before it, the other three do not.

In engines the wake's maps cost 0.4-0.5 ms per allocation (docs/results.md), against
86 us per 32 MiB allocation for the same extension call in a bare process
(bench/cumem_map_bench.py). This bench says whether the wake's own code, or memory
just freed by another process, accounts for the difference. It changes nothing: it measures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from sm12x_bundle import native  # noqa: E402
from sm12x_bundle.enginecheck.ceilings import _best  # noqa: E402
from sm12x_bundle.enginecheck.vmm import _Span  # noqa: E402
from sm12x_bundle.selftest import loader  # noqa: E402

MiB = 1 << 20
OTHERS = ("none", "release", "release-hog", "engine")


ORDERS = ("as-is", "maps-first", "kv-after-copies")


def order(text: str) -> str:
    if text in ORDERS or (text.startswith("group") and text[5:].isdigit() and int(text[5:]) > 0):
        return text
    share = text.removeprefix("maps-first-").removeprefix("kernel")
    if text.removeprefix("maps-first-").startswith("kernel") and share.isdigit() and 0 < int(share) <= 100:
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r}: expected as-is, maps-first, kv-after-copies, groupN (N at least 1) or kernelP "
        "(P from 1 to 100), such as group4")


def orders(text: str) -> list[str]:
    return [order(one) for one in text.split(",")]


def pauses(text: str, unit: str = "milliseconds", example: str = "0,10,30") -> list[float]:
    """A comma-separated list of pauses, none negative."""
    try:
        values = [float(one) for one in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {unit}, such as {example}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: a pause cannot be negative")
    return values


def use_order(cumem, name: str) -> None:
    """Make the tree's allocator wake in the order ``name`` (see --order)."""
    cls = cumem.CuMemAllocator
    own = cls.__dict__.get("_bench_own_wake") or cls.__dict__.get("_map_and_copy_back")
    if name == "as-is":
        if own is not None:
            cls._map_and_copy_back = own
        return
    if own is None or not hasattr(cumem, "CallTimes"):
        raise SystemExit("cumem_wake_maps_bench: --order needs a tree with the series' wake "
                         "(CuMemAllocator._map_and_copy_back and CallTimes)")
    cls._bench_own_wake = own
    if name.removeprefix("maps-first-").startswith("kernel"):
        share = int(name.removeprefix("maps-first-").removeprefix("kernel")) / 100
        first = name.startswith("maps-first-")
        cls._map_and_copy_back = lambda self, restored, emptied, woken: kernel_wake(
            cumem, self, restored, emptied, woken, share, first)
        return
    if name == "kv-after-copies":
        cls._map_and_copy_back = lambda self, restored, emptied, woken: kv_after_copies(
            own, self, restored, emptied, woken)
        return
    group = None if name == "maps-first" else int(name[5:])
    cls._map_and_copy_back = lambda self, restored, emptied, woken: ordered_wake(
        cumem, self, restored, emptied, woken, group)


def kv_after_copies(own, alloc, restored, emptied, woken) -> dict:
    """The tree's own wake of what has a backup (its maps, copies and the wait for them),
    then the tree's own maps of the discarded allocations."""
    copied = own(alloc, restored, [], woken)
    mapped = own(alloc, [], emptied, woken)
    return {**copied, **{k: v for k, v in mapped.items() if k.startswith("map_emptied")},
            "emptied": mapped.get("emptied", len(emptied))}


def kernel_wake(cumem, alloc, restored, emptied, woken, share: float, maps_first: bool = False) -> dict:
    """The tree's maps in its order, with the first ``share`` of the bytes to restore
    copied by a kernel on a stream of its own (SMs reading the pinned backup through its
    unified address: no copy engine) and the rest by the tree's queued copies (the copy
    engine), both running at once; then the discarded allocations mapped. With
    ``maps_first`` every map comes first (the discarded allocations' too), then every copy."""
    import torch

    maps = {"map_restored": cumem.CallTimes(), "map_emptied": cumem.CallTimes()}
    side = torch.cuda.Stream()
    total = sum(d.handle[1] for _, d in restored)
    state = {"by_kernel": 0, "first_copy": None}
    pending = []

    def copy(data):
        state["first_copy"] = state["first_copy"] or time.perf_counter()
        nbytes = data.handle[1]
        if state["by_kernel"] + nbytes <= share * total + (1 << 20):
            state["by_kernel"] += nbytes
            dev = torch.as_tensor(_Span(data.handle[2], nbytes), device="cuda").view(torch.int64)
            host = torch.as_tensor(_Span(data.cpu_backup_tensor.data_ptr(), nbytes), device="cuda").view(torch.int64)
            with torch.cuda.stream(side):
                torch.bitwise_or(host, 0, out=dev)
        else:
            alloc._wake_step("copy", data.handle[2], data, woken, cumem._queue_copy_back)

    start_all = time.perf_counter()
    for stage, allocations in (("map_restored", restored), ("map_emptied", emptied)):
        for unit in units_of(alloc, allocations):
            start = time.perf_counter()
            alloc._wake_step("map", unit.handle[2], unit, woken, cumem.create_and_map)
            maps[stage].since(start)
            for data in members_of(unit):
                if data.cpu_backup_tensor is not None:
                    pending.append(data) if maps_first else copy(data)
    for data in pending:
        copy(data)
    torch.cuda.synchronize()
    first = start_all if maps_first else state["first_copy"]
    copy_s = time.perf_counter() - first if first else 0.0
    return {**maps["map_restored"].record("map_restored"), **maps["map_emptied"].record("map_emptied"),
            "copy_s": copy_s, "copied_bytes": total, "by_kernel_bytes": state["by_kernel"]}


def units_of(alloc, allocations) -> list:
    """What the tree maps at once: a merged run, or one allocation."""
    if hasattr(alloc, "_mapping_units"):
        return alloc._mapping_units(allocations)
    return [data for _, data in allocations]


def members_of(unit) -> list:
    return list(getattr(unit, "members", [unit]))


def ordered_wake(cumem, alloc, restored, emptied, woken, group) -> dict:
    """The series' wake with its maps and queued copies in another order: ``group`` units
    mapped, then their copies (None: every map of a backed-up unit, then every copy)."""
    import torch

    maps = {"map_restored": cumem.CallTimes(), "map_emptied": cumem.CallTimes()}
    pending, first_copy, mapped = [], None, 0

    def queue_copies():
        nonlocal first_copy
        for data in pending:
            first_copy = first_copy or time.perf_counter()
            alloc._wake_step("copy", data.handle[2], data, woken, cumem._queue_copy_back)
        pending.clear()

    for stage, allocations in (("map_restored", restored), ("map_emptied", emptied)):
        for unit in units_of(alloc, allocations):
            start = time.perf_counter()
            alloc._wake_step("map", unit.handle[2], unit, woken, cumem.create_and_map)
            maps[stage].since(start)
            mapped += 1
            pending.extend(d for d in members_of(unit) if d.cpu_backup_tensor is not None)
            if group is not None and mapped % group == 0:
                queue_copies()
        queue_copies()
    for device in {d.handle[0] for _, d in restored}:
        torch.cuda.synchronize(device)
    copy_s = time.perf_counter() - first_copy if first_copy else 0.0
    return {**maps["map_restored"].record("map_restored"), **maps["map_emptied"].record("map_emptied"),
            "copy_s": copy_s, "copied_bytes": sum(d.handle[1] for _, d in restored)}


def layout(text: str) -> tuple[int, int]:
    """'500x12' -> (500, 12 MiB in bytes)."""
    try:
        count, mib = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected COUNTxMIB, such as 500x12") from None
    if count < 1 or mib < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the count and the size must be at least 1")
    return count, mib * MiB


def other_process(conn, device: int, hog: bool) -> None:
    """The other engine: on "take N", hold N written bytes; on "free", free them."""
    import torch

    torch.cuda.set_device(device)
    held = None
    if hog:
        free, _ = torch.cuda.mem_get_info()
        held_rest = torch.empty(free - conn.recv(), dtype=torch.uint8, device="cuda")
        conn.send(held_rest.numel())
    while True:
        msg = conn.recv()
        if msg[0] == "take":
            held = torch.empty(msg[1], dtype=torch.uint8, device="cuda")
            held.fill_(7)
            torch.cuda.synchronize()
        elif msg[0] == "free":
            held = None
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
        else:
            return
        conn.send("ok")


def other_engine(conn, tree: str, ext: str, weights, kv, kv_first: bool) -> None:
    """The other engine of a rotation (``--other engine``): on "take", wake; on "free",
    sleep, sending back its sleep's seconds and stages."""
    import gc

    import torch

    cumem = loader.load(Path(tree), Path(ext)).cumem
    alloc = cumem.CuMemAllocator.get_instance()
    (wn, wsize), (kn, ksize) = weights, kv
    with alloc.use_memory_pool("weights"):
        held = [torch.full((wsize,), i % 241, dtype=torch.uint8, device="cuda") for i in range(wn)]
    with alloc.use_memory_pool("kv_cache"):
        held += [torch.empty(ksize, dtype=torch.uint8, device="cuda") for _ in range(kn)]
    gc.freeze()

    def sleep():
        if kv_first:  # the discarded allocations' releases first, then the sleep proper
            awake = [(p, d) for p, d in alloc.pointer_to_data.items() if not d.asleep and d.tag != "weights"]
            for unit, members in cumem._in_units(awake):
                alloc._unmap(unit)
                for _, data in members:
                    data.asleep = True
        alloc.sleep(offload_tags=("weights",))

    sleep()  # the first sleep (every byte copied) is not a steady swap's
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] == "take":
            alloc.wake_up()
            torch.cuda.synchronize()
            conn.send("ok")
        elif msg[0] == "free":
            start = time.perf_counter()
            sleep()
            conn.send(("ok", time.perf_counter() - start, dict(getattr(alloc, "last_sleep_stages", {}) or {})))
        else:
            return


def timed_calls(cumem) -> list[float]:
    """Time every create_and_map the wake makes (the module global it calls)."""
    seconds: list[float] = []
    real = cumem.create_and_map

    def timed(handle):
        start = time.perf_counter()
        try:
            return real(handle)
        finally:
            seconds.append(time.perf_counter() - start)

    cumem.create_and_map = timed
    return seconds


def h2d_ceiling(nbytes: int = 4 << 30, reps: int = 3) -> float:
    """The pinned host-to-device rate into device memory in use, bytes per second (best of REPS)."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    best = _best(torch, lambda: dev.copy_(host, non_blocking=True), reps)
    del host, dev
    torch.cuda.empty_cache()
    return nbytes / best


def one_rep(alloc, calls: list[float], other, released: int, pause_s: float = 0.0,
            first_kv=None) -> dict:
    import torch

    start = time.perf_counter()
    alloc.sleep(offload_tags=("weights",))
    sleep_s = time.perf_counter() - start
    sleep_stages = dict(getattr(alloc, "last_sleep_stages", {}) or {})
    other_sleep = None
    if other is not None:
        other.send(("take", released))
        other.recv()
        other.send(("free",))
        answer = other.recv()
        if isinstance(answer, tuple):  # the other engine's sleep
            other_sleep = {"sleep_s": answer[1], "stages": answer[2]}
    if pause_s:
        time.sleep(pause_s)
    calls.clear()
    start = time.perf_counter()
    alloc.wake_up()
    torch.cuda.synchronize()
    wake_s = time.perf_counter() - start
    first_write_s = None
    if first_kv is not None:  # what the engine's first step meets in the KV cache
        start = time.perf_counter()
        first_kv.fill_(1)
        torch.cuda.synchronize()
        first_write_s = time.perf_counter() - start
    stages = dict(getattr(alloc, "last_wake_up_stages", {}) or {})
    return {"sleep_s": sleep_s, "sleep_stages": sleep_stages, "wake_s": wake_s, "stages": stages, "maps": len(calls),
            "map_median_us": statistics.median(calls) * 1e6, "map_max_us": max(calls) * 1e6,
            "map_total_s": sum(calls), "pause_s": pause_s, "first_kv_write_s": first_write_s,
            "other_sleep": other_sleep}


def settings(args) -> list[tuple[str, float]]:
    return [(o, ms) for o in args.order for ms in args.pause_ms]


def run(args, cumem, other_mode: str, ext: Path | None = None) -> dict[str, list[dict]]:
    """REPS reps of every (order, pause) setting, taking turns; the reps by setting."""
    import torch

    alloc = cumem.CuMemAllocator.get_instance()
    calls = timed_calls(cumem)
    (wn, wsize), (kn, ksize) = args.weights, args.kv
    with alloc.use_memory_pool("weights"):
        weights = [torch.full((wsize,), i % 251, dtype=torch.uint8, device="cuda") for i in range(wn)]
    with alloc.use_memory_pool("kv_cache"):
        kv = [torch.empty(ksize, dtype=torch.uint8, device="cuda") for _ in range(kn)]
    released = wn * wsize + kn * ksize
    conn = proc = None
    if other_mode == "engine":
        import gc

        gc.freeze()
        conn, child = mp.get_context("spawn").Pipe()
        proc = mp.get_context("spawn").Process(
            target=other_engine, args=(child, str(args.tree.resolve()), str(ext), args.weights, args.kv,
                                       args.other_sleep == "kv-first"))
        proc.start()
        conn.recv()
    elif other_mode != "none":
        conn, child = mp.get_context("spawn").Pipe()
        proc = mp.get_context("spawn").Process(
            target=other_process, args=(child, torch.cuda.current_device(), other_mode == "release-hog"))
        proc.start()
        if other_mode == "release-hog":
            conn.send(released + (512 * MiB))  # what the hog leaves free
            conn.recv()
    reps: dict[str, list[dict]] = {}
    try:
        for _ in range(args.reps):
            for name, ms in settings(args):
                use_order(cumem, name)
                rep = one_rep(alloc, calls, conn, released, ms / 1e3, kv[-1])
                reps.setdefault(f"{name}, pause {ms:g} ms", []).append({**rep, "order": name})
    finally:
        use_order(cumem, "as-is")
        if proc is not None:
            conn.send(("quit",))
            proc.join(30)
    assert all(t.numel() == ksize for t in kv)  # the KV cache was held throughout
    bad = [i for i, t in enumerate(weights) if int(t[0]) != i % 251 or int(t[-1]) != i % 251]
    if bad:
        raise SystemExit(f"cumem_wake_maps_bench: {len(bad)} weight allocations lost their bytes")
    return reps


def summary(mode: str, setting: str, reps: list[dict], ceiling: float) -> str:
    def rate(r):
        st = r["stages"]
        return st.get("copied_bytes", 0) / st["copy_s"] / ceiling if st.get("copy_s") else float("nan")

    return f"{mode}, {setting}: " + "; ".join(
        f"sleep {r['sleep_s'] * 1e3:.1f} ms ({r['sleep_stages'].get('unmapped', '?')} unmaps "
        f"{r['sleep_stages'].get('unmap_s', 0) * 1e3:.1f} ms), "
        f"wake {r['wake_s'] * 1e3:.1f} ms, copies {r['stages'].get('copy_s', 0) * 1e3:.1f} ms "
        f"({rate(r):.3f} of H2D), first KV write {(r['first_kv_write_s'] or 0) * 1e3:.2f} ms, "
        f"{r['maps']} maps {r['map_total_s'] * 1e3:.1f} ms"
        + (f", the other's sleep {r['other_sleep']['sleep_s'] * 1e3:.1f} ms" if r.get("other_sleep") else "")
        for r in reps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tree", type=Path)
    p.add_argument("--weights", type=layout, default=layout("500x12"))
    p.add_argument("--kv", type=layout, default=layout("123x25"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--other", default="none,release,release-hog",
                   help=f"comma-separated, of {', '.join(OTHERS)}")
    p.add_argument("--order", type=orders, default=["as-is"],
                   help="the wake's order of maps and copies: as-is, groupN, maps-first or "
                        "kv-after-copies (a comma-separated list: taking turns)")
    p.add_argument("--pause-ms", type=pauses, default=[0.0],
                   help="the wait between the other process's free and the wake (a comma-separated "
                        "list: taking turns)")
    p.add_argument("--other-sleep", choices=("as-is", "kv-first"), default="as-is",
                   help="with --other engine: the other engine's sleep as the tree makes it, or with "
                        "its discarded allocations unmapped first")
    p.add_argument("--json-out", type=Path)
    p.add_argument("--python-include", type=Path)
    args = p.parse_args()
    modes = args.other.split(",")
    if any(m not in OTHERS for m in modes):
        p.error(f"--other {args.other!r}: each must be one of {', '.join(OTHERS)}")
    work = Path(tempfile.mkdtemp(prefix="cumem-wake-maps-bench-"))
    if len(modes) > 1:  # one process per mode: each starts from a card it has not touched
        result = {"modes": {}}
        for mode in modes:
            out = work / f"{mode}.json"
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--other", mode, "--json-out", str(out)],
                           check=True)
            one = json.loads(out.read_text())
            result = {**one, "modes": {**result["modes"], **one["modes"]}}
    else:
        ext = native.build_cumem_extension(args.tree.resolve(), work, python_include=args.python_include)
        cumem = loader.load(args.tree.resolve(), ext).cumem
        import torch

        ceiling_before = h2d_ceiling()
        reps = run(args, cumem, modes[0], ext)
        ceiling_after = h2d_ceiling()
        result = {"gpu": torch.cuda.get_device_name(), "weights": list(args.weights), "kv": list(args.kv),
                  "skip_unchanged": os.environ.get("VLLM_CUMEM_SKIP_UNCHANGED", "unset"),
                  "merge_runs": os.environ.get("VLLM_CUMEM_MERGE_RUNS", "unset"), "order": args.order,
                  "pause_ms": args.pause_ms, "other_sleep": args.other_sleep,
                  "h2d_ceiling_gbps": [ceiling_before / 1e9, ceiling_after / 1e9],
                  "modes": {modes[0]: reps}}
        for setting, rs in reps.items():
            print(summary(modes[0], setting, rs, max(ceiling_before, ceiling_after)), flush=True)
        print(f"{modes[0]}: H2D ceiling {ceiling_before / 1e9:.1f} GB/s before, "
              f"{ceiling_after / 1e9:.1f} GB/s after", flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
