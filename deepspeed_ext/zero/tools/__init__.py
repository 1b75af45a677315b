"""What a user runs before and beside training: the probe of the collectives (:mod:`.probe`,
``python -m deepspeed_ext.zero.probe``), the recommendation of a configuration from the cost model
(:mod:`.recommend`, ``python -m deepspeed_ext.zero.plan``) and the A/B command (:mod:`.ab`,
``python -m deepspeed_ext.zero.bench``). Built on the engine and the cost model; nothing imports it."""
