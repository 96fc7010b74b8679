# SPDX-License-Identifier: Apache-2.0
# sm12x-bundle patch 0006: sleep and wake_up across the ranks of one engine,
# all ranks or none.
"""Sleep and wake_up as one transaction across the ranks of an engine.

With tensor or pipeline parallelism, ``Executor.sleep`` and ``wake_up`` are
``collective_rpc`` calls: every rank sleeps or wakes its own ``CuMemAllocator``
and the executor waits for their replies. Each rank's call is all or nothing on
its own (the lane's 0002), but nothing made the ranks agree: the rank that
failed rolled back, the others stayed in the new state (some ranks asleep, some
awake), and the next collective hung or touched unmapped memory.

Here each rank does its part and keeps what it needs to undo it: a sleep backs
up and copies its allocations but unmaps nothing; a wake maps and copies back
but keeps its backups (the allocator's ``prepare_sleep`` / ``prepare_wake_up``).
Then the ranks agree over the engine's CPU (gloo) groups. If every rank's part
succeeded, every rank commits (unmaps; releases its backups). Otherwise every
rank undoes its part (releases its backups; unmaps what it mapped), so the
engine is as it was before the call (awake, or asleep), and every rank raises
the same sentence, naming the rank(s) that failed and their error (which names
the allocation, its tag and size, and the CUDA or host error). A retry can then
succeed. A rank whose own part failed still takes part in the agreement, so no
rank is left waiting for it.

The agreement is two small collectives, each waited for at most the timeout
(``VLLM_SM12X_RANK_AGREEMENT_TIMEOUT``, seconds): an all_gather of each rank's
report (a few hundred bytes), then an all_reduce (MIN) of each rank's vote to
commit, which is 1 only for a rank that heard every report and every one said
its part succeeded. The second round closes a gap of the first: a rank that
arrives after another gave up waiting can still complete a collective with the
contribution the other sent before it gave up, and would commit alone; the rank
that gave up votes 0 in the second round, so the late one aborts too. A rank
commits only on a second round that returned 1, that is, only when every rank
voted to commit. What remains: a rank that stops for longer than the timeout
between the two rounds, or dies during the second, can leave the ranks split;
the survivors say so in their error ("restart the engine").

A rank that dies before the agreement: the others get a connection error or the
timeout, undo their part and raise; vLLM's executor then finds the dead worker
and fails the engine. With one rank (no tensor or pipeline parallelism) there
is nothing to agree on: the allocator's own sleep() and wake_up() run as they
are, at no extra cost.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
# After this rank has given up on one collective, it still runs the rest, so that
# the others get its vote; it waits for each only this long.
GRACE_S = 1.0
REPORT_BYTES = 512  # per rank: its rank, whether its part failed, and why
_HEAD = 5  # int32 rank + 1 (0: no report), then 1 ok / 2 failed


def timeout_s() -> float:
    """How long a rank waits for the others to agree (VLLM_SM12X_RANK_AGREEMENT_TIMEOUT,
    registered in vllm/envs.py; read here directly so that a bad value is a warning, not
    a failed sleep)."""
    raw = os.getenv("VLLM_SM12X_RANK_AGREEMENT_TIMEOUT", "")
    if not raw.strip():
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        logger.warning("VLLM_SM12X_RANK_AGREEMENT_TIMEOUT=%r is not a positive number of "
                       "seconds; using %g", raw, DEFAULT_TIMEOUT_S)
        return DEFAULT_TIMEOUT_S
    return value


class RankTransactionError(RuntimeError):
    """A sleep or wake_up that the ranks did not all commit. Every rank raises it
    with the same sentence when they heard each other."""


@dataclass(frozen=True)
class Operation:
    """Sleep or wake_up: the allocator's three steps, and what a rank is after an undo."""

    name: str
    prepare: str
    commit: str
    abort: str
    undone: str


SLEEP = Operation("sleep", "prepare_sleep", "commit_sleep", "abort_sleep",
                  "awake with its bytes, as before the call: sleep can be retried")
WAKE_UP = Operation("wake_up", "prepare_wake_up", "commit_wake_up", "abort_wake_up",
                    "asleep with its backups, as before the call: wake_up can be retried "
                    "once GPU memory is free")


@dataclass(frozen=True)
class Decision:
    """What the agreement decided, as this rank saw it."""

    commit: bool
    ranks: tuple[int, ...] = ()  # every rank whose report this rank received
    failures: tuple[tuple[int, str], ...] = ()  # (rank, what failed), from the reports
    lost: str | None = None  # round 1: this rank did not hear every rank (timeout, lost peer)
    unconfirmed: str | None = None  # round 2: this rank could not confirm the decision

    def sentence(self, op: Operation, rank: int, timeout: float) -> str:
        if self.lost:
            own = dict(self.failures).get(rank)
            own = f"; its own part failed: {own}" if own else ""
            return (f"{op.name}: rank {rank} did not hear from every rank within {timeout:g} s "
                    f"({self.lost}){own}; it undid its part and is {op.undone}, and so did every "
                    "rank that heard it; a rank that stopped answering leaves the engine unusable: "
                    "restart it")
        if self.failures:  # the failed ranks voted not to commit: no rank did
            failed = ", ".join(str(r) for r, _ in self.failures)
            causes = "; ".join(f"rank {r}: {why}" for r, why in self.failures)
            return (f"{op.name} failed on rank {failed} of ranks {_span(self.ranks)} ({causes}); every "
                    f"rank undid its part and is {op.undone}")
        if self.unconfirmed:
            return (f"{op.name}: rank {rank} could not confirm the decision with every rank within "
                    f"{timeout:g} s ({self.unconfirmed}); it undid its part and is {op.undone}, but "
                    "another rank may have committed: restart the engine")
        return (f"{op.name}: every rank's part succeeded, but a rank gave up waiting for the others "
                f"(the agreement's timeout, {timeout:g} s) before all had arrived; every rank undid "
                f"its part and is {op.undone}")


def _span(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


class Agreement:
    """The ranks of one engine agreeing over gloo process groups.

    ``groups`` are orthogonal groups that together span the engine's ranks (its
    tensor-, context- and pipeline-parallel CPU groups, those with more than one
    rank): a collective over each in turn reaches every rank.
    """

    def __init__(self, groups: Sequence, rank: int, timeout: float) -> None:
        self.groups = tuple(groups)
        self.rank = rank
        self.timeout = timeout

    def decide(self, failure: str | None) -> Decision:
        """Tell every rank whether this rank's part failed (``failure``: why), hear
        theirs, and decide together. Never raises: trouble is part of the decision."""
        reports, lost = self._gather(_encode(self.rank, failure))
        if reports is None:
            reports = [(self.rank, failure)]
        failures = tuple((r, why) for r, why in reports if why is not None)
        vote = lost is None and not failures
        confirmed, unconfirmed = self._confirm(vote, grace=lost is not None)
        ranks = tuple(sorted(r for r, _ in reports))
        if confirmed and unconfirmed is None:
            return Decision(True, ranks)
        return Decision(False, ranks, failures, lost, unconfirmed)

    def _wait(self, work, grace: bool) -> None:
        seconds = min(self.timeout, GRACE_S) if grace else self.timeout
        work.wait(timeout=timedelta(seconds=seconds))

    def _gather(self, mine: torch.Tensor) -> tuple[list[tuple[int, str | None]] | None, str | None]:
        """Round 1: every rank's report, over each group in turn. After a failed step
        the later steps still run (the others wait for them), padded to their size."""
        buf, trouble = mine, None
        for group in self.groups:
            parts = [torch.zeros_like(buf) for _ in range(dist.get_world_size(group))]
            try:
                self._wait(dist.all_gather(parts, buf, group=group, async_op=True), trouble is not None)
            except Exception as exc:  # noqa: BLE001  (a timeout or a lost peer: abort, never hang)
                trouble = trouble or _first_line(exc)
                parts = [buf] + [torch.zeros_like(buf) for _ in parts[1:]]
            buf = torch.cat(parts)
        if trouble is not None:
            return None, trouble
        return _decode(buf), None

    def _confirm(self, vote: bool, grace: bool) -> tuple[bool, str | None]:
        """Round 2: the MIN of every rank's vote to commit, over each group in turn."""
        flag, trouble = torch.tensor([1 if vote else 0], dtype=torch.int32), None
        for group in self.groups:
            try:
                work = dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group, async_op=True)
                self._wait(work, grace or trouble is not None)
            except Exception as exc:  # noqa: BLE001
                trouble = trouble or _first_line(exc)
                flag = torch.tensor([0], dtype=torch.int32)
        return bool(flag.item() == 1) and vote, trouble


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _encode(rank: int, failure: str | None) -> torch.Tensor:
    buf = torch.zeros(REPORT_BYTES, dtype=torch.uint8)
    buf[:4] = torch.tensor([rank + 1], dtype=torch.int32).view(torch.uint8)
    buf[4] = 1 if failure is None else 2
    if failure is not None:
        text = failure.encode("utf-8", errors="replace")[: REPORT_BYTES - _HEAD]
        buf[_HEAD:_HEAD + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return buf


def _decode(buf: torch.Tensor) -> list[tuple[int, str | None]]:
    reports = []
    for row in buf.view(-1, REPORT_BYTES):
        rank = int(row[:4].clone().view(torch.int32).item()) - 1
        if rank < 0:
            continue
        why = None
        if int(row[4]) != 1:
            why = bytes(row[_HEAD:].tolist()).rstrip(b"\0").decode("utf-8", errors="replace")
        reports.append((rank, why))
    return reports


def run_across_ranks(op: Operation, allocator, agreement: Agreement, *args) -> None:
    """Prepare this rank's part, agree with the other ranks, then commit or undo."""
    prepared, error = None, None
    try:
        prepared = getattr(allocator, op.prepare)(*args)
    except Exception as exc:  # noqa: BLE001  (this rank still takes part in the agreement)
        error = exc
    decision = agreement.decide(None if error is None else _first_line(error))
    if decision.commit:
        getattr(allocator, op.commit)(prepared)
        return
    if prepared is not None:
        getattr(allocator, op.abort)(prepared)
    raise RankTransactionError(
        "CuMemAllocator: " + decision.sentence(op, agreement.rank, agreement.timeout)) from error


def engine_agreement() -> Agreement | None:
    """The agreement of this worker's engine: its tensor-, context- and pipeline-parallel
    CPU groups of more than one rank. None with one rank, or outside an engine."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        from vllm.distributed import parallel_state as ps
    except ImportError:
        return None
    if not ps.model_parallel_is_initialized():
        return None
    groups = []
    for name in ("get_tp_group", "get_pcp_group", "get_pp_group"):
        try:
            coordinator = getattr(ps, name)()
        except (AttributeError, AssertionError):  # a release without that group
            continue
        if coordinator.world_size > 1:
            groups.append(coordinator.cpu_group)
    if not groups:
        return None
    if not all(isinstance(g, dist.ProcessGroup) for g in groups):
        logger.warning("sleep/wake_up across ranks: the engine's CPU groups are not torch "
                       "process groups; each rank sleeps and wakes on its own")
        return None
    return Agreement(groups, dist.get_rank(), timeout_s())


def sleep_across_ranks(allocator, offload_tags=None, agreement: Agreement | None = None) -> None:
    """``allocator.sleep(offload_tags)`` on every rank of the engine, or on none."""
    agreement = agreement or engine_agreement()
    if agreement is None or not hasattr(allocator, SLEEP.prepare):
        allocator.sleep(offload_tags=offload_tags)
        return
    run_across_ranks(SLEEP, allocator, agreement, offload_tags)


def wake_up_across_ranks(allocator, tags=None, agreement: Agreement | None = None) -> None:
    """``allocator.wake_up(tags)`` on every rank of the engine, or on none."""
    agreement = agreement or engine_agreement()
    if agreement is None or not hasattr(allocator, WAKE_UP.prepare):
        allocator.wake_up(tags)
        return
    run_across_ranks(WAKE_UP, allocator, agreement, tags)
