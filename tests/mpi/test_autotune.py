"""Autotuning in a job: settings change under a stream of allreduces, the same on every rank at
the same cycle, and every result stays right (against a reference computed here)."""

import csv
import dataclasses
import os
import tempfile

import pytest
from mpi4py import MPI

import hororing as hvd
from hororing.context import current
from hororing.tuning import autotune
from reference import all_inputs, assert_close, reference_allreduce

SHAPES = [(1001,), (30011,), (3, 23459), (7,)]  # none divisible by the ranks; 4 B to 281 KB


def test_settings_change_together_and_results_stay_right():
    comm = MPI.COMM_WORLD
    context = current()
    engine = context.engine
    pipeline = engine.executor.allreduce
    saved_route = pipeline.route
    log_path = comm.bcast(os.path.join(tempfile.mkdtemp(), "autotune.csv")
                          if comm.rank == 0 else None)
    config = dataclasses.replace(context.config, autotune=True, autotune_log=log_path,
                                 autotune_warmup_samples=1, autotune_steps_per_sample=2,
                                 autotune_bayes_opt_max_samples=6, explicit=frozenset())
    comm.Barrier()  # nothing in flight while the tuner is attached
    tuner = autotune.attach(engine, context.comm, config)
    steps = 0
    try:
        while comm.allreduce(tuner.active, op=MPI.LOR):
            assert steps < 2000, "tuning never ended"
            inputs = [all_inputs(hvd.size(), shape, "float32", seed=steps + index)
                      for index, shape in enumerate(SHAPES)]
            handles = [hvd.allreduce_async(rows[hvd.rank()], name=f"tuned.{index}", op=hvd.Sum)
                       for index, rows in enumerate(inputs)]
            for handle, rows in zip(handles, inputs):
                assert_close(hvd.synchronize(handle), reference_allreduce(rows, hvd.Sum))
            steps += 1
    finally:
        comm.Barrier()
        engine.tuner = None
        tuner.close()
        engine.apply_settings(tuner.history[0])
        # the rings' sub-chunks within and across nodes, which the tuner sets as one
        pipeline.reroute(**{field: getattr(saved_route, field)
                            for field in ("subchunk_bytes", "node_subchunk_bytes",
                                          "cross_subchunk_bytes", "piece_ceiling",
                                          "cross_piece_ceiling")})
    # every rank ran every setting, in the same order, and ended on the same one
    histories = comm.allgather([dataclasses.astuple(settings) for settings in tuner.history])
    assert all(history == histories[0] for history in histories)
    # the start, warm-up, 6 scored, 3 finalists (and the start again unless among them),
    # the hierarchical switch both ways where the job spans nodes
    finals = len(tuner.history) - (1 + 1 + 6 + ("hierarchical" in pipeline.host.algorithms) * 2)
    assert finals in (3, 4)
    assert len({settings.fusion_threshold for settings in tuner.history}) > 2  # it did move
    if comm.rank == 0:
        with open(log_path) as handle:
            rows = list(csv.DictReader(handle))
        tuned_rows = 6 + finals + ("hierarchical" in pipeline.host.algorithms) * 2
        assert len(rows) == tuned_rows + 1
        assert all(float(row["score"]) > 0 for row in rows)
        best = tuner.settings
        assert float(rows[-1]["tensor_fusion_threshold"]) * 1024 * 1024 == \
            pytest.approx(best.fusion_threshold, rel=1e-6)
        os.unlink(log_path)
        os.rmdir(os.path.dirname(log_path))
