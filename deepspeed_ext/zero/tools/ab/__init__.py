"""The A/B command: stock ZeRO-3, DeepSpeed's hpZ (and ZeRO++ where its kernels build) and ours on
one model, side by side: its flags (:mod:`.cli`), the variants (:mod:`.variants`), the model
(:mod:`.model`), the run (:mod:`.run`), the prediction read before the timing (:mod:`.prediction`),
the time ranks wait on a gather (:mod:`.gather_wait`) and the report (:mod:`.report`)."""
