# SPDX-License-Identifier: Apache-2.0
# sm12x-bundle: sleep() copies only the allocations whose bytes changed.
"""A keyed checksum of GPU memory, and the sleep's record of what each backup holds.

Serving does not write the weights, yet every sleep copied them to the host again,
into a backup that already held the same bytes. Here the sleep takes a checksum of
each offloaded allocation on the GPU and compares it with the checksum taken at the
sleep that last copied it (its backup kept since, through the wake that restored
from it): equal, the allocation is unmapped without a copy; different, it is copied
as before. Off by default: VLLM_CUMEM_SKIP_UNCHANGED=1 turns it on.

The checksum
------------
The allocation's bytes are read as 16-bit little-endian words w_i (a trailing odd
byte is a word of its own, its high byte zero), so that each word is an element of
F_p, p = 2^32 - 5 (the largest prime below 2^32). The index i is split as (block b,
offset j), i = b*B + j, B = 4096 words. Keys are drawn from os.urandom in each
process, uniform in F_p (32 random bits, the 5 values >= p drawn again: exactly
uniform): K1[j] for j < B and K2[b] for every block index used so far (the table
grows with the largest allocation: 4 bytes of keys per 8 KiB of data). The checksum
is the bilinear form

    h(W) = sum_b K2[b] * (sum_j K1[j] * w_{b,j} mod p) mod p  =  K1^T W K2  (mod p),

W being the words as a B x nblocks matrix, zero padded. Two buffers of the same
length whose bytes differ have words that differ (the map from bytes to words is
one to one for a given length), so D = W - W' != 0 mod p (0 <= w < 2^16 < p), and
h(W) = h(W') iff K1^T D K2 = 0. With K2 uniform, the vector D K2 is zero with
probability <= 1/p (a nonzero row of D dotted with K2); when it is not, its dot with
the independent K1 is zero with probability exactly 1/p. So one checksum misses with
probability <= 1/p + 1/p < 2/p (the Schwartz-Zippel bound for this degree-2
polynomial), and two checksums with independent keys (two K1 and two K2 tables) miss
together with probability < 4/p^2 = 2^-61.99999999 <= 2^-60. This holds for any
change of any byte, any permutation of words and any change that keeps a sum,
whatever the data: the keys are secret and drawn after the data exist, so no fixed
input is bad for them. (p = 2^31 - 1 would give 4/p^2 = 2^-60 * (1 + 2^-30), just
above 2^-60.) Lengths are fixed per allocation: buffers of different lengths are
never compared.

Arithmetic, all in int64 and exact: w * K1 < 2^16 * 2^32 = 2^48, and a block sum of
B = 2^12 of them is < 2^60. Its residue r < 2^32 times K2 < 2^32 would not fit, so
K2 is split in 16-bit halves: ((r * K2_hi mod p) * 2^16 + r * K2_lo) mod p, every
term < 2^49. The per-block values (< 2^32) are summed per allocation (exact for up to
2^31 blocks, 16 TiB) and reduced. The Triton kernel and the pure-torch reference
below compute the same function bit for bit.

The kernel reads each byte once: a persistent grid, each program keeps both K1
tables in registers and walks blocks (one descriptor per block: address, bytes,
block index), writing two residues per block; the per-allocation sums are a cumsum.
One launch covers every allocation of a sleep.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Iterable, Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the pure-torch reference serves (slower, same sums)
    triton = None

logger = logging.getLogger(__name__)

P = (1 << 32) - 5  # prime
BLOCK = 4096  # words per block: the length of K1
HASHES = 2


def _env(name: str, default: str) -> str:
    try:  # registered in vllm/envs.py; read through it where vLLM is importable
        from vllm import envs

        return str(getattr(envs, name))
    except (ImportError, AttributeError):
        return os.getenv(name, default)


def enabled() -> bool:
    # Off unless asked for: on an H200 this kernel reads 57 GB/s, about as fast as
    # the device-to-host copy it would save (bench/checksum_bench.py, 2026-11-27).
    return _env("VLLM_CUMEM_SKIP_UNCHANGED", "0").strip().lower() in (
        "1", "true", "on")


def uniform_keys(n: int) -> torch.Tensor:
    """n keys uniform in [0, p), from os.urandom: 32 random bits, the values >= p
    drawn again."""
    keys = torch.empty(0, dtype=torch.int64)
    while keys.numel() < n:
        raw = torch.frombuffer(bytearray(os.urandom(4 * n)), dtype=torch.int32)
        raw = raw.to(torch.int64) & 0xFFFFFFFF
        keys = torch.cat([keys, raw[raw < P]])
    return keys[:n]


def times_key(r, key, p: int):
    """r * key mod p for r, key < 2^32, every step < 2^63 (torch or Triton)."""
    return ((r * (key >> 16)) % p * 65536 + r * (key & 0xFFFF)) % p


def device_view(addr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """The bytes at ``addr`` as a uint8 tensor that does not own them."""
    if device.type == "cpu":
        buf = (ctypes.c_uint8 * nbytes).from_address(addr)
        return torch.frombuffer(buf, dtype=torch.uint8)

    class _Span:  # the CUDA array interface (v2: no stream, no synchronize)
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                    "data": (addr, False), "version": 2}

    return torch.as_tensor(_Span(), device=device)


if triton is not None:

    @triton.jit
    def _key(stored):
        """A key stored as the 32-bit pattern of an int32, zero-extended."""
        return stored.to(tl.uint32, bitcast=True).to(tl.int64)

    @triton.jit
    def _times_key(r, key, P: tl.constexpr):
        return ((r * (key >> 16)) % P * 65536 + r * (key & 0xFFFF)) % P

    @triton.jit
    def _block_residues(addr_ptr, nbytes_ptr, index_ptr, k1_ptr, k2_ptr, k2_len,
                        out_ptr, nblocks, P: tl.constexpr, BLOCK: tl.constexpr):
        """out[t] = ((sum_j K1[j] w_j) mod p) * K2[b] mod p for each block t, for
        both hashes; blocks pid, pid + programs, ..."""
        j = tl.arange(0, BLOCK)
        k1a = _key(tl.load(k1_ptr + j))
        k1b = _key(tl.load(k1_ptr + BLOCK + j))
        for t in range(tl.program_id(0), nblocks, tl.num_programs(0)):
            addr = tl.load(addr_ptr + t)
            nb = tl.load(nbytes_ptr + t)
            b = tl.load(index_ptr + t)
            words = tl.multiple_of(addr, 16).to(tl.pointer_type(tl.uint16))
            if nb == 2 * BLOCK:  # a whole block: unmasked, vector loads
                w = tl.load(words + j).to(tl.int64)
                s1 = tl.sum(w * k1a, axis=0)
                s2 = tl.sum(w * k1b, axis=0)
            else:  # an allocation's last block: masked, maybe an odd byte
                nw = nb // 2
                w = tl.load(words + j, mask=j < nw, other=0).to(tl.int64)
                odd = (nb % 2) == 1
                last = tl.load(addr.to(tl.pointer_type(tl.uint8)) + nb - 1,
                               mask=odd, other=0).to(tl.int64)
                ka = _key(tl.load(k1_ptr + nw, mask=odd, other=0))
                kb = _key(tl.load(k1_ptr + BLOCK + nw, mask=odd, other=0))
                s1 = tl.sum(w * k1a, axis=0) + last * ka
                s2 = tl.sum(w * k1b, axis=0) + last * kb
            r1 = _times_key(s1 % P, _key(tl.load(k2_ptr + b)), P)
            r2 = _times_key(s2 % P, _key(tl.load(k2_ptr + k2_len + b)), P)
            tl.store(out_ptr + 2 * t, r1)
            tl.store(out_ptr + 2 * t + 1, r2)


class Checksum:
    """Two keyed checksums of byte spans in device memory, keys of this process."""

    def __init__(self, programs_per_sm: int = 8, num_warps: int = 8,
                 use_triton: bool | None = None) -> None:
        self.k1 = uniform_keys(HASHES * BLOCK).view(HASHES, BLOCK)
        self.k2 = uniform_keys(HASHES * 1024).view(HASHES, 1024)
        self.programs_per_sm, self.num_warps = programs_per_sm, num_warps
        self.use_triton = triton is not None if use_triton is None else use_triton
        self.view = device_view  # tests stand in for device memory here
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._layout: tuple[object, list[torch.Tensor]] = (None, [])

    def release(self) -> None:
        """Drop the keys' device copies: a sleeping process holds no GPU memory
        for them (uploaded again, without a synchronize, at the next sleep)."""
        self._on_device.clear()

    def _grow_k2(self, nblocks: int) -> None:
        if nblocks > self.k2.shape[1]:
            more = max(nblocks, 2 * self.k2.shape[1]) - self.k2.shape[1]
            extra = uniform_keys(HASHES * more).view(HASHES, more)
            self.k2 = torch.cat([self.k2, extra], dim=1)
            self._on_device.clear()

    def _keys_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._on_device:
            self._on_device[device] = (_upload(_int32_bits(self.k1), device),
                                       _upload(_int32_bits(self.k2), device))
        return self._on_device[device]

    def sums(self, spans: Sequence[tuple[int, int]], device) -> torch.Tensor:
        """[len(spans), 2] int64 on ``device``: the checksums of the spans
        (address, bytes). Launched on the current stream; nothing waits for it."""
        device = torch.device(device)
        if not spans:
            return torch.zeros(0, HASHES, dtype=torch.int64, device=device)
        self._grow_k2(max(_blocks(n) for _, n in spans))
        aligned = all(addr % 16 == 0 for addr, _ in spans)
        if self.use_triton and aligned and (device.type == "cuda" or _interpreting()):
            return self._kernel_sums(spans, device)
        return torch.stack([self.reference(self.view(a, n, device)) for a, n in spans])

    def reference(self, data: torch.Tensor) -> torch.Tensor:
        """The checksums of one uint8 tensor in pure torch: [2] int64, same device."""
        data = data.reshape(-1)
        nblocks = _blocks(data.numel())
        self._grow_k2(nblocks)
        k1 = self.k1.to(data.device)
        k2 = self.k2[:, :nblocks].to(data.device)
        total = torch.zeros(HASHES, dtype=torch.int64, device=data.device)
        step = 2048  # blocks per chunk: 64 MiB of int64 words at a time
        for first in range(0, nblocks, step):
            chunk = data[first * 2 * BLOCK:(first + step) * 2 * BLOCK]
            n = -(-chunk.numel() // (2 * BLOCK))
            padded = torch.zeros(n * 2 * BLOCK, dtype=torch.int64, device=data.device)
            padded[:chunk.numel()] = chunk.to(torch.int64)
            words = (padded[0::2] + 256 * padded[1::2]).view(n, BLOCK)
            inner = (words.unsqueeze(0) * k1.view(HASHES, 1, BLOCK)).sum(-1) % P
            total += times_key(inner, k2[:, first:first + n], P).sum(-1)
        return total % P

    def _kernel_sums(self, spans: Sequence[tuple[int, int]],
                     device: torch.device) -> torch.Tensor:
        key = (tuple(spans), device)
        if self._layout[0] != key:  # the same allocations, sleep after sleep: kept
            self._layout = (key, [_pinned(x, device) for x in _descriptors(spans)])
        addrs, nbytes, index, ends = (_upload(x, device) for x in self._layout[1])
        k1, k2 = self._keys_on(device)
        nblocks = addrs.numel()
        out = torch.empty(nblocks, HASHES, dtype=torch.int64, device=device)
        grid = (max(1, min(nblocks, self._programs(device))),)
        _block_residues[grid](addrs, nbytes, index, k1, k2, k2.shape[1], out, nblocks,
                              P=P, BLOCK=BLOCK, num_warps=self.num_warps)
        total = torch.cat([torch.zeros(1, HASHES, dtype=torch.int64, device=device),
                           out.cumsum(0)])
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        return (total[ends] - total[starts]) % P

    def _programs(self, device: torch.device) -> int:
        if device.type != "cuda":
            return 3  # the interpreter: a few programs, each walking several blocks
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return sms * self.programs_per_sm


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _int32_bits(keys: torch.Tensor) -> torch.Tensor:
    """Keys < 2^32 stored as int32 with the same bits (the kernel zero-extends)."""
    return torch.where(keys >= 1 << 31, keys - (1 << 32), keys).to(torch.int32)


def _blocks(nbytes: int) -> int:
    return max(1, -(-nbytes // (2 * BLOCK)))


def _pinned(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host.pin_memory() if device.type == "cuda" else host


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """To ``device`` without a host synchronize (pinned, non-blocking)."""
    if device.type != "cuda":
        return host.to(device)
    return _pinned(host, device).to(device, non_blocking=True)


def _descriptors(spans: Sequence[tuple[int, int]]):
    """One entry per block of every span: its address, its bytes, its index in the
    span; and the end (exclusive, in blocks) of each span's run of blocks."""
    counts = torch.tensor([_blocks(n) for _, n in spans], dtype=torch.int64)
    ends = counts.cumsum(0)
    span = torch.repeat_interleave(torch.arange(len(spans)), counts)
    index = torch.arange(int(ends[-1])) - (ends - counts)[span]
    base = torch.tensor([a for a, _ in spans], dtype=torch.int64)[span]
    size = torch.tensor([n for _, n in spans], dtype=torch.int64)[span]
    offset = index * 2 * BLOCK
    nbytes = torch.clamp(size - offset, max=2 * BLOCK)
    return base + offset, nbytes.to(torch.int32), index.to(torch.int32), ends


class SkipUnchanged:
    """What each offloaded allocation's backup holds, as a checksum taken by the
    sleep that copied it (the GPU bytes then equal the backup, and the wake that
    restores from it makes them equal again). The allocator drops an entry whenever
    the backup stops holding the allocation's bytes (``forget``)."""

    def __init__(self, checksum: Checksum | None = None) -> None:
        self.checksum = checksum or Checksum()
        self.stored: dict[int, tuple[object, tuple[int, ...]]] = {}
        self.pending: dict[int, tuple[object, tuple[int, ...]]] = {}
        self.last_checksum_s = 0.0

    @classmethod
    def from_env(cls) -> SkipUnchanged | None:
        if not enabled():
            return None
        skip = cls()
        skip.warm_up()
        return skip

    def warm_up(self) -> None:
        """Build the kernel now, while the model loads, rather than in the first
        sleep (a cold Triton cache takes seconds). A failure only logs: the sleep
        falls back to the reference."""
        if not (self.checksum.use_triton and torch.cuda.is_available()):
            return
        try:
            buf = torch.zeros(16, dtype=torch.uint8, device="cuda")
            self.checksum.sums([(buf.data_ptr(), buf.numel())], buf.device)
        except Exception:  # noqa: BLE001
            logger.warning("cumem checksum: the Triton kernel did not build",
                           exc_info=True)
        self.checksum.release()

    def unchanged(self, allocations: Iterable[tuple[int, object]]) -> set[int]:
        """The addresses, among ``allocations`` (address, AllocationData), whose
        bytes on the GPU equal their backup. Call it once the devices are idle; the
        sums wait here for their kernels (one read back per device)."""
        start = time.perf_counter()
        by_device: dict[int, list[tuple[int, object]]] = {}
        for ptr, data in allocations:
            by_device.setdefault(data.handle[0], []).append((ptr, data))
        same: set[int] = set()
        self.pending.clear()
        for device, group in by_device.items():
            sums = self._sums(device, [(p, d.handle[1]) for p, d in group])
            if sums is None:  # no checksum: this sleep copies them all, and
                for ptr, _ in group:  # their backups get bytes no sum describes
                    self.stored.pop(ptr, None)
                continue
            for (ptr, data), now in zip(group, sums, strict=True):
                kept = self.stored.get(ptr)
                if kept is not None and kept[0] is data and kept[1] == tuple(now):
                    same.add(ptr)
                self.pending[ptr] = (data, tuple(now))
        self.checksum.release()  # the sleep that follows empties the cache
        self.last_checksum_s = time.perf_counter() - start
        return same

    def _sums(self, device: int,
              spans: list[tuple[int, int]]) -> list[list[int]] | None:
        """The spans' checksums on the host; where the kernel fails (a card or a
        Triton it does not build for), the reference from then on; None when that
        fails too."""
        for attempt in range(2):
            try:
                with _default_stream(device):
                    return self.checksum.sums(spans, _device(device)).tolist()
            except Exception:  # noqa: BLE001  (a sleep that copies is still a sleep)
                logger.warning("cumem checksum failed (%s); %s", "Triton kernel"
                               if self.checksum.use_triton else "torch reference",
                               "using the torch reference" if attempt == 0 else
                               "this sleep copies every allocation", exc_info=True)
                if not self.checksum.use_triton:
                    return None
                self.checksum.use_triton = False
        return None

    def commit(self) -> None:
        """The sleep's copies are done: its checksums describe the backups."""
        self.stored.update(self.pending)
        self.pending.clear()

    def forget(self, ptr: int) -> None:
        self.stored.pop(ptr, None)
        self.pending.pop(ptr, None)


def _device(index: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", index)
    return torch.device("cpu")


def _default_stream(index: int):
    """The legacy default stream, on which cudaMemcpy runs: ordered after it."""
    if not torch.cuda.is_available():
        import contextlib

        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.default_stream(index))
