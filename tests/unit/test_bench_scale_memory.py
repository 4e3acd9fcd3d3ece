"""bench_scale.py leaves the gathered path out where its rows would outgrow the node's memory
(at 16 ranks and 64 MiB a rank it gathers 1 GiB on each, 16 GiB on the node)."""

import importlib.util
import os
import pathlib
import sys

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"


def load_bench_scale():
    sys.path.insert(0, str(SCRIPTS))  # its own helpers (benchinfo)
    try:
        spec = importlib.util.spec_from_file_location("bench_scale_under_test",
                                                      SCRIPTS / "bench_scale.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


def test_the_gathered_path_is_timed_only_where_its_rows_fit_half_the_memory():
    fits = load_bench_scale().gathered_fits
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # 16 ranks on one node, each gathering 16 rows: 256 rows on the node
    assert fits(memory // 2 // 256, 16, 16)
    assert not fits(memory // 2 // 256 + 1, 16, 16)
    # the same rows spread over 16 nodes, a rank each: 16 rows a node
    assert fits(memory // 2 // 16, 16, 1)
    assert fits(4096, 2, 2)
