"""A sharded Adam checkpoint saved at 4 ranks and resumed at another size (``save``,
``load``), or a save that a rank dies in the middle of (``torn``): the resumed training must
be what one process training on the same batches computes."""

import os
import subprocess
import sys

import torch

import hororing.torch as hvd

SAVED_AT = 4  # ranks that train steps 0 and 1; the ranks of the load train steps 2 and 3


def model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))


def loss(network, step, rank):
    generator = torch.Generator().manual_seed(100 * step + rank)
    data, target = torch.randn(6, 7, generator=generator), torch.randn(6, 3, generator=generator)
    return torch.nn.functional.mse_loss(network(data), target)


def reference(steps, size):
    """One process: every rank's gradient of each step averaged into a plain Adam."""
    network = model(0)
    optimizer = torch.optim.Adam(network.parameters(), lr=0.01)
    for step in range(steps):
        ranks = SAVED_AT if step < 2 else size
        total = [torch.zeros_like(parameter) for parameter in network.parameters()]
        for rank in range(ranks):
            network.zero_grad()
            loss(network, step, rank).backward()
            for sum_, parameter in zip(total, network.parameters()):
                sum_ += parameter.grad
        for sum_, parameter in zip(total, network.parameters()):
            parameter.grad = sum_ / ranks
        optimizer.step()
    return network, optimizer


def read_plainly(path):
    """The checkpoint as a process with neither MPI nor hororing reads it."""
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith(("PMI", "MPI", "HYDRA", "OMPI", "PMIX"))}
    script = ("import sys\n"
              "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
              "dcp_to_torch_save(sys.argv[1], sys.argv[2])\n"
              "assert 'mpi4py' not in sys.modules and 'hororing' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", script, path, path + ".pt"], check=True,
                   env=environment, timeout=120)
    return torch.load(path + ".pt", weights_only=False)


def train(network, optimizer, steps):
    for step in steps:
        optimizer.zero_grad()
        loss(network, step, hvd.rank()).backward()
        optimizer.step()


def main():
    mode, path = sys.argv[1], sys.argv[2]
    hvd.init()
    network = model(0 if mode in ("save", "torn") else 1)  # a load must replace seed 1's
    optimizer = hvd.DistributedOptimizer(torch.optim.Adam(network.parameters(), lr=0.01),
                                         sharded=2)
    if mode in ("save", "torn"):
        assert hvd.size() == SAVED_AT
        train(network, optimizer, range(2))
        if mode == "torn" and hvd.rank() == 1:  # dies before writing its part
            from hororing.torch.checkpoint import direct
            type(direct.writer(path)).write_data = lambda *args: os._exit(3)
        hvd.checkpoint.save(path, network, optimizer, step=2 if mode == "save" else 3)
        print(f"rank {hvd.rank()} saved", flush=True)
        if hvd.rank() == 0:  # every rank's slices, in the parameters' shapes: one Adam's
            saved = read_plainly(path)
            expected, adam = reference(2, SAVED_AT)
            for (name, parameter), state in zip(expected.named_parameters(),
                                                adam.state.values()):
                torch.testing.assert_close(saved["model"][name], parameter.detach(),
                                           rtol=1e-5, atol=1e-6)
                for key in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(saved["optim"]["state"][name][key],
                                               state[key], rtol=1e-5, atol=1e-9)
                assert float(saved["optim"]["state"][name]["step"]) == 2.0
            print("a plain process reads one Adam's state", flush=True)
        return
    try:
        extra = hvd.checkpoint.load(path, network, optimizer)
    except ValueError as error:
        print(f"rank {hvd.rank()} refused: {error}", flush=True)
        return
    train(network, optimizer, range(extra["step"], 4))
    expected, _ = reference(4, hvd.size())
    for parameter, wanted in zip(network.parameters(), expected.parameters()):
        torch.testing.assert_close(parameter.detach(), wanted.detach(), rtol=1e-5, atol=1e-6)
    print(f"rank {hvd.rank()} resumed at {hvd.size()} ranks from step {extra['step']}",
          flush=True)


if __name__ == "__main__":
    main()
