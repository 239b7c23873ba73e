"""A seeded fault campaign over tiny stores: kills, full disks, concurrent writers and readers.

``python -m testsupport.faults --seed S --runs N`` runs runs 0..N-1 of campaign S and prints
the counts per fault kind, per faulted operation and per outcome (lost, dup, wrong, torn,
crash); ``--replay R`` runs run R alone and shows everything it did. A run is determined by
(seed, run) (and ``--kinds``, ``--mutant`` when given). The parts:

- :mod:`.truth`: what every item holds (from its key) and the log of transactions;
- :mod:`.inject`: kill at the K-th file-system call, ``RLIMIT_FSIZE``, a small tmpfs, seeded bugs;
- :mod:`.workers`: the writers, readers and the recovery writer (forked processes);
- :mod:`.checker`: the store, its copies and every reader's snapshots against the log;
- :mod:`.remote`: SeaweedFS behind a faulty link (:mod:`testsupport.netproxy`), for the ``remote`` kind;
- :mod:`.campaign`: plans drawn from (seed, run), the driver, the tally.

What the library promises under each fault, and what the campaign checks: docs/appends.md.
"""

from testsupport.faults.campaign import KINDS, LOCAL_KINDS, CampaignResult, RunPlan, draw_plan, replay, run_campaign
from testsupport.faults.checker import CATEGORIES
from testsupport.faults.inject import MUTANTS

__all__ = [
    "CATEGORIES",
    "KINDS",
    "LOCAL_KINDS",
    "MUTANTS",
    "CampaignResult",
    "RunPlan",
    "draw_plan",
    "replay",
    "run_campaign",
]
