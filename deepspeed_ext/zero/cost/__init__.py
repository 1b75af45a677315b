"""The cost model of hierarchical ZeRO: one place for what a step costs, used by the runtime's
``auto`` and ``secondary_level: auto`` (:mod:`..planner`), the planner CLI (:mod:`..plan`), the
A/B command's predictions (:mod:`..bench`) and the projection (``benchmarks.zero.project``).

- :mod:`.collectives`: seconds of one collective by (operation, algorithm, members, bytes, link
  class), from documented hardware or a probe profile's fits;
- :mod:`.volume`: every collective of a ZeRO-3 / hpZ / ZeRO++ / hierarchical step and its bytes
  per link class;
- :mod:`.memory`: the bytes the hierarchical variant holds (gradient blocks for the cross-node
  hop) and the transient buffers of a hop collective;
- :mod:`.workload`: the machine, the GPT and DeepSpeed's buckets a projection is of;
- :mod:`.projection`: step time, TFLOPS and memory of a plan (communication charged through
  :mod:`.collectives`, compute from the GPT's FLOPs at a GEMM efficiency);
- :mod:`.step`: the step from its parts (compute + communication - hidden), the A/B command's
  prediction from a measured single-rank step and a profile.
"""
