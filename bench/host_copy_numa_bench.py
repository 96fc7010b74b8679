#!/usr/bin/env python3
"""How fast pinned host memory reaches each GPU: by the NUMA node that holds it, one GPU
at a time and every GPU at once.

    python bench/host_copy_numa_bench.py [--gib 2] [--reps 3] [--json-out FILE]

A TP=2 wake copies each rank's weights from its pinned backups into its GPU, both ranks
at the same moment; engine-check's copy ceiling is one GPU's copy alone from wherever the
measuring process's memory lies (enginecheck/ceilings.py). Linux places a page on the node
of the thread that first touches it, and pinning touches every page: this bench pins one
buffer per node from a thread bound to that node's CPUs, checks where its pages are
(move_pages(2), a sample of pages), and times host-to-device copies of the whole buffer
(CUDA events on each GPU's stream, best of REPS):

- ``alone``: each GPU from each node's buffer, the other GPUs idle;
- ``together``: every GPU at once, for each way of giving each GPU a node's buffer (each
  GPU its own buffer): what a TP wake meets.

It changes nothing: it measures. Needs CUDA GPUs; on a machine with one node the
``together`` rows still say what copying to every GPU at once costs.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import sys
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
SYS_MOVE_PAGES = 279  # x86-64


def cpu_list(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def nodes() -> dict[int, set[int]]:
    """Each NUMA node with CPUs: its CPUs (one node 0 with every CPU where sysfs has none)."""
    found = {}
    for path in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        cpus = cpu_list((path / "cpulist").read_text())
        if cpus:
            found[int(path.name[4:])] = cpus
    return found or {0: set(os.sched_getaffinity(0))}


def gpu_node(torch, index: int) -> int | None:
    """The NUMA node sysfs gives the GPU's PCI device; None where it says none (-1)."""
    p = torch.cuda.get_device_properties(index)
    bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    try:
        node = int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def pages_on(address: int, nbytes: int, samples: int = 64) -> dict[int, int]:
    """How many of ``samples`` pages spread over the buffer lie on each node (move_pages
    with no target nodes only reports); {-errno: count} for pages it could not place."""
    libc = ctypes.CDLL(None, use_errno=True)
    step = max(PAGE, (nbytes // samples) // PAGE * PAGE)
    addrs = [address - address % PAGE + i * step for i in range(samples) if i * step < nbytes]
    n = len(addrs)
    pages = (ctypes.c_void_p * n)(*addrs)
    status = (ctypes.c_int * n)()
    if libc.syscall(SYS_MOVE_PAGES, 0, n, pages, None, status, 0) != 0:
        return {-ctypes.get_errno(): n}
    counts: dict[int, int] = {}
    for s in status:
        counts[s] = counts.get(s, 0) + 1
    return counts


def pinned_on(torch, cpus: set[int], nbytes: int):
    """A pinned buffer whose pages were touched by this thread bound to ``cpus``."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        buf.fill_(1)  # every page touched here, where pinning has not already
    finally:
        os.sched_setaffinity(0, before)
    return buf


def timed_copies(torch, pairs: list, reps: int) -> list[float]:
    """Each (host buffer, device buffer) pair's copy, all issued at once on their GPUs'
    own streams; each GPU's best seconds over ``reps`` (CUDA events)."""
    best = [float("inf")] * len(pairs)
    streams = [torch.cuda.Stream(device=dev.device) for _, dev in pairs]
    for _ in range(reps):
        for _, dev in pairs:
            torch.cuda.synchronize(dev.device)
        marks = []
        for (host, dev), stream in zip(pairs, streams):
            with torch.cuda.device(dev.device), torch.cuda.stream(stream):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                dev.copy_(host, non_blocking=True)
                end.record(stream)
                marks.append((start, end))
        for i, (start, end) in enumerate(marks):
            end.synchronize()
            best[i] = min(best[i], start.elapsed_time(end) / 1e3)
    return best


def run(gib: float, reps: int) -> dict:
    import torch

    nbytes = int(gib * (1 << 30))
    node_cpus = nodes()
    gpus = list(range(torch.cuda.device_count()))
    hosts = {}  # (node, gpu) -> buffer: a buffer per GPU per node, so GPUs never share one
    for node, cpus in node_cpus.items():
        for g in gpus:
            hosts[node, g] = pinned_on(torch, cpus, nbytes)
    devs = {g: torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{g}") for g in gpus}
    placed = {f"node {node}": pages_on(hosts[node, gpus[0]].data_ptr(), nbytes) for node in node_cpus}
    rate = lambda s: nbytes / s / 1e9  # noqa: E731
    alone = [{"gpu": g, "node": node, "gbps": round(rate(timed_copies(torch, [(hosts[node, g], devs[g])], reps)[0]), 2)}
             for g in gpus for node in node_cpus]
    together = []
    for choice in itertools.product(sorted(node_cpus), repeat=len(gpus)):
        secs = timed_copies(torch, [(hosts[node, g], devs[g]) for g, node in zip(gpus, choice)], reps)
        together.append({"nodes": list(choice), "gbps": [round(rate(s), 2) for s in secs]})
    return {
        "card": torch.cuda.get_device_name(0), "bytes": nbytes, "reps": reps,
        "nodes": {n: len(c) for n, c in node_cpus.items()},
        "gpu_nodes": {g: gpu_node(torch, g) for g in gpus},
        "pages_by_node_of_buffer": placed, "alone": alone, "together": together,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=2.0, help="bytes of each copy, in GiB (default 2)")
    p.add_argument("--reps", type=int, default=3, help="copies of each kind; the best is kept (default 3)")
    p.add_argument("--json-out", metavar="FILE", help="also write the figures to FILE")
    args = p.parse_args(argv)
    doc = run(args.gib, args.reps)
    for row in doc["alone"]:
        print(f"alone: GPU {row['gpu']} (node {doc['gpu_nodes'][row['gpu']]}) from node {row['node']}: {row['gbps']} GB/s")
    for row in doc["together"]:
        print(f"together: nodes {row['nodes']}: " + ", ".join(f"GPU {g} {r} GB/s" for g, r in enumerate(row["gbps"])))
    print("pages (node: count of sampled pages):", json.dumps(doc["pages_by_node_of_buffer"]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
