"""Switching a rank onto the stand-in: the context manager and the benchmarks' shared flags."""

from __future__ import annotations

import argparse
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

from benchmarks.device.clock import DeviceStats, VirtualDevice
from benchmarks.device.standin import StandInMode, _Shared
from benchmarks.device.tables import TABLES, DeviceTable

DEVICES = ("host", *sorted(TABLES))
CONTENTIONS = (0.0, 0.1, 0.2)
"""The contention factors results are reported over (compute slowed while a transfer runs)."""


class StandIn:
    """While entered, this thread's tensor work goes to a virtual ``table`` device (work the
    hierarchical ZeRO hops run on their threads follows through ``StandInMode.for_thread``)."""

    def __init__(self, table: DeviceTable, dilation: float = 1.0, contention: float = 0.0) -> None:
        self.device = VirtualDevice(table, dilation, contention)
        self._mode = StandInMode(_Shared(self.device))

    def __enter__(self) -> StandIn:
        self._mode.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._mode.__exit__(kind, error, tb)
        if kind is None:
            self.device.synchronize()

    def building(self) -> AbstractContextManager[None]:
        """Build modules under it: their parameters are allocated but never initialised, so a
        stand-in run's many copies of a large stack cost the host no memory (nothing reads them)."""
        return self._mode.uncharged()

    def synchronize(self) -> None:
        """Wait until the virtual device has run everything issued (a step's end)."""
        self.device.synchronize()

    @property
    def stats(self) -> DeviceStats:
        return self.device.stats

    def describe(self) -> dict[str, Any]:
        """The device, its factors and what was charged: for a run's JSON."""
        s, table = self.device.stats, self.device.table
        return {
            "device": table.name,
            "dilation": self.device.dilation,
            "contention": self.device.contention,
            "gemm_efficiency": table.gemm_efficiency,
            "gemm_tail_us": table.gemm_tail_us,
            "ops": s.ops,
            "busy_s": s.busy_s,
            "busy_s_by_kind": dict(s.by_kind),
            "waited_s": s.waited_s,
            "sources": list(table.sources),
            "values": "not computed: clipping, loss scaling and anything that reads values is off",
        }


def add_device_flags(parser: argparse.ArgumentParser, dilation: float | None = 1.0) -> None:
    """``--device``, ``--dilation`` and ``--contention``, as every emulated benchmark takes them
    (``dilation=None``: the benchmark derives it from its links)."""
    default = "derived from the emulated links" if dilation is None else f"{dilation:g}"
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="host",
        help="host: compute on this machine's CPU; h100 / mi250x: charge each rank's tensor work to a "
        "virtual device of that kind (benchmarks.device)",
    )
    parser.add_argument(
        "--dilation",
        type=float,
        default=dilation,
        help=f"device durations x this, link bandwidths / this (default {default})",
    )
    parser.add_argument(
        "--contention",
        type=float,
        default=0.0,
        help="share by which device ops slow while a collective is in flight (0, 0.1, 0.2)",
    )


def device_flags(args: argparse.Namespace) -> list[str]:
    """The flags that pass the parsed device choice on to a rank's command line."""
    return ["--device", args.device, "--dilation", repr(args.dilation), "--contention", repr(args.contention)]


def stand_in(args: argparse.Namespace) -> StandIn | None:
    """The stand-in the parsed flags ask for (None for ``--device host``)."""
    if args.device == "host":
        return None
    return StandIn(TABLES[args.device], args.dilation, args.contention)
