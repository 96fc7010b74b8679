"""Scenarios 11 and 12: the first sleep of a process, and a rotation of two engines on
one GPU.

first-sleep: one engine's life, as vLLM's worker lives it. The weights load in a pool
tagged ``weights`` (pieces of 3/4 of the speed chunk: real weight tensors are not
powers of two, and PyTorch's pinned allocator rounds each backup up to one), the KV
cache in one tagged ``kv_cache`` (half the weights' bytes: the seeds' 2/3 : 1/3), then
the first sleep, later sleeps and wakes. Each is set against its ceiling, measured in
the same process: pinned device-to-host for sleeps; for wakes, pinned host-to-device
into memory in use and into memory freshly made by the tree's own allocator (a new
pool: cuMemCreate + map, then one copy). After each wake the engine writes into its KV
cache (timed against the same write into memory in use: the driver still prepares new
memory after a wake returns), and the KV cache must still hold the last write 0.5 s later.
Host memory: this process's resident memory
before the load and after the first sleep, against the bytes offloaded (the
system-wide MemTotal - MemAvailable is reported beside it). Fails when the
first sleep is under ``first_sleep_target`` (0.8) of the D2H ceiling or the backups
take more than ``host_ratio_target`` (1.01) times the bytes offloaded.

rotation: engine A (this process) and engine B (a second process, the same tree),
each with ``rotation_gib`` (24) GiB of weights and KV cache in the same proportions.
B loads and sleeps; A loads; then swaps: sleep the one awake, wake the other. The
first swap holds A's first sleep; the steady swaps are the ones after. Fails when the
first swap takes more than 1.25 times the slowest steady swap."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from .. import cmd
from .measure import GRANULARITY, GiB, fill, host_used, intact, outcome, rss, timed
from .speed import fresh_copy

def weight_piece(chunk: int) -> int:
    return max(GRANULARITY, chunk * 3 // 4 // GRANULARITY * GRANULARITY)


class Engine:
    """Weights and a KV cache in one process's CuMemAllocator, and what a swap does."""

    def __init__(self, torch, cumem, weights: int, kv: int, piece: int, seed: int) -> None:
        self.torch, self.alloc, self.seed = torch, cumem.CuMemAllocator.get_instance(), seed
        self.weights, self.kv, self.piece = weights, kv, piece
        self.tensors: list = []

    def load(self) -> float:

        torch = self.torch
        t0 = time.perf_counter()
        with self.alloc.use_memory_pool("weights"):
            self.tensors = [torch.empty(self.piece // 8, dtype=torch.int64, device="cuda")
                            for _ in range(self.weights // self.piece)]
        with self.alloc.use_memory_pool("kv_cache"):
            self.kv_tensors = [torch.empty(self.piece // 8, dtype=torch.int64, device="cuda")
                               for _ in range(self.kv // self.piece)]
        for i, t in enumerate(self.tensors):
            fill(torch, t, self.seed + (i << 40))
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def pool_wait(self) -> float:
        """How long the backup pool's background pinning still had to run (0 when the
        tree has no pool)."""
        pool = getattr(self.alloc, "backup_pool", None)
        t0 = time.perf_counter()
        if pool is not None:
            pool.wait()
        return time.perf_counter() - t0

    def sleep(self) -> float:

        return timed(self.torch, lambda: self.alloc.sleep(offload_tags=("weights",)))

    def wake(self) -> float:

        return timed(self.torch, self.alloc.wake_up)

    def write_kv(self, value: int) -> float:
        """The engine's first write into its KV cache after a wake, timed. The memory
        is new: the driver still works on new memory after cuMemCreate returns, and a
        write into it waits for that work (a wake that maps the KV cache last returns
        before the work ends, and that part of it moves here)."""

        return timed(self.torch, lambda: [t.fill_(value) for t in self.kv_tensors])

    def kv_holds(self, value: int) -> bool:
        return all(bool((t == value).all()) for t in self.kv_tensors)

    def intact(self) -> bool:

        return all(intact(self.torch, t, self.seed + (i << 40)) for i, t in enumerate(self.tensors))


def pool_pin_s(alloc) -> float | None:
    """How long the background pinning took (it ran while the engine started)."""
    pool = getattr(alloc, "backup_pool", None)
    return None if pool is None else sum(r.pin_s or 0.0 for r in pool.regions)


def pool_bytes(alloc) -> int | None:
    pool = getattr(alloc, "backup_pool", None)
    return None if pool is None else pool.capacity()


# --- 6 first-sleep --------------------------------------------------------------------------


def first_sleep(torch, cumem, p: dict) -> dict:
    piece = weight_piece(p["speed_chunk"])
    weights = p["speed_bytes"] // piece * piece
    reps = p.get("speed_reps", 3)
    e = Engine(torch, cumem, weights, weights // 2 // piece * piece, piece, seed=6 << 50)
    torch.empty(1, device="cuda")
    before, rss_before = host_used(), rss()
    f = {"weights_bytes": weights, "kv_bytes": e.kv, "piece_bytes": piece, "load_s": e.load(),
         "pool_wait_s": e.pool_wait()}  # the engine's start-up (profiling, graph capture) runs meanwhile
    f["first_sleep_s"] = e.sleep()
    f["host_bytes_after_first_sleep"], f["rss_bytes_after_first_sleep"] = host_used() - before, rss() - rss_before
    f.update(_cycles_with_kv_writes(e, reps))
    time.sleep(0.5)  # driver work on the new memory that ran after the writes would show now
    if not e.intact():
        return outcome("fail", "the weights did not round-trip through sleep and wake")
    if not e.kv_holds(reps + 2):
        return outcome("fail", "the KV cache lost the writes made into it right after the wake")
    f.update(_first_sleep_figures(f, *_engine_ceilings(torch, e, reps), pool_bytes(e.alloc), pool_pin_s(e.alloc)))
    return _first_sleep_judged(f, p.get("first_sleep_target", 0.8), p.get("host_ratio_target", 1.01))


def _cycles_with_kv_writes(e: Engine, reps: int) -> dict:
    """``reps`` wakes and sleeps and a last wake, each wake followed by the engine's first
    write into its KV cache; then the same write into memory in use."""
    wakes, sleeps, kv_writes = [], [], []
    for i in range(reps + 1):
        wakes.append(e.wake())
        kv_writes.append(e.write_kv(i + 1))
        if i < reps:
            sleeps.append(e.sleep())
    return {"sleeps_s": sleeps, "wakes_s": wakes, "kv_first_writes_s": kv_writes,
            "kv_write_in_use_s": e.write_kv(reps + 2)}


def _engine_ceilings(torch, e: Engine, reps: int) -> tuple[float, float, float]:
    """D2H, H2D into memory in use and H2D into fresh memory, for the engine's own weights."""
    views = [t.view(torch.uint8) for t in e.tensors]
    hosts = [torch.empty(e.piece, dtype=torch.uint8, pin_memory=True) for _ in views]
    d2h = min(timed(torch, lambda: [h.copy_(v) for h, v in zip(hosts, views)]) for _ in range(reps))
    h2d = min(timed(torch, lambda: [v.copy_(h) for h, v in zip(hosts, views)]) for _ in range(reps))
    fresh = min(fresh_copy(torch, e.alloc, hosts, e.piece, f"selftest-fresh-{i}") for i in range(reps))
    return d2h, h2d, fresh


def _first_sleep_figures(f: dict, d2h: float, h2d: float, fresh: float, pool: int | None, pin_s: float | None) -> dict:
    weights = f["weights_bytes"]

    def gbps(s: float) -> float:
        return weights / s / 1e9

    g = {"pool_bytes": pool, "pool_pin_s": pin_s, "first_sleep_gbps": gbps(f["first_sleep_s"]),
         "later_sleep_gbps": gbps(min(f["sleeps_s"])), "wake_gbps": gbps(min(f["wakes_s"])),
         "d2h_ceiling_gbps": gbps(d2h), "h2d_ceiling_gbps": gbps(h2d), "fresh_h2d_ceiling_gbps": gbps(fresh),
         "wake_then_kv_write_gbps": gbps(min(w + k for w, k in zip(f["wakes_s"], f["kv_first_writes_s"]))),
         "host_used_ratio": f["host_bytes_after_first_sleep"] / weights,
         "host_ratio": f["rss_bytes_after_first_sleep"] / weights,
         "backup_pool": os.environ.get("VLLM_SM12X_BACKUP_POOL", "")}
    g["first_sleep_ratio"] = g["first_sleep_gbps"] / g["d2h_ceiling_gbps"]
    g["later_sleep_ratio"] = g["later_sleep_gbps"] / g["d2h_ceiling_gbps"]
    g["wake_ratio"] = g["wake_gbps"] / g["h2d_ceiling_gbps"]
    g["wake_fresh_ratio"] = g["wake_gbps"] / g["fresh_h2d_ceiling_gbps"]
    g["wake_then_kv_write_fresh_ratio"] = g["wake_then_kv_write_gbps"] / g["fresh_h2d_ceiling_gbps"]
    return g


def _first_sleep_judged(f: dict, target: float, ram_target: float) -> dict:
    words = (f"{f['weights_bytes'] / GiB:.1f} GiB offloaded: first sleep {f['first_sleep_s']:.2f} s = "
             f"{f['first_sleep_ratio']:.0%} of D2H {f['d2h_ceiling_gbps']:.1f} GB/s (pool wait {f['pool_wait_s']:.2f} s), "
             f"later {f['later_sleep_ratio']:.0%}; wake {f['wake_ratio']:.0%} of H2D {f['h2d_ceiling_gbps']:.1f}, "
             f"{f['wake_fresh_ratio']:.0%} of fresh {f['fresh_h2d_ceiling_gbps']:.1f} (with the first KV write "
             f"{f['wake_then_kv_write_fresh_ratio']:.0%}, the write {min(f['kv_first_writes_s']) * 1e3:.0f} ms, "
             f"{f['kv_write_in_use_s'] * 1e3:.0f} in use); host RAM {f['host_ratio']:.3f}x the bytes offloaded (RSS; "
             f"system-wide {f['host_used_ratio']:.3f}x)")
    if f["first_sleep_ratio"] < target or f["host_ratio"] > ram_target:
        return outcome("fail", f"{words}: wants first sleep >= {target:.0%}, host RAM <= {ram_target}x", **f)
    return outcome("pass", words, **f)


def rotation_sizes(gib: float, chunk: int) -> tuple[int, int, int]:
    piece = weight_piece(chunk)
    total = int(gib * GiB)
    weights = -(-(total * 2 // 3) // piece) * piece
    kv = -(-(total - weights) // piece) * piece
    return weights, kv, piece


def rotation(torch, cumem, p: dict) -> dict:
    weights, kv, piece = rotation_sizes(p.get("rotation_gib", 24.0), p["speed_chunk"])
    free = torch.cuda.mem_get_info()[0]
    if free < 2.1 * (weights + kv):
        return outcome("error", f"rotation needs 2 x {(weights + kv) / GiB:.1f} GiB; {free / GiB:.1f} GiB free")
    swaps = p.get("rotation_swaps", 6)
    b = Peer(cumem, weights, kv, piece)
    try:
        b.ask("load")
        b_first = b.ask("sleep")
        a = Engine(torch, cumem, weights, kv, piece, seed=7 << 50)
        a.load()
        wait_s = a.pool_wait()
        times, parts = [], []
        for i in range(swaps):
            t0 = time.perf_counter()
            if i % 2 == 0:
                s, w = a.sleep(), b.ask("wake")
            else:
                s, w = b.ask("sleep"), a.wake()
            times.append(time.perf_counter() - t0)
            parts.append({"sleep_s": s, "wake_s": w})
        if swaps % 2:  # end with A awake and B asleep, then look at both
            b.ask("sleep"), a.wake()
        ok = a.intact() and b.ask("wake") is not None and b.ask("intact")
    finally:
        b.close()
    first, steady = times[0], times[1:]
    f = {"weights_bytes_each": weights, "kv_bytes_each": kv, "swaps_s": times, "parts": parts,
         "first_swap_s": first, "steady_swap_median_s": statistics.median(steady), "steady_swap_max_s": max(steady),
         "b_first_sleep_s": b_first, "a_pool_wait_s": wait_s, "seeds_swap_s": 3.0, "seeds_first_sleep_s": 39.4}
    words = (f"2 x {(weights + kv) / GiB:.1f} GiB ({weights / GiB:.1f} weights + {kv / GiB:.1f} KV each): first swap "
             f"{first:.2f} s, steady {f['steady_swap_median_s']:.2f} s (max {max(steady):.2f}); the seeds: 3 s, "
             f"first sleep 39.4 s")
    if not ok:
        return outcome("fail", f"{words}: weights not intact after the swaps", **f)
    if first > 1.25 * max(steady):
        return outcome("fail", f"{words}: the first swap is over 1.25x the steady ones", **f)
    return outcome("pass", words, **f)


class Peer:
    """Engine B in its own process, driven line by line over a pipe."""

    def __init__(self, cumem, weights: int, kv: int, piece: int) -> None:
        tree = Path(cumem.__file__).resolve().parents[2]
        src = str(Path(__file__).resolve().parents[2])
        argv = [sys.executable, "-m", "sm12x_bundle.selftest.engines", "--sizes", f"{weights},{kv},{piece}"]
        if (tree / "csrc").is_dir():  # a source tree with its extension built alone; else the installed vLLM
            argv += ["--tree", str(tree), "--extension", str(Path(cumem.lib_name).resolve())]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
        self.proc = cmd.start(argv, env=env, echo=False)

    def ask(self, what: str):
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline() or '{"error": "peer exited"}')
        if "error" in reply:
            raise RuntimeError(f"peer {what}: {reply['error']}")
        return reply["value"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def peer_main(argv: list[str] | None = None) -> None:
    import argparse

    from . import loader

    p = argparse.ArgumentParser(prog="python -m sm12x_bundle.selftest.engines")
    p.add_argument("--tree", type=Path)
    p.add_argument("--extension", type=Path)
    p.add_argument("--sizes", required=True)
    args = p.parse_args(argv)
    weights, kv, piece = (int(x) for x in args.sizes.split(","))
    # The replies go to the real stdout; anything else printed (vLLM logs to stdout)
    # goes to stderr, so that it cannot break the protocol.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    loaded = loader.load(args.tree, args.extension)
    import torch

    e = Engine(torch, loaded.cumem, weights, kv, piece, seed=8 << 50)
    acts = {"load": e.load, "sleep": e.sleep, "wake": e.wake, "intact": e.intact}
    for line in sys.stdin:
        try:
            reply = {"value": acts[line.strip()]()}
        except Exception as exc:  # noqa: BLE001  (reported to engine A, which fails the scenario)
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), file=replies, flush=True)
    os._exit(0)


if __name__ == "__main__":  # the peer: Peer starts this module with python -m
    peer_main()
