#!/usr/bin/env python
"""The allreduce cost model at scale: calibrate it on measurements, check it, predict.

  python scripts/simulate_scale.py --calibrate docs/results/scale_*.json
      fit the model's constants (hororing.algorithms.cost: Host, the links) to the runs of
      scripts/bench_scale.py, print measured against predicted for every algorithm, size
      and rank count, with the residuals, and write the fit (--fit FILE)
  python scripts/simulate_scale.py [--fit FILE] [--plot DIR] [--markdown FILE]
      predict: for every network preset, 2..4096 ranks, 4 KiB..1 GiB, 1 and 8 ranks per
      node: each algorithm's time, the one the model chooses, its ratio to the bandwidth
      bound (2(n-1)/n·S over the link) and to the latency bound (ceil(log2 n) latencies),
      MPI's own allreduce modelled with its C-speed steps, and the negotiation cycle

The model is analytic (``cost.Shape``): each algorithm's Python steps, MPI steps, bytes over
the links within and between nodes, bytes reduced and copied, priced by the host's and the
links' constants. Where ranks outnumber cores (the calibration runs on 2 cores), the CPU
terms and shared-memory copies are multiplied by ranks / cores.
"""

import argparse
import dataclasses
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from hororing.algorithms import cost  # noqa: E402
from hororing.config import RING_PIECE_CEILING_ACROSS_NODES, RING_SUBCHUNK_ACROSS_NODES  # noqa: E402

KINDS = ("ring", "rabenseifner", "recursive_doubling", "small")
RANKS = (2, 4, 8, 16, 64, 128, 256, 512, 1000, 1024, 2048, 3000, 4096)
SIZES = tuple(4096 * 4 ** i for i in range(10))  # 4 KiB .. 1 GiB
NETWORKS = ("1gbe", "10gbe", "100gbe", "ib200")


@dataclasses.dataclass(frozen=True)
class Model:
    """Everything the predictions need.

    The host's CPU costs are the ones bench_scale.py measures in each run (one Python
    exchange step with ring neighbours and with XOR partners, one step of MPI's own
    allreduce, numpy's add and copy, all ranks busy at once: an oversubscribed run measures
    them slowed down as its algorithms meet them) times fitted factors: a step of an
    algorithm against the bare exchange, a further piece, one call's setup, a step inside
    MPI's own collectives against the measured one, the reduction against numpy's add. ``measured`` is the run
    predictions are made for; at scale, the 2-rank run (a core per rank)."""

    measured: dict         # step_s, reduce_Bps, copy_Bps of a run
    factors: dict          # step, piece, call, mpi_step, reduce: fitted multipliers
    links: dict            # name -> cost.Link
    cycle_s: float = 30e-6  # the negotiation cycle's own work per call (besides MPI's)
    cores: int = 2

    def host(self, measured=None):
        measured = measured or self.measured
        step, f = measured["step_s"], self.factors
        return cost.Host(step_s=f["step"] * step, piece_s=f["piece"] * step,
                         call_s=f["call"] * step, reduce_Bps=f["reduce"] * measured["reduce_Bps"],
                         copy_Bps=measured["copy_Bps"],
                         pair_step_s=f["step"] * measured.get("pair_step_s", step))

    def near(self, measured=None):
        """This host's shared memory as a link: its latency is a step inside MPI."""
        measured = measured or self.measured
        mpi_step = measured.get("mpi_step_s", measured["step_s"])
        return dataclasses.replace(self.links["shm"],
                                   latency_s=self.factors["mpi_step"] * mpi_step)

    def predict(self, kind, ranks, nbytes, far=None, per_node=1, measured=None,
                ranks_here=None, subchunk=1 << 20, piece_ceiling=0):
        """Seconds of ``kind`` (or ``"mpi"``: MPI's own allreduce, modelled as its
        Rabenseifner or recursive doubling at the cost of MPI's steps)."""
        near = self.near(measured)
        far = far or near
        host = self.host(measured)
        # shared-memory copies share the cores: the CPU terms are measured, copies are not
        cores = (measured or {}).get("cores", self.cores)
        contention = max(1.0, (ranks_here or 1) / cores)
        if kind == "mpi":
            host = dataclasses.replace(host, step_s=0.0, piece_s=0.0)
            return min(_time(cost.shape(algorithm, ranks, nbytes, per_node), host, far, near,
                             contention, mpi=True)
                       for algorithm in ("rabenseifner", "recursive_doubling"))
        return _time(cost.shape(kind, ranks, nbytes, per_node, subchunk, piece_ceiling),
                     host, far, near,
                     contention)

    def cycle(self, ranks, link):
        """One negotiation cycle: its Python work and MPI's allreduce of the vote bits."""
        return self.cycle_s + math.ceil(math.log2(max(ranks, 2))) * link.latency_s


def _time(shape, host, far, near, contention, mpi=False):
    """``shape.time`` with the shared-memory link's copies slowed by ``contention`` alone
    (the host's CPU constants are measured under it already). ``mpi``: the Python steps are
    MPI's own (latency only)."""
    if mpi:
        shape = dataclasses.replace(shape, mpi_steps=shape.mpi_steps + shape.steps, steps=0)
    slowed = {link.name: dataclasses.replace(link, bandwidth_Bps=link.bandwidth_Bps / contention,
                                             copies=False) if link.copies else link
              for link in (far, near)}
    return shape.time(host, slowed[far.name], slowed[near.name])


MEASURED_HERE = {"step_s": 5.2e-6, "reduce_Bps": 10.3e9, "copy_Bps": 10.6e9}


def default_model():
    return Model(MEASURED_HERE, {"step": 1.0, "piece": 0.5, "call": 2.0, "mpi_step": 0.5,
                                 "reduce": 1.0}, dict(cost.PRESETS))


# -- calibration ---------------------------------------------------------------------------

def load(paths):
    """Samples ``(kind, ranks, nodes, link, subchunk, bytes, seconds, measured, ceiling)``
    from bench_scale JSON (``ceiling``: the ring's piece ceiling; runs that did not record
    one cut fixed pieces)."""
    samples = []
    for path in paths:
        with open(path) as handle:
            run = json.load(handle)
        # an emulated link is fitted as itself, apart from the presets the predictions use
        link = "shm" if run["nodes"] == 1 else f"emulated {run['link']}"
        for row in run["rows"]:
            for kind, micros in row["time_us"].items():
                if kind in KINDS or kind == "mpi":
                    samples.append((kind, run["ranks"], run["nodes"], link,
                                    run["subchunk_bytes"], row["bytes"], micros * 1e-6,
                                    dict(run["constants"], cores=_cores(run)),
                                    run.get("piece_ceiling", 0)))
    return samples


def _cores(run):
    """The cores of the machine a run was measured on (runs before the machine's cores were
    read: this 2-core host)."""
    return run.get("machine", {}).get("cores") or 2


_FACTORS = ("step", "piece", "call", "mpi_step", "reduce")


def _model_from(vector, links, base):
    values = np.exp(vector)
    factors = dict(zip(_FACTORS, values[:len(_FACTORS)]))
    fitted = dict(base.links)
    at = len(_FACTORS)
    fitted["shm"] = dataclasses.replace(base.links["shm"], bandwidth_Bps=values[at],
                                        cache_bytes=values[at + 1], memory_Bps=values[at + 2])
    at += 3
    for index, name in enumerate(links):
        fitted[name] = dataclasses.replace(base.links[name],
                                           latency_s=values[at + 2 * index],
                                           bandwidth_Bps=values[at + 1 + 2 * index])
    return dataclasses.replace(base, factors=factors, links=fitted)


def _predict_sample(model, sample):
    kind, ranks, nodes, link, subchunk, nbytes, _, measured, ceiling = sample
    far = None if link == "shm" else model.links[link]
    return model.predict(kind, ranks, nbytes, far, per_node=math.ceil(ranks / nodes),
                         measured=measured, ranks_here=ranks, subchunk=subchunk,
                         piece_ceiling=ceiling)


def calibrate(samples, base):
    """Fit the factors, this host's shared memory as a link (bandwidth in cache, the bytes in
    flight a node's caches hold, its memory bandwidth), each network's latency and bandwidth
    to the samples, minimising the squared log of measured over predicted."""
    from scipy.optimize import least_squares

    links = sorted({sample[3] for sample in samples} - {"shm"})
    base = dataclasses.replace(base, links=dict(base.links))
    for name in links:  # "emulated 1gbe": starts from the 1gbe preset
        preset = base.links.get(name.split()[-1])
        if preset is None:
            raise SystemExit(f"a run across nodes names its link '{name[len('emulated '):]}', "
                             f"which is none of the presets ({', '.join(sorted(base.links))}):"
                             f" run bench_scale.py with --emulated PRESET for the link its "
                             f"nodes stand behind")
        base.links[name] = dataclasses.replace(preset, name=f"{preset.name}, emulated here")
    shm = base.links["shm"]
    start = [base.factors[name] for name in _FACTORS] + [
        shm.bandwidth_Bps, shm.cache_bytes or 32 << 20, shm.memory_Bps or 20e9]
    for name in links:
        start += [base.links[name].latency_s, base.links[name].bandwidth_Bps]

    def residuals(vector):
        model = _model_from(vector, links, base)
        return [math.log(sample[6] / _predict_sample(model, sample)) for sample in samples]
    fit = least_squares(residuals, np.log(start), method="trf")
    # predictions at scale take the constants of the fewest ranks on one host: a core each
    alone = min((sample for sample in samples if sample[3] == "shm"), key=lambda s: s[1],
                default=None)
    fitted = _model_from(fit.x, links, base)
    return fitted if alone is None else dataclasses.replace(fitted, measured=alone[7],
                                                            cores=alone[7]["cores"])


def report(model, samples):
    """Measured against predicted for every sample; the worst ratio by algorithm."""
    print(f"{'algorithm':>18} {'ranks':>5} {'link':>12} {'bytes':>10} {'measured':>10} "
          f"{'predicted':>10} {'ratio':>6}")
    worst = {}
    rows = []
    for sample in sorted(samples, key=lambda s: (s[0], s[3], s[1], s[5])):
        predicted = _predict_sample(model, sample)
        ratio = sample[6] / predicted
        key = (sample[0], sample[3])
        worst[key] = max(worst.get(key, 1.0), max(ratio, 1 / ratio))
        rows.append({"kind": sample[0], "ranks": sample[1], "link": sample[3],
                     "bytes": sample[5], "measured_us": sample[6] * 1e6,
                     "predicted_us": predicted * 1e6, "ratio": ratio})
        print(f"{sample[0]:>18} {sample[1]:>5} {sample[3]:>12} {sample[5]:>10} "
              f"{sample[6] * 1e6:>10.1f} {predicted * 1e6:>10.1f} {ratio:>6.2f}")
    print("\nworst measured/predicted (as max(r, 1/r)) by algorithm and link:")
    for (kind, link), value in sorted(worst.items()):
        print(f"  {kind:>18} {link:>12}: {value:.2f}" + ("" if value <= 1.25 else
                                                         "  (beyond +-25%)"))
    return rows, {f"{kind} {link}": value for (kind, link), value in worst.items()}


def model_to_json(model):
    return {"measured": model.measured, "factors": model.factors,
            "links": {name: dataclasses.asdict(link) for name, link in model.links.items()},
            "cycle_s": model.cycle_s, "cores": model.cores}


def model_from_json(data):
    return Model(data["measured"], data["factors"],
                 {name: cost.Link(**link) for name, link in data["links"].items()},
                 data["cycle_s"], data.get("cores", 2))


# -- prediction ----------------------------------------------------------------------------

def predictions(model, networks=NETWORKS, ranks_list=RANKS, sizes=SIZES, per_nodes=(1, 8)):
    rows = []
    near, host = model.near(), model.host()
    for network in networks:
        far = model.links[network]
        for per_node in per_nodes:
            for ranks in ranks_list:
                if 2 * per_node > ranks:  # one node: no network
                    continue
                for nbytes in sizes:
                    # the ring's pieces as the library cuts them across nodes
                    times = {kind: model.predict(kind, ranks, nbytes, far, per_node,
                                                 subchunk=RING_SUBCHUNK_ACROSS_NODES,
                                                 piece_ceiling=RING_PIECE_CEILING_ACROSS_NODES)
                             for kind in KINDS + ("mpi",)}
                    chosen = cost.choose(ranks, nbytes, host, far, near, per_node,
                                         small_bytes=(1 << 20) // ranks,
                                         subchunk_bytes=RING_SUBCHUNK_ACROSS_NODES,
                                         piece_ceiling=RING_PIECE_CEILING_ACROSS_NODES)
                    rows.append({"network": network, "per_node": per_node, "ranks": ranks,
                                 "bytes": nbytes, "times": times, "chosen": chosen,
                                 "bandwidth_bound": cost.bandwidth_bound(ranks, nbytes, far, host,
                                                                            per_node),
                                 "latency_bound": cost.latency_bound(ranks, far),
                                 "cycle": model.cycle(ranks, far)})
    return rows


def _human(nbytes):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _ms(seconds):
    return f"{seconds * 1e3:.3g}"


def markdown(rows, model):
    """The tables docs/scale.md shows: per preset, the choice and its ratios to the bounds."""
    lines = []
    for network in NETWORKS:
        link = model.links[network]
        for per_node in (1, 8):
            lines.append(f"\n#### {link.name}, {per_node} rank(s) per node\n")
            lines.append("| ranks | 4 KiB: choice, ms, x latency bound | 16 MiB: choice, ms, "
                         "x bandwidth bound | 256 MiB: choice, ms, x bw bound | 1 GiB: x bw "
                         "bound | 16 MiB: ring ms | MPI's own, 16 MiB ms | cycle ms |")
            lines.append("|---:|---|---|---|---:|---:|---:|---:|")
            for ranks in RANKS:
                chosen = {row["bytes"]: row for row in rows
                          if row["network"] == network and row["per_node"] == per_node
                          and row["ranks"] == ranks}
                if not chosen:
                    continue
                small, mid, big, huge = (chosen[4096], chosen[16 << 20], chosen[256 << 20],
                                         chosen[1 << 30])

                def cell(row, bound):
                    time = row["times"][row["chosen"]]
                    return (f"{row['chosen']}, {_ms(time)}, "
                            f"{time / row[bound]:.2f}x" if row[bound] else row["chosen"])
                lines.append(
                    f"| {ranks} | {cell(small, 'latency_bound')} | "
                    f"{cell(mid, 'bandwidth_bound')} | {cell(big, 'bandwidth_bound')} | "
                    f"{huge['times'][huge['chosen']] / huge['bandwidth_bound']:.2f} | "
                    f"{_ms(mid['times']['ring'])} | {_ms(mid['times']['mpi'])} | "
                    f"{_ms(mid['cycle'])} |")
    return "\n".join(lines) + "\n"


def check_targets(rows):
    """The chosen algorithm against the bounds at 64..4096 ranks: <= 1.3x the bandwidth
    bound from 16 MiB, <= 2x the latency bound at 4 KiB. Returns the rows that miss."""
    misses = []
    for row in rows:
        if row["ranks"] < 64:
            continue
        time = row["times"][row["chosen"]]
        if row["bytes"] >= 16 << 20 and time > 1.3 * row["bandwidth_bound"]:
            misses.append((row, time / row["bandwidth_bound"], "bandwidth"))
        if row["bytes"] == 4096 and time > 2 * row["latency_bound"]:
            misses.append((row, time / row["latency_bound"], "latency"))
    return misses


def plot(rows, model, directory):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    for nbytes in (4096, 16 << 20):
        figure, axes = plt.subplots(1, len(NETWORKS), figsize=(4 * len(NETWORKS), 3.6),
                                    sharey=False)
        for axis, network in zip(axes, NETWORKS):
            chosen = [row for row in rows if row["network"] == network
                      and row["per_node"] == 1 and row["bytes"] == nbytes]
            ranks = [row["ranks"] for row in chosen]
            for kind in KINDS + ("mpi",):
                axis.plot(ranks, [row["times"][kind] * 1e3 for row in chosen],
                          marker=".", label=kind if kind != "mpi" else "MPI's own (model)")
            bound = "latency_bound" if nbytes == 4096 else "bandwidth_bound"
            axis.plot(ranks, [row[bound] * 1e3 for row in chosen], "k--",
                      label=bound.replace("_", " "))
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_title(f"{model.links[network].name}, {_human(nbytes)}", fontsize=9)
            axis.set_xlabel("ranks (1 per node)")
        axes[0].set_ylabel("predicted time (ms)")
        axes[-1].legend(fontsize=7)
        figure.tight_layout()
        path = os.path.join(directory, f"scale_time_vs_ranks_{_human(nbytes).replace(' ', '')}"
                                       ".png")
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calibrate", nargs="+", metavar="JSON",
                        help="bench_scale.py results to fit the model to")
    parser.add_argument("--fit", help="write (with --calibrate) or read the fitted model")
    parser.add_argument("--validation", help="write measured vs predicted as JSON")
    parser.add_argument("--markdown", help="write the prediction tables as Markdown")
    parser.add_argument("--plot", help="write plots of time against ranks into this folder")
    args = parser.parse_args()
    model = default_model()
    if args.calibrate:
        samples = load(args.calibrate)
        model = calibrate(samples, model)
        print("fitted:", json.dumps(model_to_json(model), indent=1))
        rows, worst = report(model, samples)
        if args.validation:
            with open(args.validation, "w") as handle:
                json.dump({"model": model_to_json(model), "rows": rows, "worst": worst},
                          handle, indent=1)
        if args.fit:
            with open(args.fit, "w") as handle:
                json.dump(model_to_json(model), handle, indent=1)
        return 0
    if args.fit:
        with open(args.fit) as handle:
            model = model_from_json(json.load(handle))
    rows = predictions(model)
    print(markdown(rows, model))
    misses = check_targets(rows)
    print(f"targets at 64-4096 ranks: {len(misses)} of "
          f"{sum(1 for row in rows if row['ranks'] >= 64 and (row['bytes'] >= 16 << 20 or row['bytes'] == 4096))}"
          " (preset, ranks per node, ranks, size) cells miss")
    for row, ratio, which in misses:
        print(f"  {row['network']} x{row['per_node']} n={row['ranks']} {_human(row['bytes'])}: "
              f"{row['chosen']} {ratio:.2f}x the {which} bound")
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(markdown(rows, model))
    if args.plot:
        for path in plot(rows, model, args.plot):
            print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
