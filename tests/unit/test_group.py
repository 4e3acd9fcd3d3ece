"""Group: generated names per thread (numbered, or one name for a thread's blocking calls),
and catching up after a collective this rank missed."""

import threading

from hororing.group import Group


class _Comm:
    def Get_rank(self):
        return 1


class _Engine:
    on_missed_error = None


def make_group():
    return Group(3, [2, 5, 7], _Comm(), _Engine())


def test_numbering_and_set_ranks():
    group = make_group()
    assert group.set_rank(5) == 1 and group.size == 3
    assert [group.auto_name("allreduce") for _ in range(2)] == ["allreduce.noname.0",
                                                                "allreduce.noname.1"]
    assert group.auto_name("broadcast") == "broadcast.noname.0"


def in_thread(name_it):
    """``name_it()`` called on a thread named "loader"; its result."""
    names = []
    thread = threading.Thread(target=lambda: names.append(name_it()), name="loader")
    thread.start()
    thread.join()
    return names[0]


def test_other_threads_number_their_own_calls():
    group = make_group()
    assert in_thread(lambda: group.auto_name("allreduce")) == "allreduce.loader.noname.0"
    assert group.auto_name("allreduce") == "allreduce.noname.0"


def test_an_unnamed_blocking_call_repeats_its_threads_name_and_takes_no_number():
    from hororing.engine.negotiation import generated_once
    group = make_group()
    assert [group.blocking_name("allreduce") for _ in range(2)] == [
        "allreduce.noname.blocking"] * 2
    assert not generated_once("allreduce.noname.blocking")  # cached: a loop of them folds
    assert in_thread(lambda: group.blocking_name("allreduce")) == \
        "allreduce.loader.noname.blocking"
    assert group.auto_name("allreduce") == "allreduce.noname.0"


def test_a_missed_failure_advances_the_count_past_its_number():
    group = make_group()
    engine = group.engine
    assert engine.on_missed_error == group.skip_name
    engine.on_missed_error("broadcast.noname.4")
    assert group.auto_name("broadcast") == "broadcast.noname.5"
    engine.on_missed_error("broadcast.noname.1")  # already past it: no change
    engine.on_missed_error("grad.fc1")            # a user's name: nothing to catch up
    assert group.auto_name("broadcast") == "broadcast.noname.6"


def test_only_names_generated_for_one_call_are_kept_out_of_the_response_cache():
    from hororing.engine.negotiation import generated_once
    once = ["allreduce.noname.7", "grouped_allreduce.noname.3.0",
            "broadcast_object.noname.4.size", "broadcast_object.noname.4.data",
            "allgather_object.noname.0.size", "sparse_allreduce.noname.2.values",
            "torch.3.allgather.noname.12"]
    repeated = ["allreduce.noname.0.5", "grads.0", "torch.1.allreduce.float32.10.3",
                "allreduce.noname.x", "broadcast_object.epoch.size"]
    assert [name for name in once if not generated_once(name)] == []
    assert [name for name in repeated if generated_once(name)] == []
