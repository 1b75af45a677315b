"""The base of megatron-deepspeed-plugins (``mdsp``): what every plugin of the suite may import, and
nothing below it: the strict base of a plugin's configuration section (:mod:`.section`), where ranks
sit and the process groups of each level (:mod:`.topology`), the byte counters of collectives
(:mod:`.comm`), the owner of process-wide changes (:mod:`.installer`) and how the suite's programs
exit (:mod:`.shutdown`); and, as package data, the suite's model and DeepSpeed presets
(``presets/``, which ``scripts/presets`` links to). Nothing here imports a plugin."""
