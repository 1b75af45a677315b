"""The shared-memory node data loader (a plugin): Megatron's sampler order (``samplers``), its
TP-rank-0 loader + broadcast as the fallback (``stock``), the node loader (``shm/``: its
producer, ring, segments and reader), the check of indexed
dataset files (``indexed``); ``loader.build_batch_iterator`` picks one. The main job's generated
corpus lives with the main job (``megatron_ext.trainer.corpus``)."""
