"""Emulated multi-node cluster on one host: network namespaces with tc-shaped links per link class.

Calibration lives in benchmarks.studies.cluster.calibrate (not imported here so `python -m` runs it cleanly).
"""

from multirank.processes import write_result

from .launch import EmulatedCluster, RankFailure
from .netns import ClusterUnavailable
from .spec import ClusterSpec, frontier, generic, profile

__all__ = [
    "ClusterSpec",
    "ClusterUnavailable",
    "EmulatedCluster",
    "RankFailure",
    "frontier",
    "generic",
    "profile",
    "write_result",
]
