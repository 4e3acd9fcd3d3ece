#!/usr/bin/env python
"""Keras ``fit`` step time: hororing beside plain Keras and TensorFlow's own distribution.

    python scripts/bench_keras.py [--json results/keras.json] [--markdown table.md]

The driver (run without mpiexec) starts one job per variant; every job trains the same MLP
(64-``--width``-``--width``-10) on scikit-learn's digits with batch ``--batch-size`` per
worker, and times ``--steps`` steps of ``model.fit`` per round over ``--rounds`` rounds
(the median round; per step; in a multi-process job the slowest worker's):

  size 1, one process:   ``keras`` (plain SGD) and ``hororing`` (the same SGD wrapped by
                         hvd.DistributedOptimizer), alternating rounds side by side.
  2 workers, Keras fit:   ``hororing ring`` (mpiexec -n 2) and ``hororing PS`` (mpiexec -n 3:
                         2 workers and 1 server rank).
  2 workers, custom loop: the same MLP as plain tf.Variables, one ``tf.function`` step:
                         ``hororing tape`` (hvd.DistributedGradientTape) against
                         ``MultiWorkerMirrored``: tf.distribute.MultiWorkerMirroredStrategy
                         (two processes with a TF_CONFIG cluster on 127.0.0.1, gRPC ring
                         collectives). Keras 3's ``fit`` does not run under that strategy
                         (keras-team/keras#20585), so the two are compared on the loop that
                         TensorFlow's own documentation uses for it.
                         ``ParameterServerStrategy``: TensorFlow's parameter servers on the
                         same loop (a chief scheduling steps through a ClusterCoordinator,
                         2 worker tasks, 1 ps task, on 127.0.0.1). It is asynchronous: each
                         worker applies its own gradient to the ps variables; the time per
                         step is per worker step (elapsed time x 2 workers / steps).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")


def main():
    args = parse_args()
    if args.child:
        child(args)
    else:
        driver(args)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--steps", type=int, default=20, help="timed fit steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--mpiexec", default=_beside_python("mpiexec"))
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--child", choices=["single", "ring", "ps", "tape", "mwms", "pss",
                                              "tf-server"])
    parser.add_argument("--child-output")
    return parser.parse_args()


def _beside_python(name):
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.path.exists(path) else name


# ---- driver ---------------------------------------------------------------------------------

def driver(args):
    common = ["--steps", str(args.steps), "--rounds", str(args.rounds),
              "--batch-size", str(args.batch_size), "--width", str(args.width)]
    rows = []
    rows += run_mpi(args, 1, "single", common)
    rows += run_mpi(args, 2, "ring", common)
    rows += run_mpi(args, 3, "ps", common)
    rows += run_mpi(args, 2, "tape", common)
    rows += run_mwms(args, common)
    rows += run_pss(args, common)
    from benchinfo import machine_info, machine_line
    info = machine_info()
    import tensorflow as tf
    info["tensorflow"] = tf.__version__
    info["keras"] = __import__("keras").__version__
    lines = [machine_line(info) + f"; TensorFlow {info['tensorflow']}, Keras {info['keras']}",
             f"# MLP 64-{args.width}-{args.width}-10, batch {args.batch_size} per worker, "
             f"median of {args.rounds} rounds of {args.steps} fit steps",
             "", "| workers | variant | step ms | vs the first row of its group |",
             "|---|---|---|---|"]
    by_name = {row["variant"]: row for row in rows}
    for row in rows:
        base = by_name[{"keras": "keras", "hororing": "keras",
                        "MultiWorkerMirrored": "hororing tape", "hororing tape": "hororing tape",
                        "ParameterServerStrategy (async, 1 ps)": "hororing tape"}
                       .get(row["variant"], "hororing ring")]
        lines.append(f"| {row['workers']} | {row['variant']} | {row['step_ms']:.2f} | "
                     f"{row['step_ms'] / base['step_ms']:.2f}x |")
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write("\n".join(lines) + "\n")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "machine": info, "results": rows}, handle, indent=1)


def run_mpi(args, ranks, variant, common):
    with tempfile.NamedTemporaryFile(suffix=".json") as output:
        command = [args.mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py", __file__, "--child", variant,
                   "--child-output", output.name, *common]
        _check(subprocess.run(command, timeout=args.timeout, capture_output=True, text=True),
               command)
        return json.load(open(output.name))


def run_mwms(args, common):
    ports = [_free_port() for _ in range(2)]
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    with tempfile.NamedTemporaryFile(suffix=".json") as output:
        jobs = []
        for index in range(2):
            env = dict(os.environ, TF_CONFIG=json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": index}}))
            command = [sys.executable, __file__, "--child", "mwms", "--child-output",
                       output.name, *common]
            jobs.append((subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True), command))
        for job, command in jobs:
            try:
                stdout, stderr = job.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                for other, _ in jobs:
                    other.kill()
                raise
            _check(subprocess.CompletedProcess(command, job.returncode, stdout, stderr), command)
        return json.load(open(output.name))


def run_pss(args, common):
    """A TensorFlow parameter-server cluster: 1 ps and 2 worker servers, and the chief."""
    cluster = {"chief": [f"127.0.0.1:{_free_port()}"],
               "worker": [f"127.0.0.1:{_free_port()}" for _ in range(2)],
               "ps": [f"127.0.0.1:{_free_port()}"]}
    servers = []
    try:
        for task, index in (("worker", 0), ("worker", 1), ("ps", 0)):
            env = dict(os.environ, TF_CONFIG=json.dumps(
                {"cluster": cluster, "task": {"type": task, "index": index}}))
            servers.append(subprocess.Popen([sys.executable, __file__, "--child", "tf-server"],
                                            env=env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))
        with tempfile.NamedTemporaryFile(suffix=".json") as output:
            env = dict(os.environ, TF_CONFIG=json.dumps(
                {"cluster": cluster, "task": {"type": "chief", "index": 0}}))
            command = [sys.executable, __file__, "--child", "pss", "--child-output",
                       output.name, *common]
            _check(subprocess.run(command, env=env, timeout=args.timeout, capture_output=True,
                                  text=True), command)
            return json.load(open(output.name))
    finally:
        for server in servers:  # they serve until killed
            server.kill()
            server.wait()


def _check(done, command):
    if done.returncode != 0:
        sys.exit(f"bench_keras: {' '.join(command)} exited with {done.returncode}:\n"
                 f"{done.stderr[-3000:]}")


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ---- the jobs -------------------------------------------------------------------------------

def digits(batch_size, steps, worker, workers):
    """``steps`` batches of this worker's shard (repeated as needed), features and labels."""
    import numpy as np
    from sklearn.datasets import load_digits
    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)[worker::workers]
    y = data.target.astype(np.int64)[worker::workers]
    rows = np.arange(batch_size * steps) % len(x)
    return x[rows], y[rows]


def build(width, optimizer):
    import keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(width, activation="relu"),
                              keras.layers.Dense(width, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=optimizer, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def mlp_variables(width):
    """The MLP's weights as plain tf.Variables (for the custom-loop variants)."""
    import numpy as np
    import tensorflow as tf
    rng = np.random.default_rng(0)
    shapes = [(64, width), (width,), (width, width), (width,), (width, 10), (10,)]
    return [tf.Variable((rng.normal(size=shape) * (0.05 if len(shape) == 2 else 0.0))
                        .astype(np.float32)) for shape in shapes]


def mlp_loss(variables, features, labels):
    import tensorflow as tf
    hidden = features
    for index in range(0, len(variables) - 2, 2):
        hidden = tf.nn.relu(tf.matmul(hidden, variables[index]) + variables[index + 1])
    logits = tf.matmul(hidden, variables[-2]) + variables[-1]
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))


def timed_rounds(fit, args, agree):
    """Per-step ms of each round (``agree(seconds)`` gives the slowest worker's)."""
    fit()  # warm-up: tracing and first allocations
    rounds = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        fit()
        rounds.append(agree(time.perf_counter() - started) * 1000.0 / args.steps)
    return rounds


def child(args):
    import keras
    if args.child == "mwms":
        import tensorflow as tf
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        worker = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        x, y = digits(args.batch_size, args.steps, worker, 2)
        with strategy.scope():
            variables = mlp_variables(args.width)

        @tf.function
        def step(features, labels):
            def replica(features, labels):
                with tf.GradientTape() as tape:
                    loss = mlp_loss(variables, features, labels)
                grads = tape.gradient(loss, variables)
                grads = tf.distribute.get_replica_context().all_reduce("mean", grads)
                for variable, grad in zip(variables, grads):
                    variable.assign_sub(0.01 * grad)
            strategy.run(replica, args=(features, labels))

        def fit():
            for index in range(args.steps):
                rows = slice(index * args.batch_size, (index + 1) * args.batch_size)
                step(x[rows], y[rows])
            float(variables[0][0, 0])  # wait for the last step
        steps = timed_rounds(fit, args, lambda seconds: seconds)
        if worker == 0:
            _write(args, [{"workers": 2, "variant": "MultiWorkerMirrored",
                           "step_ms": statistics.median(steps), "rounds": steps}])
        return

    if args.child == "tf-server":
        import tensorflow as tf
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                             task_index=resolver.task_id, protocol="grpc", start=True).join()
        return
    if args.child == "pss":
        pss_chief(args)
        return

    import hororing.keras as hvd
    if args.child == "ps":
        hvd.init(mode="ps", num_servers=1)  # the server rank serves here and exits
    else:
        hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x, y = digits(args.batch_size, args.steps, rank, size)

    def slowest(seconds):
        return max(hvd.allgather_object(seconds))

    rows = []
    if args.child == "single":
        plain = build(args.width, keras.optimizers.SGD(0.01))
        wrapped = build(args.width, hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)))
        times = {"keras": [], "hororing": []}
        for model in (plain, wrapped):
            model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0, shuffle=False)
        for _ in range(args.rounds):  # alternate, so drift in machine speed hits both
            for name, model in (("keras", plain), ("hororing", wrapped)):
                started = time.perf_counter()
                model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0, shuffle=False)
                times[name].append((time.perf_counter() - started) * 1000.0 / args.steps)
        rows = [{"workers": 1, "variant": name, "step_ms": statistics.median(values),
                 "rounds": values} for name, values in times.items()]
    elif args.child == "tape":
        import tensorflow as tf
        import hororing.tensorflow as hvd_tf
        variables = mlp_variables(args.width)
        hvd_tf.broadcast_variables(variables, root_rank=0)

        @tf.function
        def step(features, labels):
            with tf.GradientTape() as tape:
                loss = mlp_loss(variables, features, labels)
            grads = hvd_tf.DistributedGradientTape(tape).gradient(loss, variables)
            for variable, grad in zip(variables, grads):
                variable.assign_sub(0.01 * grad)

        def fit():
            for index in range(args.steps):
                rows = slice(index * args.batch_size, (index + 1) * args.batch_size)
                step(x[rows], y[rows])
            float(variables[0][0, 0])
        steps = timed_rounds(fit, args, slowest)
        rows = [{"workers": size, "variant": "hororing tape", "step_ms": statistics.median(steps),
                 "rounds": steps}]
    else:
        model = build(args.width, hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)))

        def fit():
            model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0, shuffle=False)
        steps = timed_rounds(fit, args, slowest)
        name = "hororing ring" if args.child == "ring" else "hororing PS (1 server rank)"
        rows = [{"workers": size, "variant": name, "step_ms": statistics.median(steps),
                 "rounds": steps}]
    if rank == 0:
        _write(args, rows)
    hvd.shutdown()


def pss_chief(args):
    import tensorflow as tf
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        variables = mlp_variables(args.width)
    x, y = digits(args.batch_size, args.steps, 0, 1)

    def dataset_fn():
        return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(args.batch_size)
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def step(iterator):
        def replica(features, labels):
            with tf.GradientTape() as tape:
                loss = mlp_loss(variables, features, labels)
            grads = tape.gradient(loss, variables)
            for variable, grad in zip(variables, grads):
                variable.assign_sub(0.01 * grad)
        features, labels = next(iterator)
        strategy.run(replica, args=(features, labels))

    def fit():  # 2 x steps steps scheduled: steps on each of the 2 workers
        for _ in range(2 * args.steps):
            coordinator.schedule(step, args=(iterator,))
        coordinator.join()
    steps = timed_rounds(fit, args, lambda seconds: seconds)
    _write(args, [{"workers": 2, "variant": "ParameterServerStrategy (async, 1 ps)",
                   "step_ms": statistics.median(steps), "rounds": steps}])


def _write(args, rows):
    with open(args.child_output, "w") as handle:
        json.dump(rows, handle)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
