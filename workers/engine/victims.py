"""Whom to displace when a step needs a seat or device memory: the choice only; the Scheduler does the displacing
(a sequence displaced for a seat is suspended and keeps its blocks; one displaced for memory goes to the host pool
when there is one with room, else is recomputed).

  - class (for_seat): a seat for a sequence comes from the lowest class below it, latest arrival first; with seats
    free but the offline ones taken (the online reserve), only from offline work.
  - fair (for_share): with every seat taken, a tenant holding more than its weighted share of its class's seats
    gives one up to the least-served waiting tenant of that class holding less (online classes too: a tenant whose
    realtime flood holds every seat does not make another's request wait for one of its streams to end); the
    latest-arrived sequence of the tenant with the most seats per weight goes, and only if handing its seat over
    leaves that tenant no worse off than the other (no seat flips back).
  - memory (for_memory): the sequence holding device blocks of the lowest class, suspended before running, latest
    arrival; never one that ranks above the sequence that needs the room. With nothing running, also a suspended
    sequence that the step's (fair-share) order ranks after it, though it arrived first: nothing ranked below a
    sequence kept out is admitted, so such a one would hold its blocks idle and every step would be empty.
"""
from collections import defaultdict

from tidepool.workers.engine.sequence import Sequence, SequenceStatus

ODD_SEAT_LEAD = 16.0       # weighted tokens of service the giver of an odd seat must be ahead (VictimChooser.for_share)


class VictimChooser:
    def __init__(self, max_num_seqs: int, reserve_seats: int = 0):
        self.max_num_seqs = max_num_seqs
        self.reserve_seats = reserve_seats     # seats of the online reserve (never given to offline work)

    @staticmethod
    def for_seat(seq: Sequence, running: list[Sequence], scheduled: set[int], full: bool) -> Sequence | None:
        """The running sequence to suspend for seq's seat (full: every seat is taken; else only the offline ones
        are), not one already in this step (`scheduled` ids); None if none ranks below seq."""
        pool = [s for s in running if id(s) not in scheduled and s.rank > seq.rank and (full or not s.is_online)]
        return max(pool, key=lambda s: (s.rank, s.arrival), default=None)

    def for_share(self, running: list[Sequence], waiting: list[Sequence], served: dict, handed: dict[str, int],
                  moved: int) -> tuple[Sequence, str] | None:
        """(the running sequence to suspend, the waiting tenant its seat goes to), or None. served: (class rank,
        tenant) -> tokens / weight; handed: seats already handed to each waiting tenant in this step (`moved` of
        them, suspended but still to be taken)."""
        full = len(running) + moved >= self.max_num_seqs
        offline_full = full or sum(not s.is_online for s in running) + moved >= self.max_num_seqs - self.reserve_seats
        if not offline_full:
            return None        # a free seat: nobody needs to give one up (the usual step: no scan of the waiting)
        running_ids = set(map(id, running))
        for rank in sorted({s.rank for s in waiting if (offline_full, full)[s.is_online]}):
            if any(s.rank > rank and (full or not s.is_online) for s in running):
                continue       # a lower class holds a seat for_seat gives this class first: no handover within it
            seats: dict[str, list[Sequence]] = defaultdict(list)
            for s in running:
                if s.rank == rank:
                    seats[s.tenant].append(s)
            tenant = max(seats, key=lambda t: len(seats[t]) / seats[t][0].weight, default=None)
            if tenant is None:
                continue
            waiters: dict[str, list[Sequence]] = defaultdict(list)
            for s in waiting:
                if s.rank == rank and id(s) not in running_ids:
                    waiters[s.tenant].append(s)
            takers = [t for t in waiters if t != tenant and len(waiters[t]) > handed[t]]
            if not takers:
                continue
            taker = min(takers, key=lambda t: (served[(rank, t)], min(s.arrival for s in waiters[t])))
            weight = waiters[taker][0].weight
            lead = served[(rank, tenant)] - served[(rank, taker)]
            left, has = (len(seats[tenant]) - 1) / seats[tenant][0].weight, len(seats.get(taker, ())) + handed[taker]
            # a seat that evens the split moves; one that would leave the giver holding what the taker held (the
            # odd seat of an uneven number) moves only with a lead in service, and back after as long
            if lead > 0 and left >= (has + 1) / weight or lead > ODD_SEAT_LEAD and left >= has / weight:
                return max(seats[tenant], key=lambda s: s.arrival), taker
        return None

    @staticmethod
    def for_memory(seq: Sequence, running: list[Sequence], waiting: list[Sequence], scheduled: set[int],
                   passed: set[int] | None = None) -> Sequence | None:
        """The sequence holding device blocks to displace for seq (running, or suspended among the waiting), not one
        already in this step (`scheduled` ids): lowest class, suspended before running, latest arrival; None if
        none may go. One of seq's class that arrived earlier ranks above seq and stays, except, with nothing
        running, a suspended one the step's order ranks after seq (not among `passed`, the ids of the candidates
        so far, seq included; None: no such exception), after all others: the step would otherwise be empty, and so
        would every one after."""
        best, best_key = None, None
        for s in running + [w for w in waiting if w.status == SequenceStatus.SUSPENDED]:
            if s is seq or id(s) in scheduled or not s.block_table:
                continue
            below = (s.rank, s.arrival) > (seq.rank, seq.arrival)
            if not below and (running or passed is None or id(s) in passed):
                continue
            key = (below, s.rank, s.status == SequenceStatus.SUSPENDED, s.arrival)
            if best_key is None or key > best_key:
                best, best_key = s, key
        return best
