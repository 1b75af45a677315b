"""Emulated multi-node cluster on one host: network namespaces with tc-shaped links per link class.

Calibration lives in benchmarks.cluster.calibrate (not imported here so `python -m` runs it cleanly).
"""

from .launch import EmulatedCluster, RankFailure, write_result
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
