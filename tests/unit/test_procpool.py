"""OrderedPool: results in submission order from spawned processes; a task that kills its process is pinned
on itself (run once more, then reported as Crashed), a task that overruns its time limit has its process killed
and is reported as TimedOut, and the others still complete."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from plancache.procpool import Crashed, OrderedPool, TimedOut
from tests import procpool_tasks as tasks


@pytest.fixture
def pool():
    with OrderedPool(3) as p:
        yield p


def test_results_come_back_in_submission_order(pool):
    items = [(n, 0.3 - 0.05 * n) for n in range(6)]  # later items finish first
    assert list(pool.map_ordered(tasks.square_after, items)) == [n * n for n in range(6)]


def test_work_runs_in_several_processes(pool):
    pids = set(pool.map_ordered(tasks.pid, list(range(9))))
    assert len(pids) >= 2


def test_a_crashing_task_is_reported_and_the_others_complete(pool):
    items = [(0, "ok"), (1, "ok"), (2, "crash"), (3, "ok"), (4, "crash"), (5, "ok")]
    out = list(pool.map_ordered(tasks.crash_on, items))
    assert out == [1, 2, Crashed((2, "crash")), 4, Crashed((4, "crash")), 6]
    assert pool.restarts >= 2
    assert list(pool.map_ordered(tasks.crash_on, [(7, "ok")])) == [8]  # the pool works after crashes


def test_a_task_that_crashed_once_succeeds_on_its_retry(pool, tmp_path):
    out = list(pool.map_ordered(tasks.crash_once, [(1, str(tmp_path / "m1")), (2, str(tmp_path / "m2"))]))
    assert out == [1, 2]


def test_an_exception_raised_by_the_task_reaches_the_caller(pool):
    results = pool.map_ordered(tasks.raise_for, [0, 1, 2, 3])
    assert next(results) == 0 and next(results) == 1
    with pytest.raises(ValueError, match="task 2 is bad"):
        next(results)


def test_closing_the_iterator_early_cancels_what_has_not_started(pool):
    results = pool.map_ordered(tasks.square_after, [(n, 0.2) for n in range(12)])
    assert next(results) == 0
    results.close()
    assert list(pool.map_ordered(tasks.square_after, [(3, 0.0)])) == [9]


def test_a_second_batch_submitted_early_runs_after_the_first_and_both_complete(pool):
    first = pool.map_ordered(tasks.finished_at, [(n, 0.2) for n in range(3)])
    second = pool.map_ordered(tasks.finished_at, [(n, 0.0) for n in range(3, 6)])
    a, b = list(first), list(second)
    assert [n for n, _ in a] == [0, 1, 2] and [n for n, _ in b] == [3, 4, 5]
    # first in, first out: every process is busy with the first batch, so no task of the second starts before a
    # task of the first has finished (its finishing times may differ by the processes' start skew)
    assert min(t for _, t in b) >= min(t for _, t in a) - 0.05


def test_a_crash_in_one_batch_leaves_the_other_outstanding_batch_whole(pool):
    first = pool.map_ordered(tasks.crash_on, [(0, "ok"), (1, "crash"), (2, "ok")])
    second = pool.map_ordered(tasks.square_after, [(n, 0.3) for n in range(6)])  # queued behind, cancelled by a restart
    assert list(first) == [1, Crashed((1, "crash")), 3]
    assert pool.restarts >= 1
    assert list(second) == [n * n for n in range(6)]


def test_a_pool_needs_a_process():
    with pytest.raises(ValueError, match="at least 1 process"):
        OrderedPool(0)


def test_start_brings_every_process_up_at_once():
    before = len(multiprocessing.active_children())
    with OrderedPool(3) as p:
        p.start()
        assert len(multiprocessing.active_children()) - before == 3


def test_closing_a_candidate_set_early_cancels_its_pool_batch(pool):
    pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed")
    from plancache.gpu.candidates import BuildPool, CandidateSet

    batch = pool.map_ordered(tasks.square_after, [(n, 0.2) for n in range(12)])
    built = BuildPool._collect(batch)  # what a BuildPool's candidate set consumes
    assert next(built) == 0
    CandidateSet(graph=None, indices=list(range(12)), built=built).close()
    assert batch.gi_frame is None  # the batch's generator ran its clean-up: the tasks not started are cancelled
    assert list(pool.map_ordered(tasks.square_after, [(3, 0.0)])) == [9]


def test_a_hung_task_is_killed_at_its_time_limit_and_the_others_complete():
    before = len(multiprocessing.active_children())
    with OrderedPool(2, task_timeout=1.0) as pool:
        pool.start()
        assert list(pool.map_ordered(tasks.square_after, [(0, 0.0)])) == [0]  # both processes ready
        t0 = time.monotonic()
        out = pool.map_ordered(tasks.hang_on, [(0, "ok"), (1, "hang"), (2, "ok"), (3, "ok"), (4, "ok")])
        assert next(out) == 1
        assert next(out) == TimedOut((1, "hang"), 1.0)
        waited = time.monotonic() - t0
        assert list(out) == [3, 4, 5]  # the other process went on meanwhile
        assert 1.0 <= waited < 3.0
        assert pool.restarts == 1  # the killed process was replaced
        assert len(multiprocessing.active_children()) - before == 2
        assert list(pool.map_ordered(tasks.hang_on, [(5, "ok"), (6, "ok")])) == [6, 7]


def test_the_time_limit_counts_from_when_a_task_starts_not_from_when_it_was_queued():
    with OrderedPool(1, task_timeout=1.0) as pool:
        # 4 tasks of 0.5 s each on one process: the last ends 2 s after it was queued, well within its own second
        assert list(pool.map_ordered(tasks.square_after, [(n, 0.5) for n in range(4)])) == [0, 1, 4, 9]
        assert pool.restarts == 0


def test_a_pool_whose_processes_cannot_start_fails_its_tasks():
    with OrderedPool(2, initializer=tasks.exit_at_start) as pool, \
            pytest.raises(ChildProcessError, match="exited with code 3 while starting"):
        list(pool.map_ordered(tasks.square_after, [(1, 0.0), (2, 0.0)]))


def test_a_time_limit_must_be_positive():
    with pytest.raises(ValueError, match="task_timeout must be positive"):
        OrderedPool(1, task_timeout=0)


def test_a_build_past_its_time_limit_is_a_candidate_not_built_and_the_others_are_built():
    pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed")
    from plancache.gpu.candidates import BuildPool

    with OrderedPool(2, task_timeout=1.0) as pool:
        batch = pool.map_ordered(tasks.build_or_hang, [("key", "{}", i, (7, (("TILE", i),))) for i in range(4)])
        t0 = time.monotonic()
        built = list(BuildPool._collect(batch))
        waited = time.monotonic() - t0
    assert built[0] == 0 and built[2:] == [2, 3]
    hung = built[1]
    assert (hung.index, hung.engine_id, hung.knobs, hung.blob) == (1, 7, {"TILE": 1}, None)
    assert hung.error == "build timed out after 1 s (its builder process was killed)" and hung.build_seconds == 1.0
    assert waited < 5.0
