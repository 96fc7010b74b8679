"""The keyed checksum that lets sleep() skip unchanged allocations (cumem-skip-unchanged).

The module is loaded by path from its source in this repository
(patches/fixes/cumem-skip-unchanged/new/, which both lanes' patches carry; tests/
test_generated.py keeps them in step). Its pure-torch reference is checked against the
formula computed with Python integers, then against the changes a checksum must see
(any bit, swapped elements, changes that keep a sum); the Triton kernel runs in Triton's
CPU interpreter (TRITON_INTERPRET=1) and must give the reference's sums bit for bit, and it
is built for sm_90a and sm_120a (no GPU needed) to check its loads, registers and shared
memory.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import needs
import pytest

torch = needs.module("torch")
if not torch.cuda.is_available() and "triton" not in sys.modules:
    # Triton decides at import whether to interpret: before its first import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

SOURCE = (Path(__file__).resolve().parents[1]
          / "patches/fixes/cumem-skip-unchanged/new/vllm/device_allocator/cumem_checksum.py")
# Sizes that are odd, shorter than a word or a pair, shorter than a block (16 KiB), one
# byte either side of a block, several blocks.
SIZES = [1, 2, 3, 4, 5, 7, 8, 9, 101, 4095, 8193, 16383, 16384, 16385, 3 * 16384 + 7]
# Blocks of 16 and 64 words (64 and 256 bytes): many blocks and partial blocks in little
# data, for the interpreter and the Python formula.
SMALL = [1, 3, 4, 63, 64, 65, 255, 257, 4095, 8193]


def load(name: str = "_cumem_checksum_under_test"):
    spec = importlib.util.spec_from_file_location(name, SOURCE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ck():
    return load()


@pytest.fixture(scope="module")
def checksum(ck):
    return ck.Checksum(use_triton=False)


def rand_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.tensor(list(random.Random(seed).randbytes(n)), dtype=torch.uint8)


def python_checksum(ck, checksum, data: bytes) -> list[int]:
    """The docstring's formula with Python integers: per block NH over little-endian
    32-bit words (zero padded) mod 2^64, cut in 16-bit pieces times K2 mod p, twice."""
    block = checksum.block
    data = data + bytes(-len(data) % (4 * block))
    words = [int.from_bytes(data[i:i + 4], "little") for i in range(0, len(data), 4)]
    out = []
    for h in range(ck.HASHES):
        k1, k2 = checksum.k1[h].tolist(), checksum.k2[h].tolist()
        total = 0
        for b in range(len(words) // block):
            m = words[b * block:(b + 1) * block]
            nh = sum(((m[2 * i] + k1[2 * i]) % 2**32) * ((m[2 * i + 1] + k1[2 * i + 1]) % 2**32)
                     for i in range(block // 2)) % 2**64
            total += sum(((nh >> (16 * k)) & 0xFFFF) * k2[b][k] for k in range(4)) % ck.P
        out.append(total % ck.P)
    return out


def sums(checksum, data: torch.Tensor) -> tuple[int, int]:
    return tuple(checksum.reference(data).tolist())


def test_p_is_prime_and_two_checksums_miss_below_2_to_the_61_99(ck):
    p = ck.P
    assert pow(2, p - 1, p) == 1 and all(p % d for d in range(3, 1 << 16, 2))  # no factor <= sqrt(p)
    assert p > 1 << 16  # a 16-bit piece is nonzero mod p when nonzero
    miss = (Fraction(1, 2**32) + Fraction(1, p)) ** 2  # the docstring's bound, exactly
    assert miss < Fraction(1, 2**60) and math.log2(miss) < -61.99
    assert 4 * (2**16 - 1) * (p - 1) < 2**63  # the outer layer of a block fits in int64
    assert 2**31 * (p - 1) < 2**63  # so do 2^31 block values summed


@pytest.mark.parametrize(("words", "w"), [(2, 4), (4, 2)])
def test_nh_collides_for_at_most_2_to_the_minus_w_of_the_keys(words, w):
    """The UMAC paper's theorem the docstring rests on, checked exhaustively at a small
    word size w (every pair of distinct messages of ``words`` w-bit words, every key):
    NH(M) = NH(M') for at most 2^-w of the keys."""
    size = 1 << w
    grid = torch.cartesian_prod(*[torch.arange(size)] * words)  # every message, every key
    x = (grid.unsqueeze(1) + grid.unsqueeze(0)) % size  # [message, key, word]
    nh = (x[..., 0::2] * x[..., 1::2]).sum(-1) % (size * size)  # [message, key]
    same = (nh.unsqueeze(0) == nh.unsqueeze(1)).sum(-1)  # keys on which two messages collide
    same.fill_diagonal_(0)
    assert int(same.max()) == grid.shape[0] // size  # the bound, reached


def test_block_must_be_a_power_of_two_of_at_least_16_words(ck):
    for bad in (8, 24, 1000):
        with pytest.raises(ValueError, match="power of two"):
            ck.Checksum(block=bad, use_triton=False)
    assert ck.Checksum(block=16, use_triton=False).k1.shape == (ck.HASHES, 16)


@pytest.mark.parametrize("n", SIZES)
def test_reference_is_the_formula(ck, checksum, n):
    data = rand_bytes(n, n)
    assert list(sums(checksum, data)) == python_checksum(ck, checksum, bytes(data.tolist()))


@pytest.mark.parametrize("block", [16, 64])
def test_reference_is_the_formula_over_many_blocks(ck, block):
    checksum = ck.Checksum(block=block, use_triton=False)
    for n in SMALL:
        data = rand_bytes(n, n)
        assert list(sums(checksum, data)) == python_checksum(ck, checksum, bytes(data.tolist())), n
    ones = torch.full((4 * block * 3,), 0xFF, dtype=torch.uint8)  # products near 2^64: wraps
    assert list(sums(checksum, ones)) == python_checksum(ck, checksum, bytes(ones.tolist()))


def test_keys_are_uniform_below_p_and_fresh_per_process(ck):
    keys = ck.uniform_keys(100_000)
    assert int(keys.min()) >= 0 and int(keys.max()) < ck.P
    assert int(keys.max()) > (1 << 31)  # the whole range, not 31 bits
    words = ck.random_words(100_000)  # K1: any 32-bit word
    assert int(words.min()) >= 0 and int(words.max()) < 1 << 32 and int(words.max()) > (1 << 31)
    other = ck.Checksum(use_triton=False)
    data = rand_bytes(8193, 1)
    # another process draws other keys: other sums for the same bytes
    assert sums(other, data) != sums(ck.Checksum(use_triton=False), data)


@pytest.mark.parametrize("n", SIZES)
def test_identical_bytes_give_identical_sums(checksum, n):
    data = rand_bytes(n, 7)
    copy = data.clone()
    assert copy.data_ptr() != data.data_ptr()
    assert sums(checksum, data) == sums(checksum, copy)


@pytest.mark.parametrize("n", [1, 3, 8193, 3 * 8192 + 7])
def test_every_single_bit_flip_changes_the_sums(checksum, n):
    data = rand_bytes(n, n)
    before = sums(checksum, data)
    rng = random.Random(n)
    # every bit of the first and last bytes, and 200 random bits elsewhere
    positions = {0, n - 1} | {rng.randrange(n) for _ in range(200)}
    for pos in sorted(positions):
        for bit in range(8):
            data[pos] ^= 1 << bit
            assert sums(checksum, data) != before, (pos, bit)
            data[pos] ^= 1 << bit
    assert sums(checksum, data) == before


@pytest.mark.parametrize("width", [1, 2, 4])
def test_swapping_two_elements_changes_the_sums(checksum, width):
    data = rand_bytes(3 * 8192 + 7, width)
    before = sums(checksum, data)
    rng = random.Random(width)
    elems = data[: (data.numel() // width) * width].view(-1, width)
    for _ in range(100):
        i, j = rng.sample(range(elems.shape[0]), 2)
        if torch.equal(elems[i], elems[j]):
            continue
        a, b = elems[i].clone(), elems[j].clone()
        elems[i], elems[j] = b, a
        assert sums(checksum, data) != before, (i, j)
        elems[i], elems[j] = a, b
    assert sums(checksum, data) == before


def test_swapping_the_two_words_of_a_pair_changes_the_sums(checksum):
    """NH multiplies the two words of a pair: swapped, their product alone is the same,
    and only the keys added before the product tell them apart."""
    data = rand_bytes(3 * 8192 + 7, 5)
    before = sums(checksum, data)
    pairs = data[: data.numel() // 8 * 8].view(-1, 2, 4)
    for i in random.Random(5).sample(range(pairs.shape[0]), 100):
        if torch.equal(pairs[i, 0], pairs[i, 1]):
            continue
        pairs[i] = pairs[i].flip(0)
        assert sums(checksum, data) != before, i
        pairs[i] = pairs[i].flip(0)
    assert sums(checksum, data) == before


def test_changes_that_keep_a_sum_change_the_sums(checksum):
    """+d at one word and -d at another (the words' sum, and a float sum, unchanged);
    +d, -2d, +d at three (also the first moment, for equally spaced words)."""
    data = rand_bytes(4 * 8192, 3)
    words = data.view(torch.int16)
    before = sums(checksum, data)
    rng = random.Random(3)
    for _ in range(100):
        i, j, k = sorted(rng.sample(range(1, words.numel() - 1), 3))
        saved = words.clone()
        words[i] += 5
        words[j] -= 5
        assert sums(checksum, data) != before
        words.copy_(saved)
        step = rng.randrange(1, 3)
        i = rng.randrange(words.numel() - 2 * step)
        words[i] += 3
        words[i + step] -= 6
        words[i + 2 * step] += 3
        assert sums(checksum, data) != before
        words.copy_(saved)
    assert sums(checksum, data) == before


def test_sums_of_spans_are_each_spans_reference(ck):
    checksum = ck.Checksum(use_triton=False)
    bufs = [rand_bytes(n, n) for n in SIZES]
    got = checksum.sums([(b.data_ptr(), b.numel()) for b in bufs], "cpu")
    assert got.tolist() == [checksum.reference(b).tolist() for b in bufs]


def needs_kernel():
    needs.module("triton")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        needs.missing("triton was imported before TRITON_INTERPRET=1 was set, and no GPU")


@pytest.mark.triton
def test_triton_kernel_gives_the_reference_sums(ck):
    """One launch for every span: the same sums as the reference, bit for bit, odd sizes
    and partial blocks and words included."""
    needs_kernel()
    checksum = ck.Checksum()
    assert checksum.use_triton
    bufs = [rand_bytes(n, n) for n in SIZES]
    bufs.append(torch.zeros(5, dtype=torch.uint8))
    got = checksum.sums([(b.data_ptr(), b.numel()) for b in bufs], "cpu")
    assert got.tolist() == [checksum.reference(b).tolist() for b in bufs]
    bufs[3][2] ^= 0x10  # a change is seen by the kernel too
    again = checksum.sums([(b.data_ptr(), b.numel()) for b in bufs], "cpu")
    assert [i for i in range(len(bufs)) if again[i].tolist() != got[i].tolist()] == [3]


@pytest.mark.triton
@pytest.mark.parametrize(("block", "per_sm"), [(16, 1), (16, 3), (64, 2)])
def test_triton_kernel_over_many_blocks_and_spans(ck, block, per_sm):
    """Small blocks: many blocks per span, programs of several blocks, a last program
    with fewer; every partial block and partial word the reference pads with zeros."""
    needs_kernel()
    checksum = ck.Checksum(block=block, per_sm=per_sm)
    bufs = [rand_bytes(n, n + block) for n in SMALL + [8 * block * 4 + 3]]
    got = checksum.sums([(b.data_ptr(), b.numel()) for b in bufs], "cpu")
    assert got.tolist() == [checksum.reference(b).tolist() for b in bufs]
    assert got.tolist() == [python_checksum(ck, checksum, bytes(b.tolist())) for b in bufs]


@pytest.mark.triton
def test_the_per_allocation_sums_scan_one_row_at_a_time(ck, monkeypatch):
    """torch scans a 1-D tensor in parallel but a [blocks, 2] one along dim 0 row after row:
    on an H200 that scan was the whole checksum's time (70.7 ms for 786,432 blocks, against
    0.072 ms for two 1-D scans; docs/records/checksum-cumsum-scan-h200-2026-11-27.txt)."""
    needs_kernel()
    checksum = ck.Checksum(block=16, per_sm=2)
    bufs = [rand_bytes(n, n + 7) for n in (5, 64 * 5 + 3, 64 * 9)]
    scanned = []
    for name in ("cumsum", "cumsum_"):
        def spy(self, *args, real=getattr(torch.Tensor, name), **kwargs):
            scanned.append(tuple(self.shape))
            return real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy)
    got = checksum.sums([(b.data_ptr(), b.numel()) for b in bufs], "cpu")
    assert scanned and all(len(shape) == 1 for shape in scanned), scanned
    monkeypatch.undo()
    assert got.tolist() == [checksum.reference(b).tolist() for b in bufs]


@pytest.mark.triton
def test_a_sleep_after_the_first_uploads_the_keys_without_making_them_again(ck, monkeypatch):
    """Every sleep uploads the keys anew (release() drops the device copies: a sleeping
    process holds no GPU memory), but their host form, pinned for a GPU, is made once:
    again only when K2 grows for a longer allocation."""
    needs_kernel()
    checksum = ck.Checksum(block=16, per_sm=2)
    made = []
    for name in ("_pairs_of", "_int32_bits"):
        monkeypatch.setattr(ck, name, lambda keys, real=getattr(ck, name), name=name:
                            made.append(name) or real(keys))
    buf = rand_bytes(64 * 3, 3)
    first = checksum.sums([(buf.data_ptr(), buf.numel())], "cpu")
    once = list(made)
    assert set(once) == {"_pairs_of", "_int32_bits"}
    checksum.release()
    assert checksum.sums([(buf.data_ptr(), buf.numel())], "cpu").tolist() == first.tolist()
    assert made == once
    longer = rand_bytes(64 * 2000, 4)  # 2000 blocks: more K2 keys than the first 1024
    checksum.sums([(longer.data_ptr(), longer.numel())], "cpu")
    assert made == once * 2


BUILD = """
import importlib.util, json, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = importlib.util.spec_from_file_location("cumem_checksum", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
out, capability = Path(sys.argv[2]), int(sys.argv[3])
common = {"k1_ptr": "*i64", "k2_ptr": "*i32", "k2_len": "i32", "out_ptr": "*i64",
          "nblocks": "i32", "P": "constexpr", "PAIRS": "constexpr"}
kernels = {
    "whole": (mod._whole_values, {"addr_ptr": "*i64", "index_ptr": "*i32", **common,
                                  "STAGES": "constexpr"}, {"STAGES": mod.STAGES}),
    "partial": (mod._partial_values, {"addr_ptr": "*i64", "nbytes_ptr": "*i32",
                                      "index_ptr": "*i32", **common}, {}),
}
shared = {}
for name, (fn, signature, extra) in kernels.items():
    aligned = {(list(signature).index(n),): [["tt.divisibility", 16]]
               for n in signature if n.endswith("_ptr")}
    source = ASTSource(fn=fn, signature=signature, attrs=aligned,
                       constexprs={"P": mod.P, "PAIRS": mod.BLOCK // 2, **extra})
    built = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                           options={"num_warps": mod.NUM_WARPS})
    (out / f"{name}.ptx").write_text(built.asm["ptx"])
    (out / f"{name}.cubin").write_bytes(built.asm["cubin"])
    shared[name] = built.metadata.shared
    (out / f"{name}.unspecialized").write_text(
        " ".join(p.name for p in fn.params if p.do_not_specialize))
(out / "shared.json").write_text(json.dumps(shared))
"""

# SM12x gives a block at most 99 KiB of shared memory (compute capability 12.x; the
# sparse-MLA kernels hold to the same SM120_MAX_SHARED_BYTES).
SM12X_SHARED = 99 * 1024


@pytest.mark.triton
@pytest.mark.parametrize("capability", [90, 120])
def test_the_kernels_build_with_16_byte_loads_no_spills_and_sm12x_shared_memory(tmp_path, capability):
    """Built for sm_90a and sm_120a without a GPU (Triton's own ptxas, in a process of its
    own: this one interprets), at the module's launch shape. A whole block's data is read
    with 16-byte copies (the addresses come from descriptors: only the alignment hint
    tells the compiler they are 16-byte aligned), into the shared memory that holds the
    blocks in flight (STAGES); no thread spills to local memory; the shared memory fits
    an SM12x block. The block counts are not specialized on: the kernels built at
    warm-up (one block) serve every sleep, with no build inside one."""
    triton = needs.module("triton")
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    if not cuobjdump.is_file():
        needs.missing("Triton's cuobjdump")
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # a kernel to compile, not to interpret
    subprocess.run([sys.executable, "-c", BUILD, str(SOURCE), str(tmp_path), str(capability)],
                   env=env, check=True)
    whole = (tmp_path / "whole.ptx").read_text()
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 0x10", whole) or \
        "ld.global.L1::evict_first.L2::cache_hint.v2.b64" in whole, "no 16-byte data loads"
    shared = json.loads((tmp_path / "shared.json").read_text())
    assert 0 < shared["whole"] <= SM12X_SHARED, shared
    for name in ("whole", "partial"):
        usage = subprocess.run([str(cuobjdump), "-res-usage", str(tmp_path / f"{name}.cubin")],
                               capture_output=True, text=True, check=True).stdout
        assert re.search(r"REG:\d+ STACK:0 SHARED:\d+ LOCAL:0 ", usage), usage
        assert (tmp_path / f"{name}.unspecialized").read_text() == "k2_len nblocks"


def test_unaligned_spans_use_the_reference(ck, monkeypatch):
    checksum = ck.Checksum(use_triton=True)
    monkeypatch.setattr(checksum, "_kernel_sums", lambda *a: pytest.fail("kernel on an unaligned span"))
    buf = rand_bytes(100, 1)
    got = checksum.sums([(buf.data_ptr() + 1, 99)], "cpu")
    assert got.tolist() == [checksum.reference(buf[1:]).tolist()]


def test_the_switch(ck, monkeypatch):
    monkeypatch.delenv("VLLM_CUMEM_SKIP_UNCHANGED", raising=False)
    assert ck.SkipUnchanged.from_env() is not None  # on unless turned off
    for off in ("0", "false", "off"):
        monkeypatch.setenv("VLLM_CUMEM_SKIP_UNCHANGED", off)
        assert ck.SkipUnchanged.from_env() is None
    monkeypatch.setenv("VLLM_CUMEM_SKIP_UNCHANGED", "1")
    assert ck.SkipUnchanged.from_env() is not None


class Allocation:
    """What SkipUnchanged reads of cumem's AllocationData: the handle."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.handle = (0, buf.numel(), buf.data_ptr(), 0)


def test_a_failing_kernel_falls_back_to_the_reference_then_to_copying(ck, monkeypatch):
    skip = ck.SkipUnchanged(ck.Checksum(use_triton=True))
    bufs = [rand_bytes(n, n) for n in (64, 8193)]
    allocs = [(b.data_ptr(), Allocation(b)) for b in bufs]
    skip.unchanged(allocs)
    skip.commit()
    monkeypatch.setattr(skip.checksum, "_kernel_sums", lambda *a: 1 / 0)
    assert skip.unchanged(allocs) == {p for p, _ in allocs}  # the reference: same sums
    assert skip.checksum.use_triton is False
    monkeypatch.setattr(skip.checksum, "reference", lambda data: 1 / 0)
    assert skip.unchanged(allocs) == set()  # no checksum at all: copy everything,
    assert skip.stored == {} and skip.pending == {}  # and trust no sum of them later


def test_the_series_table_names_a_fix_of_our_own_without_a_link():
    """Origin: none (no upstream counterpart) is shown as it is, not as a link."""
    from sm12x_bundle.checks.report import _origin_cell

    assert _origin_cell("none") == "none"
    assert _origin_cell("https://github.com/vllm-project/vllm/pull/43020") == (
        "[#43020](https://github.com/vllm-project/vllm/pull/43020)")


def test_no_key_copies_stay_on_the_device_after_a_sleeps_checksums(ck):
    """The sleep empties the cache after its checksums: the keys' device copies must be
    gone by then, or a sleeping process would keep them (uploaded again next sleep)."""
    skip = ck.SkipUnchanged(ck.Checksum(use_triton=True))
    buf = rand_bytes(8193, 2)
    skip.unchanged([(buf.data_ptr(), Allocation(buf))])
    assert skip.checksum._on_device == {}
    assert skip.pending  # the sums were taken (by the kernel, in the interpreter)
