"""PS mode's start: which ranks are workers and which serve, and how a server process ends.

With k dedicated servers the last k ranks of the job serve: ``start`` runs the server loop on
them and exits the process once every worker has shut down, so ``hvd.init()`` returns only on
workers. With colocated shards (k = 0) every rank is a worker and holds one shard.
"""

import sys

from ... import transport
from .server import serve
from .workers import Colocated, ServerClient, new_placement


def start(base, config):
    """Split ``base`` (a communicator hororing owns) by role.

    On a worker, return ``(comm, reducer)``: the workers' communicator, on which the engine
    runs, and the client through which its allreduces go. On a server, serve and exit.

    Raises:
        ValueError: for a server count or ``replicas_to_aggregate`` the job cannot have.
    """
    total = base.Get_size()
    servers = config.ps_servers
    if servers >= total:
        raise ValueError(
            f"PS mode with {servers} server(s) needs more than {servers} ranks, but the job has "
            f"{total}: no rank would be a worker. Run more ranks or set HORORING_PS_SERVERS "
            f"(num_servers) below {total}")
    workers = total - servers
    replicas = config.ps_replicas or workers
    if not 1 <= replicas <= workers:
        raise ValueError(f"replicas_to_aggregate must be in [1, {workers}] (the number of "
                         f"workers), got {config.ps_replicas}")
    if servers == 0:
        if replicas != workers:
            raise ValueError("replicas_to_aggregate needs dedicated servers (HORORING_PS_SERVERS"
                             " >= 1): with colocated shards every rank aggregates every step")
        return base, Colocated(base.Dup(), new_placement(config, total))
    rank = base.Get_rank()
    is_server = rank >= workers
    role_comm = base.Split(color=int(is_server), key=rank)
    # ``base`` itself carries the PS messages; the engine runs on the workers' communicator
    if is_server:
        failure, stats = serve(base, list(range(workers)), replicas, rank - workers)
        for comm in (role_comm, base):
            comm.Free()
        _exit(failure, stats, workers)
    client = ServerClient(base, range(workers, total), new_placement(config, servers),
                          workers, config.ps_replicas)
    return role_comm, client


def _exit(failure, stats, workers):
    """End a server process: status 0 after a clean shutdown, 1 after a worker failed."""
    steps = max(stats["steps"], 1)
    # one write, newline included, so servers' lines do not run together on a shared stdout
    line = (f"[hororing PS server {stats['server']}] {stats['steps']} steps from {workers} "
            f"workers; moved per step {stats['received_bytes'] // steps} B in, "
            f"{stats['sent_bytes'] // steps} B out; late pushes dropped: {stats['dropped']}")
    if stats.get("async"):
        line += (f"; asynchronous updates applied: {stats['async']['updates']}, staleness mean "
                 f"{stats['async']['mean_staleness']:.2f} max {stats['async']['max_staleness']}")
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    if failure is not None:
        transport.end_job(f"[hororing PS server {stats['server']}] ending the job: {failure}")
    sys.exit(0)
