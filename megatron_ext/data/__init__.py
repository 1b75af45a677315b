"""Data for the main job: the local corpus and GPTDataset (``gpt_dataset``), Megatron's sampler
order (``samplers``), its TP-rank-0 loader + broadcast (``stock``) and the shared-memory node loader
(``shm_private``, ``shm_segment``, ``ring``, ``producer``, ``readahead``, ``shm_loader``); ``loader.build_batch_iterator`` picks one."""
