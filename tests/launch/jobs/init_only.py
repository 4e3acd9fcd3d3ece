"""hvd.init(), then print this process's rank and size (what a launcher made of it)."""
import hororing as hvd

hvd.init()
print(f"rank {hvd.rank()} size {hvd.size()}", flush=True)
hvd.shutdown()
