"""Input sharding: every rank its own files, every rank its own input channel.

``shard_files`` plans which files each rank reads; ``read_shard`` streams them in the rank;
``open_channel`` streams them through a FIFO private to the rank, fed by a producer process;
``equal_steps`` makes every rank run the same number of batches.
"""

from .channel import (Channel, ChannelBusyError, ChannelError, attach_channel, open_channel,
                      remove_stale_channels)
from .records import RecordFormatError, RecordWriter, read_npy, read_records
from .sharding import Shard, plan_shards, shard_files
from .steps import StepPlan, count_samples, equal_steps, plan_steps
from .streams import read_shard, shuffled

__all__ = [
    "Channel", "ChannelBusyError", "ChannelError", "RecordFormatError", "RecordWriter", "Shard",
    "StepPlan", "attach_channel", "count_samples", "equal_steps", "open_channel", "plan_shards",
    "remove_stale_channels",
    "plan_steps", "read_npy", "read_records", "read_shard", "shard_files", "shuffled",
]
