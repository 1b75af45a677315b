"""What runs inside a training step: the levels and their process groups (:mod:`.levels`), the hop
collectives (:mod:`.hops`, :mod:`.p2p_hops`, :mod:`.hop_worker`, :mod:`.quantize`), the gradient
reduction (:mod:`.grad_sync`), DeepSpeed's dispatchers swapped for them (:mod:`.inject`), the
build under ``Init`` (:mod:`.construction`, :mod:`.meta_build`), the checks of DeepSpeed's contract
(:mod:`.contract`), the plan types (:mod:`.hierarchical_plan`), the plans of this process
(:mod:`.known_plans`) and the entry point :func:`.api.initialize`. It reads the section (:mod:`..config`) and the cost model (:mod:`..cost`)."""
