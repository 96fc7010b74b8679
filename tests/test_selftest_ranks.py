"""Scenario 13 (selftest/ranks.py) without a GPU: how many ranks and how big, when the
ranks count as all or nothing, the verdict from the ranks' documents, and the steps each
rank takes after a failed call (a stand-in rank that replays what the others said).

The GPU run is the lead's to make (docs/rank-transactions.md gives the commands)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sm12x_bundle.selftest import plan, ranks
from sm12x_bundle.selftest.plan import GiB, MiB
from sm12x_bundle.selftest.scenarios import RUNNERS


def test_registered_as_scenario_13_and_run_by_the_child():
    assert plan.BY_NAME["ranks"].number == 13 and plan.BY_NAME["ranks"].bug
    assert RUNNERS["ranks"] is ranks.ranks


@pytest.mark.parametrize("gpus,world", [(1, 4), (2, 2), (4, 4), (8, 8), (16, 8)])
def test_one_rank_per_gpu_or_four_on_one(gpus, world):
    assert ranks.plan_world(gpus) == world


def test_no_gpu_is_refused():
    with pytest.raises(ValueError):
        ranks.plan_world(0)


def test_sizes_fit_a_quarter_of_the_free_memory_in_granules():
    assert ranks.plan_each(79 * GiB, 4, 1) == 256 * MiB  # an H100: 4 x 5 x 256 MiB
    small = ranks.plan_each(3 * GiB, 4, 1)
    assert small % ranks.GRANULARITY == 0 and 4 * 5 * small <= 3 * GiB // 4
    assert ranks.plan_each(10 * MiB, 4, 1) == ranks.GRANULARITY  # never below one granule
    assert ranks.plan_each(20 * GiB, 4, 4) == 256 * MiB  # one rank per GPU


def state(rank, error=None, mapped=(True, True)):
    return {"rank": rank, "error": error, "mapped": list(mapped)}


def test_all_or_nothing_names_what_split_the_ranks():
    assert ranks.all_or_nothing([state(0), state(1)]) is None
    assert ranks.all_or_nothing([state(0, "x"), state(1, "x")]) is None
    asleep = (False, False)
    assert ranks.all_or_nothing([state(0, None, asleep), state(1, None, asleep)]) is None
    assert ranks.all_or_nothing([state(0, None, asleep), state(1, "oom")]) == "rank 1 raised, rank 0 did not"
    split = ranks.all_or_nothing([state(0, "x", asleep), state(1, "x")])
    assert split == "rank 0 asleep (none mapped); rank 1 awake (every allocation mapped)"
    partly = ranks.all_or_nothing([state(0, "x", (True, False)), state(1, "x", (True, False))])
    assert "rank 0 partly mapped" in partly


def doc(rank, **kw):
    return {"rank": rank, "failed_call": [], "split": None, "intact": True, "retry": [state(rank)],
            "wake": [state(rank)], **kw}


STEADY = {"rank": 0, "errors": [], "own_swap_s": [0.10, 0.11, 0.12], "across_swap_s": [0.11, 0.12, 0.13],
          "agreement_s": [0.0005, 0.0006, 0.0007], "intact": True}


def test_the_verdict():
    good = {"sleep": [doc(0), doc(1)], "wake": [doc(0), doc(1)], "steady": [STEADY, STEADY]}
    kind, reason = ranks.judge(good, 2)
    assert kind == "pass"
    assert "a sleep whose host memory ran out on the last rank failed on every rank" in reason
    assert "(1.1% of the own swap)" in reason  # 2 x 0.6 ms of 110 ms
    split = {**good, "wake": [doc(0, split="rank 1 raised, rank 0 did not")] * 2}
    assert ranks.judge(split, 2) == (
        "fail", ("a wake that met memory another process held on the last rank's GPU: the ranks split "
                 "(rank 1 raised, rank 0 did not)"))
    lost = {**good, "sleep": [doc(0), doc(1, intact=False)]}
    assert ranks.judge(lost, 2)[0] == "fail" and "did not restore every byte" in ranks.judge(lost, 2)[1]
    retried = {**good, "sleep": [doc(0), doc(1, retry=[state(1, "again")])]}
    assert ranks.judge(retried, 2)[0] == "fail"
    unreached = {**good, "sleep": [doc(0, unreached="no rank raised: the injected failure was not reached")] * 2}
    assert ranks.judge(unreached, 2) == (
        "error", "a sleep whose host memory ran out on the last rank: no rank raised: the injected failure was "
                 "not reached")
    crashed = {**good, "wake": [doc(0), {"rank": 1, "crash": "CommandError: exit code 134"}]}
    assert ranks.judge(crashed, 2) == ("error", "wake: rank 1 could not run: CommandError: exit code 134")


def test_steady_figures_are_medians_over_every_rank():
    f = ranks.figures({"steady": [STEADY, {**STEADY, "agreement_s": [0.0010, 0.0011, 0.0012]}]})
    assert f["own_swap_median_s"] == pytest.approx(0.11)
    assert f["agreement_median_s"] == pytest.approx(0.00085)
    assert f["agreement_share_of_swap"] == pytest.approx(2 * 0.00085 / 0.11)
    assert ranks.figures({"steady": [{"skipped": "no cumem_ranks.py"}]}) == {}


class ReplayRank:
    """A rank whose gathered states are what the test says the ranks saw."""

    def __init__(self, gathered, mapped=(True, True)):
        self.gathered, self.calls, self._mapped = list(gathered), [], list(mapped)

    def state(self, error):
        return self.gathered.pop(0)

    def call(self, op):
        self.calls.append(op)

    def intact(self):
        return True

    def mapped(self):
        return self._mapped


def test_after_a_split_no_rank_touches_its_memory_or_retries():
    rank = ReplayRank([])
    out = ranks._after_failure(rank, [state(0, None, (False, False)), state(1, "oom")], "sleep", True)
    assert out["split"] == "rank 1 raised, rank 0 did not" and rank.calls == []
    out = ranks._after_failure(rank, [state(0, None, (False, False)), state(1, None, (False, False))], "sleep", True)
    assert out["unreached"] and rank.calls == []


def test_after_an_agreed_failure_the_ranks_check_retry_and_complete_the_cycle():
    failed = [state(0, "e"), state(1, "e")]
    rank = ReplayRank([[state(0), state(1)], [state(0), state(1)]])
    out = ranks._after_failure(rank, failed, "sleep", True)
    assert out["split"] is None and out["intact_after_failure"] is True and out["intact"] is True
    assert rank.calls == ["sleep", "wake_up"]
    # every rank raised, but one is not as before the call: a split too
    out = ranks._after_failure(ReplayRank([]), [state(0, "e"), state(1, "e", (True, False))], "sleep", True)
    assert out["split"] == "rank 0 awake (every allocation mapped); rank 1 partly mapped"


def test_the_rank_command_line():
    args = ranks.parse(["wake", "--rank", "3", "--world", "4", "--each", str(256 * MiB), "--gpus", "1",
                        "--store", "/tmp/s", "--out", "/tmp/o"])
    assert (args.phase, args.rank, args.world, args.timeout) == ("wake", 3, 4, ranks.AGREEMENT_TIMEOUT_S)


def test_steady_cycles_that_fail_fail_the_scenario():
    good = {"sleep": [doc(0)], "wake": [doc(0)], "steady": [{**STEADY, "errors": ["RankTransactionError: x"]}]}
    assert ranks.judge(good, 1) == ("fail", "steady cycles on rank 0: RankTransactionError: x")


def test_launch_starts_every_rank_and_reads_what_each_left(tmp_path, monkeypatch):
    import json
    import sys
    from types import SimpleNamespace

    from sm12x_bundle import cmd
    from sm12x_bundle.errors import CommandError

    tree = tmp_path / "tree"
    (tree / "csrc").mkdir(parents=True)
    cumem_py = tree / "vllm/device_allocator/cumem.py"
    cumem_py.parent.mkdir(parents=True)
    cumem_py.write_text("")
    ext = tmp_path / "ext" / "cumem_allocator.abi3.so"
    calls = []

    def fake_run(argv, *, timeout=None, echo=True, **kw):
        argv = [str(a) for a in argv]
        calls.append(argv)
        assert timeout == ranks.LAUNCH_LIMIT_S and echo is False
        r = int(argv[argv.index("--rank") + 1])
        if r == 2:  # a rank whose process died: no document
            raise CommandError("python -m sm12x_bundle.selftest.ranks ... failed with exit code 139")
        out = Path(argv[argv.index("--out") + 1])
        (out / f"rank-{r}.json").write_text(json.dumps({"rank": r, "split": None}))

    monkeypatch.setattr(cmd, "run", fake_run)
    cumem = SimpleNamespace(__file__=str(cumem_py), lib_name=str(ext))
    docs = ranks.launch(cumem, "wake", 3, 1, 2 * MiB, tmp_path / "work")
    assert docs[:2] == [{"rank": 0, "split": None}, {"rank": 1, "split": None}]
    assert docs[2] == {"rank": 2, "crash": "CommandError: python -m sm12x_bundle.selftest.ranks ... failed with exit code 139"}
    argv = min(calls)
    assert argv[:4] == [sys.executable, "-m", "sm12x_bundle.selftest.ranks", "wake"]
    assert argv[argv.index("--tree") + 1] == str(tree.resolve())
    assert argv[argv.index("--extension") + 1] == str(ext.resolve())
    assert argv[argv.index("--world") + 1] == "3" and argv[argv.index("--gpus") + 1] == "1"
