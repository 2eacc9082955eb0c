"""Where a part's rows sit (dp_rank, stage) in a job without a layout: one rank per place.

The what-if engine takes one worker per place; two ranks whose rows claimed one place (a job
whose meta.json has no extra.layout) failed every window they were in ("two ops share ...").
The first rank to send rows at a place holds it; another rank's part there is refused alone.
"""

from __future__ import annotations

from stragglers.errors import InputError
from stragglers.monitor.leases import ForeignJob
from stragglers.monitor.part_footers import PartFile
from stragglers.monitor.part_names import PartConflict
from stragglers.monitor.part_rows import PartData
from stragglers.monitor.windows import JobTracker


def rows_place(data: PartData | PartFile) -> tuple[int, int] | None:
    """The place (dp_rank, stage) a part's rows sit at, (-1, -1) when at more than one; None
    without rows."""
    if isinstance(data, PartFile):
        if not data.records or data.min_stage < 0:
            return None
        dp, stage = (data.min_dp, data.max_dp), (data.min_stage, data.max_stage)
    else:
        if not len(data.columns["stage"]):
            return None
        dp = (int(data.columns["dp_rank"].min()), int(data.columns["dp_rank"].max()))
        stage = (int(data.columns["stage"].min()), int(data.columns["stage"].max()))
    return (dp[0], stage[0]) if dp[0] == dp[1] and stage[0] == stage[1] else (-1, -1)


def check_place(job: str, rank: int, source: object, data: PartData | PartFile,
                tr: JobTracker | ForeignJob, claims: dict) -> InputError | None:
    """A job without a layout: the part refused alone when its rows sit at more than one place
    (dp_rank, stage), at another place than its rank's earlier parts, or at the place another
    rank holds (409: the engine takes one worker per place, and two ranks at one failed every
    window of the job); `claims` holds the places taken earlier in the batch."""
    place = rows_place(data)
    if place is None or not isinstance(tr, JobTracker) or tr.layout:
        return None
    if place == (-1, -1):
        return InputError(source, "dp_rank", f"rows of rank {rank} at more than one place "
                          "(dp_rank, stage); expected each rank's rows at one place")
    had = tr.places.get(rank, claims.get((job, rank)))
    if had is not None and had != place:
        return InputError(source, "dp_rank", f"rows at dp_rank {place[0]}, stage {place[1]}; "
                          f"rank {rank}'s earlier parts are at dp_rank {had[0]}, stage "
                          f"{had[1]}")
    holder = tr.holders.get(place, claims.get((job, place)))
    if holder is not None and holder != rank:
        return PartConflict(source, "rank", f"rows of rank {rank} at dp_rank {place[0]}, "
                            f"stage {place[1]}, the place of rank {holder} (its parts came "
                            "first); expected one rank per place (tensor-parallel ranks are "
                            "workers of their own: give each its dp_rank, or write "
                            "meta.json extra.layout)")
    claims[(job, rank)] = place
    claims[(job, place)] = rank
    return None
