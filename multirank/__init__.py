"""Run code on several local ranks, for the tests and the benchmarks alike.

* :class:`WorkerPool` (``pool``): a persistent gloo group of forked workers that runs a Python
  function on every rank per call (the tests' ``run_ranks`` fixture keeps one per world size).
* :func:`launch_ranks` (``processes``): one fresh ``python`` process per rank of a command, each
  handing its result back with :func:`write_result` (the benchmarks' loopback runs).
* :class:`~multirank.warm.WarmLauncher` (``warm``): a command's ranks forked from one interpreter
  that has imported torch and DeepSpeed (the tests' upstream and main-job trainings).

The first two raise :class:`RankError` when a rank fails and :class:`TimeoutError` when one never finishes."""

from .pool import WorkerPool
from .processes import RankError, free_port, launch_ranks, rank_env, write_result

__all__ = ["RankError", "WorkerPool", "free_port", "launch_ranks", "rank_env", "write_result"]
