"""What each call of a ``hororing`` process group is named, the same on every member.

torch requires every member of a group to issue the group's collectives in the same order,
so a call is named from the group's own count of such calls; the engine's negotiation then
pairs the members' calls by name and catches mismatched kinds, shapes and dtypes before data
moves, as it does for hvd.* calls.
"""

import threading

SLOTS = 8  # names per call signature: at most this many such calls in flight at once


class CallNames:
    """The names of one group's calls (``group``: the group's name, every name's prefix).

    ``repeat`` (default True): a training loop's calls repeat their names. False: every call
    gets a name of its own that the engine's response cache never keeps (a group whose calls
    do not repeat, such as checkpoints' object gathers of ever-changing sizes, would
    otherwise fill the cache the training loop's names need).
    """

    def __init__(self, group):
        self._group = group
        self.repeat = True
        self._counts = {}     # call signature -> calls made with it
        self._holders = {}    # name -> the engine handle that last held it
        self._lock = threading.Lock()

    def start(self, kind, tensor, start, rows_vary=False):
        """``start(name)``'s handle, under a name every member gives the same call.

        A name holds the call's kind and tensor (dtype and shape) and a slot that counts
        such calls round ``SLOTS``: repeated names let the engine's response cache pair the
        calls without a negotiation (a fresh name each call costs one: 4 KiB in 300 us
        against 60 here). A slot is taken again only once the call that last held it is
        done, waited for here if need be (every member waits for the same call, which needs
        nothing later). ``rows_vary``: the first dimension may differ between members
        (allgather, all-to-all), so it is left out."""
        if not self.repeat:  # Group.auto_name's form: never cached (generated_once)
            with self._lock:
                count = self._counts.get(kind, 0)
                self._counts[kind] = count + 1
            return start(f"torch.{self._group}.{kind}.noname.{count}")
        shape = tensor.shape[1:] if rows_vary else tensor.shape
        signature = f"{kind}.{str(tensor.dtype)[6:]}.{'x'.join(map(str, shape))}"
        with self._lock:
            count = self._counts.get(signature, 0)
            self._counts[signature] = count + 1
        name = f"torch.{self._group}.{signature}.{count % SLOTS}"
        previous = self._holders.get(name)
        if previous is not None and not previous.done():
            previous.synchronize()
        handle = start(name)
        self._holders[name] = handle.inner
        return handle

    def forget(self):
        """Start the names over after a failed call: a mismatch leaves the members' counts
        apart (each counted its own signature), and every member sees the failure."""
        with self._lock:
            self._counts.clear()
            self._holders.clear()
