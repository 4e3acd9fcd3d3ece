"""The fragments' cut and sync schedule LocalSGD and DiLoCo share (hororing.periodic)."""

import random

import pytest

from hororing.periodic import Schedule, check_fragments, cut


def test_the_cut_keeps_parameters_whole_and_balances_their_elements():
    assert cut([10, 10, 10, 10], 2) == [[0, 2], [1, 3]]
    assert cut([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert cut([1, 1, 100], 3) == [[0], [1], [2]]  # every fragment at least one parameter
    assert cut([5, 0, 0], 3) == [[0], [1], [2]]  # parameters of no elements too
    assert cut([5], 1) == [[0]]
    # bench_local_sgd's mlp: a parameter over a quarter of the model fills a fragment alone
    assert cut([409600, 1600, 2560000, 1600, 1638400, 1024, 16384, 16], 4) == \
        [[0], [1, 3, 5, 6, 7], [2], [4]]


@pytest.mark.parametrize("seed", range(20))
def test_no_fragment_holds_more_than_its_share_and_its_largest_parameter(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([1, 16, 128, 4096, 65536]) * rng.randint(1, 4)
             for _ in range(rng.randint(4, 40))]
    count = rng.randint(1, len(sizes))
    runs = cut(sizes, count)
    assert sorted(position for run in runs for position in run) == list(range(len(sizes)))
    assert all(run for run in runs) and len(runs) == count
    for run in runs:
        assert sum(sizes[p] for p in run) <= sum(sizes) / count + max(sizes[p] for p in run)


def test_the_schedule_spreads_the_fragments_over_the_steps():
    schedule = Schedule(every=50, count=4)
    assert schedule.offsets == [12, 25, 37, 0]
    synced = {step: schedule.due(step) for step in range(1, 101) if schedule.due(step)}
    assert synced == {12: [0], 25: [1], 37: [2], 50: [3], 62: [0], 75: [1], 87: [2], 100: [3]}
    assert Schedule(every=1, count=1).due(7) == [0]


def test_what_sync_now_finds_unsynced_and_a_state_without_it_restored_from_the_schedule():
    schedule = Schedule(every=4, count=3)  # offsets 1, 2, 0
    schedule.synced(2, 8)
    assert schedule.unsynced(8) == [0, 1]
    restored = Schedule(every=4, count=3)
    restored.restore(10)
    assert restored.synced_at == [9, 10, 8]
    restored.restore(1)
    assert restored.synced_at == [1, 0, 0]
    with pytest.raises(ValueError, match="saved with 2 fragments, this optimizer has 3"):
        restored.restore(5, [4, 5])


def test_more_fragments_than_parameters_are_refused():
    with pytest.raises(ValueError, match="from 1 to the model's 3 trained parameters"):
        check_fragments(4, 3)
    with pytest.raises(ValueError, match="got True"):
        check_fragments(True, 3)


def test_what_diloco_sends_its_changes_with_is_checked_as_each_binding_spells_it():
    from hororing.compression import Compression
    from hororing.torch.compression import Compression as TorchCompression
    from hororing.periodic import check_sent

    def sent(compression, int8=False, binding=Compression, **spelling):
        return check_sent(compression, int8, binding.none, binding.fp16, binding.bf16,
                          **spelling)

    assert sent(None) is Compression.none
    assert sent(Compression.bf16) is Compression.bf16
    assert sent(Compression.none, int8=True) is Compression.none
    assert sent(TorchCompression.fp16, binding=TorchCompression) is TorchCompression.fp16
    with pytest.raises(ValueError, match=r"DiLoCo sends its changes with Compression\.none, "
                                         r"\.fp16 or \.bf16; got 'topk'"):
        sent("topk")
    # one binding's Compression is not another's
    with pytest.raises(ValueError, match=r"with hvd\.Compression\.none"):
        sent(Compression.fp16, binding=TorchCompression, spelled="hvd.Compression")
    with pytest.raises(ValueError, match=r"DiLoCoCallback's int8=True sends int8 rows: leave "
                                         r"compression at hvd\.Compression\.none"):
        sent(Compression.fp16, int8=True, who="DiLoCoCallback", spelled="hvd.Compression")
