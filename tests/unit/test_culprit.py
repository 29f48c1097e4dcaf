"""Which node a failed round names, and the count of failed rounds in a row that name it
(``petctl_agent.elastic.culprit``; issue #30: a node that is alive but cannot train)."""

from __future__ import annotations

from petctl_agent import DRAIN_EXIT_CODE
from petctl_agent.elastic.culprit import (
    Failure,
    can_begin,
    count_for,
    culprit_record,
    failure_time,
    first_failure,
    own_error,
)

PEER = "RuntimeError: [gloo] Connection closed by peer [127.0.0.12]:1234"
BAD = "RuntimeError: NCCL error: unhandled cuda error"


def test_the_failure_time_is_the_workers_note_else_the_exit_seen() -> None:
    assert failure_time(10.0, 10.4, 11.0) == 10.0  # the script raised, its process exited later
    assert failure_time(None, 10.4, 11.0) == 10.4  # killed by a signal: no note
    assert failure_time(10.9, 10.4, 11.0) == 10.4  # a sibling's exit came before the note
    assert failure_time(None, None, 11.0) == 11.0


def test_a_drain_or_a_rank_torch_terminated_never_begins_a_failure() -> None:
    assert not can_begin([DRAIN_EXIT_CODE], noted=False)
    assert not can_begin([DRAIN_EXIT_CODE, -15], noted=False)
    assert not can_begin([-15, -9], noted=False)
    assert can_begin([1], noted=False)
    assert can_begin([-6], noted=False)  # SIGABRT: NCCL's watchdog, an abort of its own
    assert can_begin([-15], noted=True)  # its script raised first


def test_the_culprit_is_the_earliest_failure_that_can_begin_one() -> None:
    a = Failure("i-a", 100.30, True, error=PEER)
    b = Failure("i-b", 100.10, True, error=BAD)
    c = Failure("i-c", 100.05, False)  # drained: never the culprit, however early
    assert first_failure([a, b, c]) == b
    assert first_failure([a, c]) == a
    assert first_failure([c, Failure("i-d", 101, False)]) is None
    # a tie names the same node on every node
    assert first_failure([Failure("i-y", 5.0, True), Failure("i-x", 5.0, True)]).node == "i-x"


def test_a_failure_on_one_node_only_names_nobody() -> None:
    """A node alone in its round (or the only one that failed) keeps the old rules."""
    assert first_failure([Failure("i-a", 1.0, True, error=BAD)]) is None
    assert first_failure([]) is None


def test_the_count_goes_on_for_the_same_node_with_no_new_checkpoint() -> None:
    b = Failure("i-b", 1.0, True, ckpt=40)
    assert count_for(b, None) == 1
    assert count_for(b, {"node": "i-b", "count": 1, "ckpt": 40}) == 2
    assert count_for(b, {"node": "i-b", "count": 2, "ckpt": 40}) == 3
    # another node began the previous failed round: a new count
    assert count_for(b, {"node": "i-a", "count": 2, "ckpt": 40}) == 1
    # a newer checkpoint since: the job trained in between, a new count
    assert count_for(b, {"node": "i-b", "count": 2, "ckpt": 20}) == 1
    assert count_for(Failure("i-b", 1.0, True, ckpt=None), {"node": "i-b", "count": 1, "ckpt": None}) == 2
    assert count_for(b, {"node": "i-b", "count": "x", "ckpt": 40}) == 1


def test_three_failed_rounds_that_began_on_one_node_reach_k() -> None:
    """Rounds 4, 6, 7 fail, each beginning on i-b; no checkpoint in between: 1, 2, 3."""
    previous = None
    counts = []
    for r in (4, 6, 7):
        a = Failure("i-a", r + 0.2, True, ckpt=10, error=PEER)
        b = Failure("i-b", r + 0.0, True, ckpt=10, error=BAD)
        first = first_failure([a, b])
        assert first is not None and first.node == "i-b"
        previous = culprit_record(first, count_for(first, previous), r)
        counts.append(previous["count"])
    assert counts == [1, 2, 3]


def test_an_error_is_the_nodes_own_only_when_its_peers_failed_otherwise() -> None:
    b = Failure("i-b", 1.0, True, error=BAD)
    assert own_error(b, [b, Failure("i-a", 1.2, True, error=PEER)])
    assert own_error(b, [b, Failure("i-a", 1.2, True, error=None)])  # a peer killed by a signal
    # the script's bug raises the same error everywhere: not this node's
    assert not own_error(b, [b, Failure("i-a", 1.2, True, error=BAD)])
    assert not own_error(b, [b])  # nobody else failed: nothing says whose it is
    # a script's bug on one rank only (rank 0's evaluation): the script's, not the node's; the
    # deterministic-failure rule ends the job at its second identical failure
    r0 = Failure("i-b", 1.0, True, error="KeyError: 'val_loss'")
    assert not own_error(r0, [r0, Failure("i-a", 1.2, True, error=PEER)])
    for line in ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
                 "torch.distributed.DistBackendError: NCCL communicator was aborted on rank 3",
                 "RuntimeError: CUDA error: uncorrectable ECC error encountered"):  # fmt: skip
        hw = Failure("i-b", 1.0, True, error=line)
        assert own_error(hw, [hw, Failure("i-a", 1.2, True, error=PEER)]), line


def test_a_failure_round_trips_through_its_record() -> None:
    f = Failure("i-b", 12.5, True, ckpt=7, error=BAD)
    assert Failure.from_dict(f.to_dict()) == f
    assert Failure.from_dict({"t": 1}) is None
    assert Failure.from_dict({"node": "i-a", "t": "x"}) is None
