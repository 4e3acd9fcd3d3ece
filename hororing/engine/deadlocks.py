"""A deadlock the negotiation can see, and the error that ends it on every rank.

When every rank is blocked (each collective it has pending is waited for by one of its
threads, nothing else is queued, and nothing has run or been submitted for
``Config.deadlock_grace_seconds``) and none of the pending collectives has been submitted by
every rank, none ever will be: the ranks called different names (or kinds) and wait on each
other. The rank whose grace runs out first asks for a gathered cycle in which every rank
says whether it is blocked (its header's WAITING field, ``engine.Engine._blocked``); when all
are and nothing is ready, every rank fails every pending collective (``join`` excepted) with
the same message, built here from the table every rank holds alike, and the job goes on.
Where a rank still has a collective that no thread waits for (an asynchronous one: another
thread may yet submit the match), it is not blocked, and the stall warning speaks instead.
"""

_SHOWN = 4  # names listed per rank before "and N more"


def deadlock_message(entries, join_entry, size):
    """The error for every pending collective of a deadlock.

    Args:
        entries: name -> {rank: Meta} of the pending collectives (``join`` excluded).
        join_entry: the table's ``join`` entry (its ``metas``: the ranks inside
            ``join()``), or None.
        size: the number of ranks.
    """
    joined = set(join_entry.metas) if join_entry is not None else set()
    waits = []
    for rank in range(size):
        names = [f"{metas[rank].kind} '{name}'" for name, metas in entries.items()
                 if rank in metas]
        if rank in joined:
            names.append("join()")
        shown = ", ".join(names[:_SHOWN])
        if len(names) > _SHOWN:
            shown += f" and {len(names) - _SHOWN} more"
        waits.append(f"rank {rank} waits on {shown or 'nothing'}")
    submitted = "; ".join(f"'{name}' by rank(s) {sorted(metas)}"
                          for name, metas in list(entries.items())[:2 * _SHOWN])
    return (f"Deadlock: every rank is blocked in a collective that can never complete, because "
            f"the ranks called different ones: {'; '.join(waits)}. Submitted: {submitted}. "
            f"Every rank must call the same collectives, with the same names, in the same "
            f"order. (Detected after HORORING_DEADLOCK_GRACE_SECONDS; 0 waits for ever.)")
