"""A LocalSGD or DiLoCo checkpoint saved between syncs at one size and read at another
(``save KIND PATH``, ``load KIND PATH``): rank r reads saved rank ``r % n``'s inner optimizer
state, and its parameters (LocalSGD) or the global ones (DiLoCo); each rank's files beside the
checkpoint (torch.save) are what it is checked against."""

import sys

import torch

import hororing.torch as hvd


def model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def optimizer_of(kind, network):
    if kind == "LocalSGD":
        return hvd.LocalSGD(network, torch.optim.SGD(network.parameters(), lr=0.1,
                                                     momentum=0.9), sync_every=3)
    return hvd.DiLoCo(network, torch.optim.AdamW(network.parameters(), lr=0.01),
                      torch.optim.SGD(network.parameters(), lr=0.7, momentum=0.9,
                                      nesterov=True), sync_every=3, fragments=2)


def train(network, optimizer, steps):
    for step in steps:
        generator = torch.Generator().manual_seed(100 * step + hvd.rank())
        data, target = torch.randn(4, 5, generator=generator), torch.randn(4, 2,
                                                                          generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(network(data), target).backward()
        optimizer.step()


def inner_state(optimizer):
    return [{key: value.clone() for key, value in state.items()}
            for state in optimizer._optimizer.state.values()]


def main():
    mode, kind, path = sys.argv[1:4]
    hvd.init()
    network = model(0 if mode == "save" else 1)
    optimizer = optimizer_of(kind, network)
    if mode == "save":
        train(network, optimizer, range(4))  # syncs after step 3; step 4 is the ranks' own
        hvd.checkpoint.save(path, network, optimizer, step=4)
        torch.save({"parameters": [parameter.detach() for parameter in network.parameters()],
                    "inner": inner_state(optimizer),
                    "global": [value.clone() for value in getattr(optimizer, "_global", [])],
                    "size": hvd.size()}, f"{path}.rank{hvd.rank()}.pt")
        print(f"rank {hvd.rank()} saved", flush=True)
        return
    extra = hvd.checkpoint.load(path, network, optimizer)
    saved_size = torch.load(f"{path}.rank0.pt")["size"]
    source = torch.load(f"{path}.rank{hvd.rank() % saved_size}.pt")
    expected = source["global"] if kind == "DiLoCo" else source["parameters"]
    for parameter, wanted in zip(network.parameters(), expected):
        assert torch.equal(parameter.detach(), wanted), (parameter, wanted)
    for mine, theirs in zip(inner_state(optimizer), source["inner"]):
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), key
    assert optimizer.steps == extra["step"] == 4
    train(network, optimizer, range(4, 7))
    optimizer.sync_now()
    everyone = hvd.allgather_object([parameter.detach() for parameter in network.parameters()])
    assert all(torch.equal(one, other) for ranks in zip(*everyone) for one, other in
               zip(ranks, ranks[1:]))
    print(f"rank {hvd.rank()} resumed {kind} at {hvd.size()} ranks from {saved_size}",
          flush=True)


if __name__ == "__main__":
    main()
