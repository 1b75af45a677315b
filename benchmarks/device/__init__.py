"""Device-faithful emulated ranks: compute charged to a per-rank virtual device clock.

``--device host`` computes on the host as before; ``--device h100`` or ``--device mi250x`` runs
the rank's real framework code with every tensor op charged to :class:`VirtualDevice` instead
(:mod:`.standin`), at the rates of :mod:`.tables`, times ``--dilation`` (which the emulated links
divide their bandwidth by), slowed by ``--contention`` while a collective is in flight.
"""

from .clock import DeviceStats, VirtualDevice
from .run import StandIn, add_device_flags, device_flags, stand_in
from .tables import H100, MI250X, TABLES, DeviceTable

__all__ = [
    "H100",
    "MI250X",
    "TABLES",
    "DeviceStats",
    "DeviceTable",
    "StandIn",
    "VirtualDevice",
    "add_device_flags",
    "device_flags",
    "stand_in",
]
