"""The cost model of hierarchical ZeRO: one place for what a step costs, used by the runtime's
``auto`` and ``secondary_level: auto`` (:mod:`.secondary_level`), the recommendation CLI
(:mod:`..tools.recommend`), the A/B command's predictions (:mod:`..tools.ab`) and the projection
(``benchmarks.zero.project``). It imports neither the engine nor the tools.

- :mod:`.collectives`: seconds of one collective by (operation, algorithm, members, bytes, link
  class), from documented hardware or a probe profile's fits;
- :mod:`.volume`: every collective of a ZeRO-3 / hpZ / ZeRO++ / hierarchical step and its bytes
  per link class;
- :mod:`.memory`: the bytes the hierarchical variant holds (gradient blocks for the cross-node
  hop) and the transient buffers of a hop collective;
- :mod:`.workload`: the machine, the GPT and DeepSpeed's buckets a projection is of;
- :mod:`.projection`: step time, TFLOPS and memory of a plan (communication charged through
  :mod:`.collectives`, compute from the GPT's FLOPs at a GEMM efficiency);
- :mod:`.shape`: the DP group as nodes x packages x members;
- :mod:`.profile`: a probe's measured collectives, read and checked;
- :mod:`.secondary_level`: the level of the secondary copy that fits the memory and costs least;
- :mod:`.search` and :mod:`.verified`: the candidates a recommendation ranks, and which paths have
  run on which backend;
- :mod:`.step`: the step from its parts (compute + communication - hidden), the A/B command's
  prediction from a measured single-rank step and a profile.
"""
