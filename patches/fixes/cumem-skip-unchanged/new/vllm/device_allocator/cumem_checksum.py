# SPDX-License-Identifier: Apache-2.0
# sm12x-bundle: sleep() copies only the allocations whose bytes changed.
"""A keyed checksum of GPU memory, and the sleep's record of what each backup holds.

Serving does not write the weights, yet every sleep copied them to the host again,
into a backup that already held the same bytes. Here the sleep takes a checksum of
each offloaded allocation on the GPU and compares it with the checksum taken at the
sleep that last copied it (its backup kept since, through the wake that restored
from it): equal, the allocation is unmapped without a copy; different, it is copied
as before. On by default: VLLM_CUMEM_SKIP_UNCHANGED=0 turns it off.

The first sleep of an engine has no backup to compare with. With the skip on, the
worker starts a background fill once it is warm (BackgroundFill, below): the backups
of the offloaded allocations are made while the engine serves, each with the
checksum a sleep would have taken, so that the first sleep finds them unchanged.
VLLM_CUMEM_BACKGROUND_FILL=0 turns the fill off (the first sleep then copies all).

The checksum
------------
An allocation's bytes are read as little-endian 32-bit words, zero padded to a whole
number of blocks of B words (B = BLOCK, a power of two; a trailing partial word is
padded with zero bytes): block b holds m_{b,0} .. m_{b,B-1}. Buffers of different
lengths are never compared (an allocation's length is fixed), and for one length the
padding is one to one: two buffers of the same length differ iff some block differs.

Keys, drawn from os.urandom in each process, all independent: for each of the two
hashes, K1[0..B) uniform 32-bit words (the random bits as they come), and for every
block index b used so far four keys K2[b][0..4) uniform in F_p, p = 2^32 - 5 (the
largest prime below 2^32; 32 random bits, the 5 values >= p drawn again: exactly
uniform). The K2 table grows, with fresh draws, to the largest allocation's number of
blocks (on the device, 32 bytes of keys per block index).

Inner layer, NH (Black, Halevi, Krawczyk, Krovetz, Rogaway, "UMAC: Fast and secure
message authentication", CRYPTO 1999), one 64-bit value per block:

    N_b = sum_{i < B/2} ((m_{b,2i} + K1[2i]) mod 2^32) * ((m_{b,2i+1} + K1[2i+1]) mod 2^32)
          mod 2^64.

The UMAC paper proves NH 2^-32-almost-universal on inputs of equal length: for any
fixed blocks X != X' of B words, Pr over K1 [NH(X) = NH(X')] <= 2^-32.

Outer layer: N_b is cut into 16-bit pieces, N_b = sum_{k<4} n_{b,k} 2^(16k), each
n < 2^16 < p (so the map from N_b to (n_{b,0..3}) in F_p^4 is one to one), and

    h = sum_b sum_{k<4} n_{b,k} * K2[b][k]  mod p.

Why a change is missed with probability < 2^-61.99. Take two byte strings M != M' of
the same length, fixed independently of the keys (the keys are secret to the
process, and nothing that writes GPU memory reads them); some block b0 differs. Let E be the event that N_b = N'_b for every b. E implies
N_b0 = N'_b0, so Pr[E] <= 2^-32 (NH, over K1). Outside E some N_b1 != N'_b1, so some
piece differs: d = n_{b1,k1} - n'_{b1,k1} is nonzero mod p (|d| < 2^16 < p). Fix K1
and every K2 key except K2[b1][k1] (independent of them, uniform): h(M) - h(M') =
d * K2[b1][k1] + c (mod p) is zero for exactly one of the p values, probability 1/p.
So Pr[h(M) = h(M')] <= Pr[E] + Pr[not E and equal] <= 2^-32 + 1/p. The two hashes
use independent keys, so both miss with probability <= (2^-32 + 1/p)^2
= 2^-62 * (1 + about 1.2e-9) < 2^-61.99 <= 2^-60: for any change of any byte, any
permutation of words, any change that keeps a sum. The bound is per allocation and
per sleep; n comparisons miss one at most n times as often (union bound).

Arithmetic: the 32-bit additions wrap, the products are < 2^64, and a block's sum is
taken mod 2^64 (Triton's uint64 wraps; the pure-torch reference uses int64, whose
two's-complement wrap gives the same bits). Four pieces times keys are < 2^50,
reduced mod p per block (< 2^32); the block values are summed per allocation in
int64 (exact up to 2^31 blocks) and reduced. The Triton kernel and the pure-torch
reference compute the same function bit for bit.

The kernels read each byte once (on an H200, 2026-11-29, bench/checksum_bench.py: the
whole call over 12 GiB in 3.2 ms, 4.0 TB/s, 0.93 of a device-to-device copy's traffic;
3.9-4.2 ms over 12 GiB in 28 MiB spans as a sleep makes the call, with the keys' device
copies and torch's cache gone). The whole blocks of
every allocation of the sleep go to one launch (one descriptor per block: address,
block index) of a few programs per SM; each holds both K1 tables in registers as
64-bit pairs (m_{2i} | m_{2i+1} << 32) and takes every num_programs-th block, its data
read in 16-byte copies with the next blocks' copies in flight (Triton's pipelined
loop) while it sums one: a 32x32->64 multiply-add per pair, one reduction per block,
then the outer layer. An allocation's partial last block, where there is one (never
for a cumem allocation: its length is a multiple of the 2 MiB granularity), goes to a
second launch, one program each. The per-allocation sums are a cumsum over the whole
blocks' values, one 1-D scan per hash, plus the partial block's value.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
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
HASHES = 2
PIECES = 4  # 16-bit pieces of a block's 64-bit NH value: four K2 keys per block
# The launch shape; bench/checksum_bench.py sweeps them (block size changes the
# function, not its strength: keys are per instance). Its two sweeps over 12 GiB on an
# H200 (2026-11-29): 4096 words, 4 warps and 3 blocks in flight the fastest; 4, 8 and
# 16 programs per SM within the runs' noise of each other (the kernel alone 4.27-4.38
# TB/s), 8 the fastest in the first. Not measured on an SM12x card: there the shape
# was only built (3 blocks in flight fit its 99 KiB of shared memory a block).
BLOCK = 4096  # 32-bit words per block (16 KiB): the length of K1
NUM_WARPS = 4
PER_SM = 8  # programs per SM for the whole blocks
STAGES = 3  # whole blocks in flight per program
MASK32 = 0xFFFFFFFF


def _env(name: str, default: str) -> str:
    try:  # registered in vllm/envs.py; read through it where vLLM is importable
        from vllm import envs

        return str(getattr(envs, name))
    except (ImportError, AttributeError):
        return os.getenv(name, default)


def enabled() -> bool:
    # On unless turned off. The kernel is fast enough to pay (12 GiB in 3.2-4.2 ms on an
    # H200, against 0.23 s to copy them to the host), and a weight changed in place
    # between wake and sleep reached the next wake's tokens in both lanes' engines at
    # TP=1 and in 0.21.0's at TP=2. The backup pool holds the offloaded bytes pinned
    # from the load to the exit, so a backup kept through the wake costs no host memory.
    return _env("VLLM_CUMEM_SKIP_UNCHANGED", "1").strip().lower() not in (
        "0", "false", "off", "")


def uniform_keys(n: int) -> torch.Tensor:
    """n keys uniform in [0, p), from os.urandom: 32 random bits, the values >= p
    drawn again."""
    keys = torch.empty(0, dtype=torch.int64)
    while keys.numel() < n:
        raw = random_words(n)
        keys = torch.cat([keys, raw[raw < P]])
    return keys[:n]


def random_words(n: int) -> torch.Tensor:
    """n uniform 32-bit words from os.urandom, as int64 in [0, 2^32)."""
    raw = torch.frombuffer(bytearray(os.urandom(4 * n)), dtype=torch.int32)
    return raw.to(torch.int64) & MASK32


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
        """A K2 key stored as the 32-bit pattern of an int32, zero-extended."""
        return stored.to(tl.uint32, bitcast=True).to(tl.int64)

    @triton.jit
    def _whole(addr, i, PAIRS: tl.constexpr):
        """A whole block's words as uint64 pairs m_2i | m_2i+1 << 32, read once
        (the evict-first hint) in 16 bytes at a time: in the pipelined loop, 16-byte
        asynchronous copies through shared memory."""
        pairs = tl.multiple_of(addr.to(tl.pointer_type(tl.uint64)), 16)
        return tl.load(pairs + i, eviction_policy="evict_first")

    @triton.jit
    def _partial(addr, nb, i, PAIRS: tl.constexpr):
        """An allocation's last block, nb < 8 * PAIRS bytes, as pairs zero padded:
        the bytes after the last whole pair are read one by one."""
        pairs = tl.multiple_of(addr.to(tl.pointer_type(tl.uint64)), 16)
        full = nb // 8
        x = tl.load(pairs + i, mask=i < full, other=0)
        j = tl.arange(0, 8)
        tail = tl.load(addr.to(tl.pointer_type(tl.uint8)) + full * 8 + j,
                       mask=j < nb - full * 8, other=0)
        word = tl.sum(tail.to(tl.uint64) << (8 * j).to(tl.uint64), axis=0)
        return tl.where(i == full, word, x)

    @triton.jit
    def _nh(x, k):
        """NH of one block: sum of (lo + k_lo mod 2^32) * (hi + k_hi mod 2^32) over
        the pairs, mod 2^64 (a 32x32->64 multiply-add per pair)."""
        a = x.to(tl.uint32) + k.to(tl.uint32)
        b = (x >> 32).to(tl.uint32) + (k >> 32).to(tl.uint32)
        return tl.sum(a.to(tl.uint64) * b.to(tl.uint64), axis=0)

    @triton.jit
    def _outer(nh, keys, P: tl.constexpr):
        """sum_k (16-bit piece k of nh) * K2[b][k] mod p (keys: the block index's
        four K2 keys), every term < 2^48."""
        shifts = (16 * tl.arange(0, 4)).to(tl.uint64)
        pieces = ((nh >> shifts) & 0xFFFF).to(tl.int64)
        return tl.sum(pieces * keys, axis=0) % P

    # Not specialized on the counts' values (1, multiples of 16): the kernels built
    # at warm-up serve every sleep, with no build inside one.
    @triton.jit(do_not_specialize=["k2_len", "nblocks"])
    def _whole_values(addr_ptr, index_ptr, k1_ptr, k2_ptr, k2_len, out_ptr, nblocks,
                      P: tl.constexpr, PAIRS: tl.constexpr, STAGES: tl.constexpr):
        """out[h, 1 + t] = the outer layer of whole block t's NH value for hash h
        (rows of nblocks + 1: the scan that follows needs a zero before them). A few
        programs per SM, each taking every num_programs-th block with K1 loaded once
        into registers (a program of 4 blocks, as before, re-read 32 KiB of keys for
        every 64 KiB of data), the next blocks' loads issued while one is summed
        (STAGES)."""
        i = tl.arange(0, PAIRS)
        ka = tl.load(k1_ptr + i).to(tl.uint64, bitcast=True)
        kb = tl.load(k1_ptr + PAIRS + i).to(tl.uint64, bitcast=True)
        q = tl.arange(0, 4)  # PIECES
        for t in tl.range(tl.program_id(0), nblocks, tl.num_programs(0),
                          num_stages=STAGES):
            row = k2_ptr + 4 * tl.load(index_ptr + t).to(tl.int64) + q
            k2a = _key(tl.load(row))
            k2b = _key(tl.load(row + 4 * k2_len))
            x = _whole(tl.load(addr_ptr + t), i, PAIRS)
            tl.store(out_ptr + 1 + t, _outer(_nh(x, ka), k2a, P))
            tl.store(out_ptr + nblocks + 2 + t, _outer(_nh(x, kb), k2b, P))

    @triton.jit(do_not_specialize=["k2_len", "nblocks"])
    def _partial_values(addr_ptr, nbytes_ptr, index_ptr, k1_ptr, k2_ptr, k2_len,
                        out_ptr, nblocks, P: tl.constexpr, PAIRS: tl.constexpr):
        """The same for partial blocks, one program each: an allocation's last block
        when its length is not a whole number of blocks (never a cumem allocation,
        whose length is a multiple of the 2 MiB granularity)."""
        i = tl.arange(0, PAIRS)
        t = tl.program_id(0)
        row = k2_ptr + 4 * tl.load(index_ptr + t).to(tl.int64) + tl.arange(0, 4)
        x = _partial(tl.load(addr_ptr + t), tl.load(nbytes_ptr + t), i, PAIRS)
        ka = tl.load(k1_ptr + i).to(tl.uint64, bitcast=True)
        kb = tl.load(k1_ptr + PAIRS + i).to(tl.uint64, bitcast=True)
        tl.store(out_ptr + t, _outer(_nh(x, ka), _key(tl.load(row)), P))
        tl.store(out_ptr + nblocks + t,
                 _outer(_nh(x, kb), _key(tl.load(row + 4 * k2_len)), P))


class Checksum:
    """Two keyed checksums of byte spans in device memory, keys of this process.
    ``block`` (32-bit words per block, a power of two >= 16), ``num_warps``,
    ``per_sm`` (programs per SM) and ``stages`` (blocks in flight per program) shape
    the kernels; ``block`` also picks the function, so sums are compared only between
    sums of one instance."""

    def __init__(self, block: int = BLOCK, num_warps: int = NUM_WARPS,
                 per_sm: int = PER_SM, stages: int = STAGES,
                 use_triton: bool | None = None) -> None:
        if block < 16 or block & (block - 1):
            raise ValueError(f"block must be a power of two >= 16, not {block}")
        self.block, self.num_warps = block, num_warps
        self.per_sm, self.stages = per_sm, stages
        self.k1 = random_words(HASHES * block).view(HASHES, block)
        self.k2 = uniform_keys(HASHES * 1024 * PIECES).view(HASHES, 1024, PIECES)
        self.use_triton = triton is not None if use_triton is None else use_triton
        self.view = device_view  # tests stand in for device memory here
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        # The keys as the kernels read them, on the host (pinned for a GPU): made once
        # (again when K2 grows), not at every sleep.
        self._on_host: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._layout: tuple[object, list[torch.Tensor]] = (None, [])

    def release(self) -> None:
        """Drop the keys' device copies: a sleeping process holds no GPU memory
        for them (uploaded again, without a synchronize, at the next sleep)."""
        self._on_device.clear()

    def _grow_k2(self, nblocks: int) -> None:
        have = self.k2.shape[1]
        if nblocks > have:
            more = max(nblocks, 2 * have) - have
            extra = uniform_keys(HASHES * more * PIECES).view(HASHES, more, PIECES)
            self.k2 = torch.cat([self.k2, extra], dim=1)
            self._on_device.clear()
            self._on_host.clear()

    def _keys_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """K1 as int64 pairs (word 2i in the low half: the data's layout), K2 as
        the int32 bits of each key."""
        if device.type not in self._on_host:
            self._on_host[device.type] = (_pinned(_pairs_of(self.k1), device),
                                          _pinned(_int32_bits(self.k2), device))
        if device not in self._on_device:
            self._on_device[device] = tuple(_upload(k, device)
                                            for k in self._on_host[device.type])
        return self._on_device[device]

    def sums(self, spans: Sequence[tuple[int, int]], device) -> torch.Tensor:
        """[len(spans), 2] int64 on ``device``: the checksums of the spans
        (address, bytes). Launched on the current stream; nothing waits for it."""
        device = torch.device(device)
        if not spans:
            return torch.zeros(0, HASHES, dtype=torch.int64, device=device)
        self._grow_k2(max(_blocks(n, 4 * self.block) for _, n in spans))
        aligned = all(addr % 16 == 0 for addr, _ in spans)
        if self.use_triton and aligned and (device.type == "cuda" or _interpreting()):
            return self._kernel_sums(spans, device)
        return torch.stack([self.reference(self.view(a, n, device)) for a, n in spans])

    def reference(self, data: torch.Tensor) -> torch.Tensor:
        """The checksums of one uint8 tensor in pure torch: [2] int64, same device."""
        data = data.reshape(-1)
        nblocks = _blocks(data.numel(), 4 * self.block)
        self._grow_k2(nblocks)
        k1 = self.k1.to(data.device)
        k2 = self.k2[:, :nblocks].to(data.device)
        total = torch.zeros(HASHES, dtype=torch.int64, device=data.device)
        step = max(1, (16 << 20) // (4 * self.block))  # blocks per chunk: 16 MiB
        for first in range(0, nblocks, step):
            chunk = data[first * 4 * self.block:(first + step) * 4 * self.block]
            words = _words(chunk, self.block)
            for h in range(HASHES):
                values = _outer_ref(_nh_ref(words, k1[h]), k2[h, first:first + len(words)])
                total[h] += values.sum()
        return total % P

    def lay_out(self, spans: Sequence[tuple[int, int]], device) -> list[torch.Tensor]:
        """The kernel's per-block descriptors of ``spans`` on the host (pinned on a
        GPU), built once and kept while the spans stay the same: the same
        allocations, sleep after sleep. An engine's weights are a few hundred thousand
        blocks (6 GiB: 393,216); the background fill builds them once it is done
        (SkipUnchanged.prepare), so that the first sleep does not."""
        device = torch.device(device)
        key = (tuple(spans), device)
        if self._layout[0] != key:
            host = _descriptors(spans, 4 * self.block)
            self._layout = (key, [_pinned(x, device) for x in host])
        return self._layout[1]

    def _kernel_sums(self, spans: Sequence[tuple[int, int]],
                     device: torch.device) -> torch.Tensor:
        (addrs, index, starts, ends, cut_addrs, cut_bytes, cut_index,
         cut_span) = (_upload(x, device) for x in self.lay_out(spans, device))
        whole = torch.empty(HASHES, addrs.numel() + 1, dtype=torch.int64, device=device)
        whole[:, 0] = 0
        self.whole_values(addrs, index, whole, device)
        # One scan per hash, in place, each over a contiguous row: torch scans a 1-D
        # tensor in parallel, but a [blocks, 2] tensor along dim 0 one row after
        # another (about 0.1 us a block on an H200: the whole checksum's time, whatever
        # the kernel). In place, because a sleep allocates what it uses anew: the
        # cache was emptied by the sleep before.
        for row in whole:
            row.cumsum_(0)
        sums = (whole[:, ends] - whole[:, starts]).t()
        if cut_addrs.numel():  # each span's partial last block, where it has one
            k1, k2 = self._keys_on(device)
            cut = torch.empty(HASHES, cut_addrs.numel(), dtype=torch.int64, device=device)
            _partial_values[(cut_addrs.numel(),)](cut_addrs, cut_bytes, cut_index, k1, k2,
                                                  k2.shape[1], cut, cut_addrs.numel(), P=P,
                                                  PAIRS=self.block // 2,
                                                  num_warps=self.num_warps)
            sums.index_add_(0, cut_span, cut.t())
        return sums % P

    def whole_values(self, addrs: torch.Tensor, index: torch.Tensor, out: torch.Tensor,
                     device: torch.device) -> None:
        """The whole blocks' launch (descriptors on ``device``) into ``out``, [2, blocks
        + 1]; bench/checksum_bench.py times it alone."""
        if not addrs.numel():
            return
        k1, k2 = self._keys_on(device)
        grid = (min(addrs.numel(), self.per_sm * _sms(device)),)
        _whole_values[grid](addrs, index, k1, k2, k2.shape[1], out, addrs.numel(), P=P,
                            PAIRS=self.block // 2, STAGES=self.stages,
                            num_warps=self.num_warps)


def _words(chunk: torch.Tensor, block: int) -> torch.Tensor:
    """The bytes as [blocks, block] little-endian 32-bit words in int64, zero
    padded to whole blocks."""
    n = -(-chunk.numel() // (4 * block))
    padded = torch.zeros(n * 4 * block, dtype=torch.uint8, device=chunk.device)
    padded[:chunk.numel()] = chunk
    words = padded.view(-1, 4).to(torch.int64)  # byte order spelled out, not the host's
    words = words[:, 0] | words[:, 1] << 8 | words[:, 2] << 16 | words[:, 3] << 24
    return words.view(n, block)


def _nh_ref(words: torch.Tensor, k1: torch.Tensor) -> torch.Tensor:
    """NH per block, mod 2^64 as int64 (the products and their sum wrap)."""
    x = (words + k1) & MASK32
    return (x[:, 0::2] * x[:, 1::2]).sum(-1)


def _outer_ref(nh: torch.Tensor, k2: torch.Tensor) -> torch.Tensor:
    """Per block: sum_k (16-bit piece k of nh) * K2[b][k] mod p."""
    shifts = torch.arange(PIECES, device=nh.device) * 16
    pieces = (nh.unsqueeze(-1) >> shifts) & 0xFFFF  # an arithmetic shift, then masked
    return (pieces * k2).sum(-1) % P


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _int32_bits(keys: torch.Tensor) -> torch.Tensor:
    """Keys < 2^32 stored as int32 with the same bits (the kernel zero-extends)."""
    return torch.where(keys >= 1 << 31, keys - (1 << 32), keys).to(torch.int32)


def _pairs_of(k1: torch.Tensor) -> torch.Tensor:
    """[hashes, block] 32-bit keys as [hashes, block/2] int64, key 2i in the low
    half: the same bytes, read 8 at a time (little-endian, as CUDA hosts are)."""
    assert sys.byteorder == "little"
    return _int32_bits(k1).contiguous().view(torch.int64)


def _blocks(nbytes: int, block_bytes: int) -> int:
    return max(1, -(-nbytes // block_bytes))


def _pinned(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host.pin_memory() if device.type == "cuda" else host


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """To ``device`` without a host synchronize (pinned, non-blocking)."""
    if device.type != "cuda":
        return host.to(device)
    return _pinned(host, device).to(device, non_blocking=True)


def _descriptors(spans: Sequence[tuple[int, int]], block_bytes: int):
    """The kernels' descriptors. Every whole block of every span, in the spans'
    order: its address and its index in its span, and where each span's run starts
    and ends (exclusive) in that list. Then each partial last block (a span whose
    length is not a whole number of blocks): its address, bytes, index in its span,
    and the span."""
    base = torch.tensor([a for a, _ in spans], dtype=torch.int64)
    size = torch.tensor([n for _, n in spans], dtype=torch.int64)
    counts = size // block_bytes
    ends = counts.cumsum(0)
    span = torch.repeat_interleave(torch.arange(len(spans)), counts)
    index = torch.arange(int(ends[-1])) - (ends - counts)[span]
    cut = torch.nonzero(size % block_bytes).flatten()
    return (base[span] + index * block_bytes, index.to(torch.int32), ends - counts, ends,
            base[cut] + counts[cut] * block_bytes, (size[cut] % block_bytes).to(torch.int32),
            counts[cut].to(torch.int32), cut)


_SMS: dict[torch.device, int] = {}


def _sms(device: torch.device) -> int:
    """The device's SM count (one where the kernels are interpreted on the CPU)."""
    if device.type != "cuda":
        return 1
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


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
        same: set[int] = set()
        self.pending.clear()
        for device, group in _by_device(allocations).items():
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

    def prepare(self, allocations: Iterable[tuple[int, object]]) -> None:
        """Lay out now the checksum that a sleep of ``allocations`` (address,
        AllocationData, in the order sleep() passes them) takes, so that the first
        sleep finds it laid out (Checksum.lay_out)."""
        for device, group in _by_device(allocations).items():
            self.checksum.lay_out([(p, d.handle[1]) for p, d in group], _device(device))

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


def _by_device(allocations: Iterable[tuple[int, object]]) -> dict[int, list[tuple[int, object]]]:
    by_device: dict[int, list[tuple[int, object]]] = {}
    for ptr, data in allocations:
        by_device.setdefault(data.handle[0], []).append((ptr, data))
    return by_device


def fill_enabled() -> bool:
    # On with the skip unless asked otherwise: the fill only runs where the skip is on.
    return _env("VLLM_CUMEM_BACKGROUND_FILL", "1").strip().lower() not in (
        "0", "false", "off")


# The fill copies FILL_CHUNK bytes (32 MiB: about 0.6 ms at 55 GB/s), then rests
# 1 / FILL_SHARE - 1 times as long: it holds the device-to-host link a quarter of the
# time, and never for more than one chunk at a time, so that serving's own copies
# (sampled tokens, logprobs) wait at most about one chunk behind it.
FILL_CHUNK = 32 << 20
FILL_SHARE = 0.25


class BackgroundFill:
    """The backups of the offloaded allocations, made before the engine's first sleep
    while it serves, each with the checksum that sleep would take, so that the first
    sleep finds them unchanged and copies nothing.

    One daemon thread takes the allocations one after another. For each, under the
    allocator's lock (the free callback takes it too, so no allocation is unmapped
    while it is read): the checksum of its bytes; its copy to the backup in FILL_CHUNK
    pieces on a stream of the thread's own (the lowest priority, and never the legacy
    default stream, so serving's kernels are not serialized behind it), waiting for
    each piece and resting after it (FILL_SHARE); then the checksum again. Equal, the
    backup holds those bytes (nothing wrote the allocation while it was copied) and the
    checksum is stored as a sleep's would be; different, the backup is dropped and the
    first sleep copies that allocation. sleep() calls stop() first: the fill ends after
    the piece in flight, and the sleep copies whatever it did not finish."""

    def __init__(self, skip: SkipUnchanged, lock: threading.Lock,
                 share: float | None = None, chunk: int | None = None) -> None:
        self.skip, self.lock = skip, lock
        # The pace as the module says it when the fill is made (not when this
        # module was imported).
        self.share = FILL_SHARE if share is None else share
        self.chunk = FILL_CHUNK if chunk is None else chunk
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.state = "not started"
        self.filled_bytes = 0
        self.dropped = 0  # allocations written while they were copied
        self.seconds = 0.0  # since start(): while it runs, so far
        self.started = 0.0

    def start(self, allocations: list[tuple[int, object]], fillable,
              backup_for) -> None:
        """Fill ``allocations`` (address, AllocationData) in turn. ``fillable(ptr,
        data)`` says, under the lock, whether one is still allocated, awake and without
        a backup; ``backup_for(data)`` gives it its host memory, as sleep() does."""
        self.state, self.started = "running", time.perf_counter()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       args=(allocations, fillable, backup_for),
                                       name="vllm-sm12x-backup-fill")
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join()

    def figures(self) -> dict:
        seconds = (time.perf_counter() - self.started if self.state == "running"
                   else self.seconds)
        return {"state": self.state, "filled_bytes": self.filled_bytes,
                "dropped": self.dropped, "seconds": seconds}

    def _run(self, allocations, fillable, backup_for) -> None:
        try:
            for ptr, data in allocations:
                if self.stopping.is_set():
                    break
                self._fill(ptr, data, fillable, backup_for)
            self.state = "stopped" if self.stopping.is_set() else "done"
        except Exception:  # noqa: BLE001  (the first sleep copies what is not filled)
            self.state = "failed"
            logger.warning("cumem background fill failed; the first sleep copies "
                           "what it did not fill", exc_info=True)
        self.seconds = time.perf_counter() - self.started
        if self.state == "done":
            self._prepare_first_sleep(allocations)

    def _prepare_first_sleep(self, allocations) -> None:
        """The first sleep's checksum laid out, under the lock, for the allocations
        the fill took, in their order: the sleep asks for the same layout while the
        engine holds the same allocations (else it lays out its own)."""
        try:
            with self.lock:
                self.skip.prepare(allocations)
        except Exception:  # noqa: BLE001  (the sleep lays it out itself)
            logger.warning("cumem background fill: could not lay out the first "
                           "sleep's checksum", exc_info=True)

    def _fill(self, ptr: int, data, fillable, backup_for) -> None:
        device, nbytes = data.handle[0], data.handle[1]
        with _fill_stream(device) as wait, self.lock:
            if not fillable(ptr, data):
                return
            backup = backup_for(data)
            before = self._sum(ptr, nbytes, device)
        for off in range(0, nbytes, self.chunk):
            n = min(self.chunk, nbytes - off)
            with _fill_stream(device) as wait, self.lock:
                if self.stopping.is_set() or not fillable(ptr, data):
                    return
                copy_start = time.perf_counter()
                source = self.skip.checksum.view(ptr, nbytes, _device(device))
                backup[off:off + n].copy_(source[off:off + n], non_blocking=True)
                wait()
                spent = time.perf_counter() - copy_start
            time.sleep(spent * (1.0 / self.share - 1.0))
        with _fill_stream(device) as wait, self.lock:
            if not fillable(ptr, data):
                return
            after = self._sum(ptr, nbytes, device)
            if after != before:
                self.dropped += 1
                return
            data.cpu_backup_tensor = backup
            self.skip.stored[ptr] = (data, after)
            self.filled_bytes += nbytes

    def _sum(self, ptr: int, nbytes: int, device: int) -> tuple[int, ...]:
        """One allocation's checksum, read back (the fill stream waits for it)."""
        return tuple(self.skip.checksum.sums([(ptr, nbytes)], _device(device))[0].tolist())


@contextlib.contextmanager
def _fill_stream(index: int):
    """The fill's own stream on device ``index`` (a new stream: the lowest
    priority), current in this thread, and a function that waits for it."""
    if not torch.cuda.is_available():
        yield lambda: None
        return
    torch.cuda.set_device(index)
    if index not in _FILL_STREAMS:
        _FILL_STREAMS[index] = torch.cuda.Stream(index)
    stream = _FILL_STREAMS[index]
    with torch.cuda.stream(stream):
        yield stream.synchronize


_FILL_STREAMS: dict[int, object] = {}

def _device(index: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", index)
    return torch.device("cpu")


def _default_stream(index: int):
    """The legacy default stream, on which cudaMemcpy runs: ordered after it."""
    if not torch.cuda.is_available():
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.default_stream(index))
