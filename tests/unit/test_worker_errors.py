"""A worker's failure in its own words (``petctl_agent.elastic.failures``), the rule that
stops a deterministic failure, and which failed agent ``petctl status`` quotes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from petctl_agent.elastic import failures as fl

STACK = """Traceback (most recent call last):
  File "/opt/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 357, in wrapper
    return f(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^
  File "/var/lib/petctl/code/main.py", line 41, in main
    data = open(cfg.data_path).read()
           ^^^^^^^^^^^^^^^^^^^
FileNotFoundError: [Errno 2] No such file or directory: 'data/input.txt'
"""
LINE = "FileNotFoundError: [Errno 2] No such file or directory: 'data/input.txt'"
WHERE = "/var/lib/petctl/code/main.py:41 in main"


def _record(message: str, stack: str = STACK) -> dict:
    """torch's error file, as ``record`` writes it (``ErrorHandler.record_exception``)."""
    return {"message": {"message": message, "extraInfo": {"py_callstack": stack, "timestamp": "1"}}}


def test_the_error_file_gives_the_exception_line_and_where_it_was_raised() -> None:
    assert fl.from_error_file(_record(LINE)) == (LINE, WHERE)
    # a message over several lines: its first
    assert fl.from_error_file(_record("RuntimeError: CUDA error\nmore detail")) == (
        "RuntimeError: CUDA error",
        WHERE,
    )
    # torch's placeholders when there was no error file are no error
    for data in ({"message": "<NONE>"}, {"message": "<N/A>"}, None, {}):
        assert fl.from_error_file(data) == (None, None), data


def test_a_traceback_printed_before_sys_exit_is_found_in_stderr() -> None:
    """hydra: the traceback, then a line of advice, then exit 1 (no error file)."""
    lines = ["Error executing job with overrides: []", *STACK.splitlines(), "",
             "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace."]  # fmt: skip
    assert fl.from_output(lines) == (LINE, WHERE)
    # a chained exception: the last traceback is the one that ended the process
    chained = [*STACK.splitlines(), "", "During handling of the above exception, another exception occurred:",
               "", "Traceback (most recent call last):", '  File "/x/train.py", line 9, in <module>',
               "    raise RuntimeError('no data')", "RuntimeError: no data"]  # fmt: skip
    assert fl.from_output(chained) == ("RuntimeError: no data", "/x/train.py:9 in <module>")
    # no traceback: the last exception-like line, else the last line
    assert fl.from_output(["step 1", "torch.OutOfMemoryError: CUDA out of memory", "bye"]) == (
        "torch.OutOfMemoryError: CUDA out of memory",
        None,
    )
    assert fl.from_output(["loading", "config.yaml: batch_size must be > 0", ""]) == (
        "config.yaml: batch_size must be > 0",
        None,
    )
    assert fl.from_output([]) == (None, None)


def test_read_tail_drops_a_cut_first_line(tmp_path: Path) -> None:
    p = tmp_path / "stderr.log"
    p.write_text("x" * 100 + "\nlast line\n")
    assert fl.read_tail(p, size=20) == ["last line", ""]
    assert fl.read_tail(p)[-2:] == ["last line", ""]
    assert fl.read_tail(tmp_path / "missing") == [] and fl.read_tail(None) == []


def _failure(local_rank: int, exitcode: int, data: object = None) -> SimpleNamespace:
    return SimpleNamespace(
        local_rank=local_rank, exitcode=exitcode, error_file_data=data or {"message": "<NONE>"}
    )


def test_each_failed_rank_in_one_line_with_its_node(tmp_path: Path) -> None:
    err = tmp_path / "stderr.log"
    err.write_text("".join(f"{ln}\n" for ln in STACK.splitlines()))
    got = fl.worker_errors(
        {4: _failure(0, 1, _record(LINE)), 5: _failure(1, 1), 6: _failure(2, -15)},
        {1: str(err), 2: str(tmp_path / "none")},
    )
    assert [(e.rank, e.local_rank, e.exitcode, e.line) for e in got] == [
        (4, 0, 1, LINE), (5, 1, 1, LINE), (6, 2, -15, None),
    ]  # fmt: skip
    # the sibling torch SIGTERMed after the failure is not one of its own
    assert fl.describe(got, "i-0abc") == f"ranks 4,5 on i-0abc exit 1: {LINE}"
    assert "To enable traceback" not in fl.describe(got)
    killed = [fl.WorkerError(0, 0, -9, None)]
    assert fl.describe(killed, "i-1") == "rank 0 on i-1 killed by SIGKILL (out of memory?)"
    assert fl.describe([fl.WorkerError(3, 1, 2, None)], "i-1") == "rank 3 on i-1 exit 2: no error output"
    assert fl.describe([]) == "unknown"
    long = fl.worker_error(0, 0, 1, _record("ValueError: " + "x" * 1000), None)
    assert len(long.line) == fl.LINE_MAX and long.line.endswith("...")


def test_a_torn_checkpoint_says_what_it_probably_is() -> None:
    torn = "RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory"
    text = fl.describe([fl.WorkerError(0, 0, 1, torn)], "i-1")
    assert text.startswith(f"rank 0 on i-1 exit 1: {torn} [a file that is incomplete or torn")
    assert "several nodes at once" in text and "os.replace" in text


def test_the_same_failure_at_the_same_point_twice_is_deterministic() -> None:
    e = fl.WorkerError(0, 0, 1, LINE, WHERE)
    sig = fl.signature([e], 120, 4)
    assert sig == (LINE, WHERE, 120, 4)
    # what cannot repeat deterministically: a signal, no line, ranks failing differently
    assert fl.signature([fl.WorkerError(0, 0, -9, None)], 1, 4) is None
    assert fl.signature([fl.WorkerError(0, 0, 1, None)], 1, 4) is None
    assert fl.signature([e, fl.WorkerError(1, 1, 1, "ValueError: x", WHERE)], 1, 4) is None
    # a sibling torch terminated does not count; memory addresses do not make two errors differ
    assert fl.signature([e, fl.WorkerError(1, 1, -15, None)], 120, 4) == sig
    at = [fl.WorkerError(0, 0, 1, "RuntimeError: bad tensor at 0x7f3a2c00b8d0", WHERE)]
    again = [fl.WorkerError(0, 0, 1, "RuntimeError: bad tensor at 0x7f11d0e3a010", WHERE)]
    assert fl.signature(at, 1, 2) == fl.signature(again, 1, 2)

    w = fl.RepeatWatch()
    assert not w.again(sig)  # the first: restart
    assert w.again(sig)  # the second in a row: stop
    assert not w.again(fl.signature([e], 121, 4))  # another step: another point
    assert not w.again(fl.signature([e], 121, 2)) and not w.again(None) and not w.again(None)
    w.again(sig)
    w.reset()  # a membership change in between
    assert not w.again(sig)


def test_status_quotes_the_agent_that_failed_on_its_own() -> None:
    from petctl.jobs.reasons import agent_failure_reason

    own = f"rank 0 on i-2 exit 1: {LINE} (the same error twice in a row ...)"
    closed = "the rendezvous was closed by another node (job failed elsewhere)"
    agents = [
        # failed first, but only because i-2 closed the rendezvous
        {"instance_id": "i-1", "state": "FAILED", "reason": closed, "updated_at": 5,
         "events": [{"kind": "failed", "t": 10, "reason": closed, "closed": True}]},
        {"instance_id": "i-2", "state": "FAILED", "reason": own, "updated_at": 50,
         "events": [{"kind": "failed", "t": 11, "reason": own}]},
        {"instance_id": "i-3", "state": "FAILED", "reason": "later", "updated_at": 1,
         "events": [{"kind": "failed", "t": 12, "reason": "later"}]},
    ]  # fmt: skip
    got = agent_failure_reason(agents, "j")
    assert got.startswith(f"the agent of i-2 FAILED: rank 0 on i-2 exit 1: {LINE}"), got
    assert got.endswith("(its log: `petctl logs j --instance i-2`)"), got
    # only closed ones: the first of them
    assert agent_failure_reason(agents[:1], "j").startswith("the agent of i-1 FAILED: the rendezvous")
