#!/usr/bin/env python3
"""Randomized mutations of a GPU buffer that the sleep's checksum must all see.

A buffer of --mib MiB plus 3 bytes (an odd size) on the GPU, its checksum (the Triton
kernel) checked once against the pure-torch reference on the same GPU (bit for bit);
then --n mutations, each applied in place, checksummed, undone: a flipped bit, two
elements swapped (1, 2, 4 or 8 bytes wide), +d at one 16-bit word and -d at another (the
sum kept), +d, -2d, +d at three equally spaced words, the two 32-bit words of an 8-byte
pair swapped (NH multiplies them: only its keys tell the two orders apart). A mutation whose checksum equals
the original's is undetected (must be 0); every 100th undo is checked to give the
original checksum back. Prints one JSON object.

    python3 bench/checksum_mutations.py [--module PATH] [--n 10000] [--mib 64]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
from pathlib import Path

import torch

DEFAULT = (Path(__file__).resolve().parents[1]
           / "patches/fixes/cumem-skip-unchanged/new/vllm/device_allocator/cumem_checksum.py")
KINDS = ("bit", "swap1", "swap2", "swap4", "swap8", "plus_minus", "plus_minus2_plus", "pair_swap")


def load(path: Path):
    spec = importlib.util.spec_from_file_location("cumem_checksum", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def mutate(buf: torch.Tensor, kind: str, rng: random.Random) -> None:
    """Apply one mutation of ``kind`` in place; it is undone by restoring a saved copy."""
    if kind == "bit":
        i = rng.randrange(buf.numel())
        buf[i] ^= 1 << rng.randrange(8)
    elif kind.startswith("swap"):
        width = int(kind[4:])
        elems = buf[: buf.numel() // width * width].view(-1, width)
        while True:
            i, j = rng.sample(range(elems.shape[0]), 2)
            if not torch.equal(elems[i], elems[j]):
                break
        elems[[i, j]] = elems[[j, i]]
    elif kind == "pair_swap":
        pairs = buf[: buf.numel() // 8 * 8].view(-1, 2, 4)
        i = rng.randrange(pairs.shape[0])
        pairs[i] = pairs[i].flip(0)  # equal words: no change, skipped by the caller
    else:
        words = buf[: buf.numel() // 2 * 2].view(torch.int16)
        d = rng.randrange(1, 1000)
        if kind == "plus_minus":
            i, j = rng.sample(range(words.numel()), 2)
            words[i] += d
            words[j] -= d
        else:
            step = rng.randrange(1, 5000)
            i = rng.randrange(words.numel() - 2 * step)
            words[i] += d
            words[i + step] -= 2 * d
            words[i + 2 * step] += d


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", type=Path, default=DEFAULT, help="cumem_checksum.py to load")
    parser.add_argument("--n", type=int, default=10000)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", help="cpu: the Triton interpreter (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    ck = load(args.module)
    rng = random.Random(args.seed)
    buf = torch.empty((args.mib << 20) + 3, dtype=torch.uint8, device=args.device).random_()
    checksum = ck.Checksum()
    span = [(buf.data_ptr(), buf.numel())]
    original = checksum.sums(span, buf.device).tolist()
    name = torch.cuda.get_device_name() if buf.is_cuda else "cpu"
    report = {"device": name, "bytes": buf.numel(), "n": args.n,
              "triton": checksum.use_triton,
              "kernel_equals_reference": original == [checksum.reference(buf).tolist()],
              "undetected": 0, "undo_mismatches": 0, "by_kind": dict.fromkeys(KINDS, 0)}
    for k in range(args.n):
        kind = KINDS[k % len(KINDS)]
        saved = buf.clone()
        mutate(buf, kind, rng)
        if torch.equal(buf, saved):  # e.g. an int16 that wrapped back: no change made
            continue
        report["by_kind"][kind] += 1
        if checksum.sums(span, buf.device).tolist() == original:
            report["undetected"] += 1
        buf.copy_(saved)
        if k % 100 == 0 and checksum.sums(span, buf.device).tolist() != original:
            report["undo_mismatches"] += 1
    print(json.dumps(report))
    return 0 if report["undetected"] == 0 and report["kernel_equals_reference"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
