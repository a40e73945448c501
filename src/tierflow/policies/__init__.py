"""Cache policies for tier directories, and a trace simulator that scores them.

A tier composes one `CachePolicy` (by name through `make_policy`) with its byte
accounting; `AdmissionController` is the space decision both a tier and `Cache` (a ledger in
memory) run. `simulate` and `optimum` replay traces from `tierflow.policies.traces`. The
interface is described in docs/policies.md.
"""

from tierflow.policies.admission import Admission, AdmissionController, Refusal
from tierflow.policies.auto import AutoPolicy, Lifecycle, choose_policy
from tierflow.policies.base import TIME_STATS, CachePolicy, EntryStats, NextUseOracle, rebase_stats
from tierflow.policies.cache import Cache
from tierflow.policies.clairvoyant import ClairvoyantPolicy
from tierflow.policies.fairshare import FairShare
from tierflow.policies.hotscore import HotScorePolicy, hot_score, hotscore_key
from tierflow.policies.lru import LRUPolicy
from tierflow.policies.nochurn import NoChurnPolicy
from tierflow.policies.oracle import IntervalOracle, oracle_from_accesses, oracle_from_intervals
from tierflow.policies.registry import make_policy, policy_names, register_policy
from tierflow.policies.simulator import SimResult, optimum, simulate
from tierflow.policies.stream import StreamPolicy

__all__ = [
    "Admission",
    "AdmissionController",
    "AutoPolicy",
    "Cache",
    "CachePolicy",
    "ClairvoyantPolicy",
    "EntryStats",
    "FairShare",
    "HotScorePolicy",
    "IntervalOracle",
    "LRUPolicy",
    "Lifecycle",
    "NextUseOracle",
    "NoChurnPolicy",
    "Refusal",
    "SimResult",
    "StreamPolicy",
    "TIME_STATS",
    "choose_policy",
    "hot_score",
    "hotscore_key",
    "make_policy",
    "optimum",
    "oracle_from_accesses",
    "oracle_from_intervals",
    "policy_names",
    "rebase_stats",
    "register_policy",
    "simulate",
]
