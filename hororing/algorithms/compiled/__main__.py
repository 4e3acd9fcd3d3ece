"""Fill the compiled steps' disk cache ahead of a job: ``python -m hororing.algorithms.compiled``.

A job's ranks compile the steps they need on first use, each rank on its own, and each
compile takes seconds of CPU (docs/compiled.md); ranks that find them in numba's disk cache
load them in a fraction of that. Run this once after installing (in an image's build, say,
or before the first job on a node whose ranks share cores) and every rank loads instead.
It prints where the cache is and what each kind of step took; with ``--jobs N`` it compiles
in N processes at once. MPI is not initialised (its library is only mapped), so it runs
outside mpiexec. Exits 1, saying why, where the steps cannot be compiled.
"""

import argparse
import subprocess
import sys


def _arguments(argv):
    parser = argparse.ArgumentParser(
        prog="python -m hororing.algorithms.compiled",
        description="Compile the ring's and the fold's steps into numba's disk cache.")
    parser.add_argument("--dtypes", default=None,
                        help="comma-separated dtypes (default: every one the steps take)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="processes compiling at once (default 1)")
    parser.add_argument("--share", default=None, help=argparse.SUPPRESS)  # i/N: one job's part
    return parser.parse_args(argv)


def _dtypes(names):
    from . import every_dtype
    from ...ops import numpy_dtype

    if names is None:
        return None
    taken = every_dtype()
    chosen = []
    for name in (part.strip() for part in names.split(",")):
        try:
            dtype = numpy_dtype(name)
        except TypeError:
            dtype = None
        if dtype not in taken:
            raise SystemExit(f"--dtypes: {name!r} is not a dtype the compiled steps take; they "
                             f"take {', '.join(sorted(str(d) for d in taken))}")
        chosen.append(dtype)
    return chosen


def main(argv=None):
    args = _arguments(sys.argv[1:] if argv is None else argv)
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be at least 1, got {args.jobs}")
    from . import cache_counts, cache_path, compile_ahead, configure, every_key, expected
    if not expected("auto"):
        print("numba is not installed: the Python steps run, and there is nothing to compile",
              file=sys.stderr)
        return 1
    groups = every_key(_dtypes(args.dtypes))
    if args.jobs > 1 and args.share is None:
        return _in_processes(args, min(args.jobs, len(groups)))
    if args.share is not None:
        index, count = (int(part) for part in args.share.split("/"))
        groups = groups[index::count]
    configure("wait")
    seconds, why = compile_ahead([key for group in groups for key in group])
    for key, took in seconds.items():
        what = f"fold cycle {key[1]}" if isinstance(key[0], str) else \
            f"ring {key[0]}" + (" (input read-only)" if key[1] else "")
        print(f"{what}: {took:.2f} s", flush=True)
    if why is not None:
        print(f"the compiled steps could not be made: {why}", file=sys.stderr)
        return 1
    compiled, loaded = cache_counts()
    print(f"{compiled} compiled, {loaded} loaded from the cache at {cache_path()}", flush=True)
    return 0


def _in_processes(args, count):
    passed = [] if args.dtypes is None else ["--dtypes", args.dtypes]
    jobs = [subprocess.Popen([sys.executable, "-m", "hororing.algorithms.compiled", *passed,
                              "--share", f"{index}/{count}"]) for index in range(count)]
    return max(job.wait() for job in jobs)


if __name__ == "__main__":
    sys.exit(main())
