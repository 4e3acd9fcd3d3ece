"""An elastic torch job for hororun's fault tests: deterministic data, a commit per step.

Every step trains on the global batch of that step (generated from the step number), split
across the ranks there are, so the averaged gradient and the result do not depend on the job's
size beyond rounding, and are bit-identical for the same size. Faults are injected in one
launch only (HORORING_ELASTIC_LAUNCH): ``--kill L:R:S`` (repeatable) SIGKILLs the process that
started launch L as rank R when it reaches step S (survivors that go on in process are
renumbered; the kill stays with the process), ``--raise L:R:S`` raises there,
``--kill-in-write L:C`` SIGKILLs the writer of commit C of launch L half-way through writing
it. Rank 0 writes the final parameters to ``--out``.
"""
import argparse
import faulthandler
import json
import os
import signal
import time

import numpy as np
import torch

import hororing.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--step-sleep", type=float, default=0.0)
parser.add_argument("--slow-file", default=None,
                    help="while this file exists each step sleeps 1 s instead (a test holds "
                         "the job back until a change it waits for has come)")
parser.add_argument("--kill", action="append", default=[])
parser.add_argument("--raise", dest="raise_at", default=None)
parser.add_argument("--kill-in-write", default=None)
parser.add_argument("--raise-every-launch", action="store_true",
                    help="--raise applies to every launch, whatever its L")
parser.add_argument("--out", required=True)
parser.add_argument("--progress", default=None, help="rank 0 writes 'launch size step' here")
parser.add_argument("--stall-ahead", type=float, default=0.0,
                    help="a launch started ahead to take over (HORORING_ELASTIC_HANDOVER=1) "
                         "sleeps this long before hvd.init(): a start that never gets there")
parser.add_argument("--sharded", action="store_true",
                    help="DistributedOptimizer(sharded=True): each rank holds a slice of the "
                         "momentum, laid out again for the job's size at every launch")
args = parser.parse_args()

LAUNCH = int(os.environ.get("HORORING_ELASTIC_LAUNCH", "0"))
GLOBAL_BATCH = 24


def at(spec):
    """(rank, step) if ``spec`` 'L:R:S' names this launch, else None."""
    if spec is None:
        return None
    launch, rank, step = (int(part) for part in spec.split(":"))
    return (rank, step) if launch == LAUNCH or args.raise_every_launch else None


class BombInCommit:
    """Pickled as part of a commit: SIGKILLs the writer while commit ``commit`` is written."""

    def __init__(self, commit, count=0):
        self.commit = commit
        self.count = count

    def __deepcopy__(self, memo):  # save() copies without firing; only pickling fires
        return BombInCommit(self.commit, self.count)

    def __reduce__(self):
        if self.commit is not None and self.count == self.commit:
            os.kill(os.getpid(), signal.SIGKILL)
        return (BombInCommit, (self.commit, self.count))


faulthandler.register(signal.SIGUSR2, all_threads=True)  # a test that times out asks
if os.environ.get("HORORING_ELASTIC_HANDOVER") == "1":
    time.sleep(args.stall_ahead)
hvd.init()
torch.manual_seed(1234)
model = torch.nn.Linear(8, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                     named_parameters=model.named_parameters(),
                                     sharded=args.sharded)
w_true = torch.arange(1.0, 9.0).reshape(8, 1)
extra = {}
bomb_at = None
if args.kill_in_write:
    launch, commit = (int(part) for part in args.kill_in_write.split(":"))
    if launch == LAUNCH:
        bomb_at = commit
# the padding comes before the bomb in the pickle, so the bomb fires with bytes on disk
extra = {"padding": np.arange(300_000, dtype=np.float64), "bomb": BombInCommit(bomb_at)}
state = hvd.elastic.TorchState(model, optimizer, step=0, **extra)
kills, fail = {at(spec) for spec in args.kill} - {None}, at(args.raise_at)
START_RANK = hvd.rank()


@hvd.elastic.run
def train(state):
    while state.step < args.steps:
        generator = torch.Generator().manual_seed(state.step)
        x = torch.randn(GLOBAL_BATCH, 8, generator=generator)
        y = x @ w_true
        mine = slice(hvd.rank(), GLOBAL_BATCH, hvd.size())
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        optimizer.step()
        if (START_RANK, state.step) in kills:
            os.kill(os.getpid(), signal.SIGKILL)
        if fail == (hvd.rank(), state.step):
            raise RuntimeError(f"injected failure at step {state.step}")
        if args.slow_file and os.path.exists(args.slow_file):
            time.sleep(1.0)
        elif args.step_sleep:
            time.sleep(args.step_sleep)
        state.step += 1
        if bomb_at is not None and hvd.local_rank() == 0:
            state.bomb.count = state._commits + 1
        state.commit()
        if args.progress and hvd.rank() == 0:
            with open(args.progress + ".tmp", "w") as file:
                file.write(f"{LAUNCH} {hvd.size()} {state.step}\n")
            os.replace(args.progress + ".tmp", args.progress)
    # the momentum, whole (a sharded optimizer's state_dict gathers it: every rank calls it)
    momentum = [value["momentum_buffer"].numpy().ravel().tolist()
                for value in optimizer.state_dict()["state"].values()]
    return [p.detach().numpy().ravel().tolist() for p in model.parameters()], momentum


params, momentum = train(state)
every = hvd.allgather_object(params)
assert all(other == params for other in every), "ranks disagree on the parameters"
if hvd.rank() == 0:
    with open(args.out, "w") as file:
        json.dump({"params": params, "momentum": momentum, "size": hvd.size(),
                   "launch": LAUNCH, "step": state.step}, file)
