"""Flash-Overlap's P2P backend: the linears' autograd functions (:mod:`.linear`) over the step
schedules (:mod:`.overlap`), the send/receive pairs of each step (:mod:`.link`), and the all-to-all
of Ulysses attention in P2P steps (:mod:`.all_to_all`)."""
