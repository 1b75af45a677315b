"""The cost model of hierarchical ZeRO: what a step costs, for the runtime's ``auto`` and
``secondary_level: auto``, the planner, the A/B command's predictions and the projection.

It imports neither the engine nor the tools, nor torch: the planning commands start without them.
Its modules, one line each: docs/hierarchical_zero.md, "The plugin's floors, and one cost model"."""
