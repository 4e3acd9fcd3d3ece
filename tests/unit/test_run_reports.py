"""hororing.run names the rank whose own error ended the job, not a peer that raised
HorovodInternalError because of it."""

from hororing.runner.programmatic import cause


def report(rank, error, consequence):
    return {"rank": rank, "error": error, "traceback": "", "consequence": consequence}


def test_the_failing_ranks_own_error_is_named_before_its_peers_consequences():
    reports = [report(0, "HorovodInternalError: rank 1 shut down hororing.", True),
               report(2, "HorovodInternalError: rank 1 failed: ValueError", True),
               report(1, "ValueError: shard 17 is missing", False)]
    assert cause(reports)["rank"] == 1


def test_the_lowest_rank_among_own_errors_and_among_consequences_only():
    assert cause([report(3, "KeyError: 'x'", False), report(2, "OSError: disk", False),
                  report(0, "HorovodInternalError: ...", True)])["rank"] == 2
    assert cause([report(2, "HorovodInternalError: a", True),
                  report(1, "HorovodInternalError: b", True)])["rank"] == 1
    # reports written before the field existed count as a rank's own
    assert cause([{"rank": 4, "error": "ValueError: v", "traceback": ""},
                  report(0, "HorovodInternalError: c", True)])["rank"] == 4
