"""hororing.run: a function run on N ranks, its results in rank order, its errors named."""

import os

import pytest

import hororing

pytestmark = pytest.mark.timeout(180)


def rank_sum_plus(offset, scale=1):
    import numpy as np

    import hororing as hvd

    hvd.init()
    total = hvd.allreduce(np.array([hvd.rank() * scale]), op=hvd.Sum)[0]
    return {"rank": hvd.rank(), "size": hvd.size(), "value": int(total) + offset}


def test_results_come_back_in_rank_order():
    results = hororing.run(rank_sum_plus, args=(7,), kwargs={"scale": 10}, np=3)
    assert results == [{"rank": r, "size": 3, "value": 30 + 7} for r in range(3)]


def test_a_closure_from_the_caller_runs_on_every_rank():
    factor = 6

    def times_rank():
        import hororing as hvd

        hvd.init()
        return factor * hvd.rank()

    assert hororing.run(times_rank, num_proc=2) == [0, 6]


def test_the_rank_that_raised_is_named_with_its_traceback():
    def fails_on_rank_1():
        import hororing as hvd

        hvd.init()
        if hvd.rank() == 1:
            raise ValueError("shard 17 is missing")
        hvd.barrier()  # rank 0 would wait here forever for rank 1

    with pytest.raises(hororing.RunError, match=r"rank 1 raised ValueError: shard 17 is missing") \
            as caught:
        hororing.run(fails_on_rank_1, np=3)
    assert "in fails_on_rank_1" in str(caught.value)


def test_a_rank_whose_stderr_is_lost_is_still_named():
    # mpiexec may end before it forwards the failing rank's last stderr line (the abort wins
    # the race); here that line can never arrive, so only the report file can name the rank
    def fails_on_rank_2_silently():
        import os

        import hororing as hvd

        hvd.init()
        if hvd.rank() == 2:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            raise KeyError("label 9")
        hvd.barrier()

    with pytest.raises(hororing.RunError, match=r"rank 2 raised KeyError: 'label 9'") as caught:
        hororing.run(fails_on_rank_2_silently, np=3)
    assert "in fails_on_rank_2_silently" in str(caught.value)


def test_a_killed_ranks_shared_memory_is_removed_after_the_run(capfd):
    def killed_on_rank_1():
        import os
        import signal

        import hororing as hvd

        hvd.init()
        hvd.barrier()
        if hvd.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # MPI never unlinks its shared memory
        hvd.barrier()

    with pytest.raises(hororing.RunError, match="exit status"):
        hororing.run(killed_on_rank_1, np=2)
    err = capfd.readouterr().err
    if "shared-memory" not in err and not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this host")
    assert "hororing.run: removed" in err and "that ended ranks left in /dev/shm" in err, \
        err[-3000:]


def test_gloo_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="MPI only: call hororing.run without use_gloo"):
        hororing.run(rank_sum_plus, args=(0,), np=2, use_gloo=True)


def test_an_elastic_function_is_relaunched_and_returns_from_the_launch_that_finished():
    def elastic_count():
        import signal

        import hororing as hvd

        hvd.init()
        state = hvd.elastic.ObjectState(step=0)

        @hvd.elastic.run
        def count(state):
            while state.step < 6:
                if state.step == 3 and hvd.rank() == 1 and \
                        os.environ["HORORING_ELASTIC_LAUNCH"] == "0":
                    os.kill(os.getpid(), signal.SIGKILL)
                state.step += 1
                state.commit()
            return state.step, int(os.environ["HORORING_ELASTIC_LAUNCH"])
        return count(state)

    assert hororing.run(elastic_count, np=2, min_np=2) == [(6, 1), (6, 1)]
