"""What several tests share, one module per subject: :mod:`.zero` (the small hierarchical ZeRO-3
runs), :mod:`.gpt` (the seeded tiny GPT), :mod:`.main_job` (the main job's small model as flags),
:mod:`.flash_overlap` (TP groups on the pool), :mod:`.attention` (dense attention references),
:mod:`.shm` (loader fixtures and the attacker user), :mod:`.megatron_samplers` (Megatron's sampler
order), :mod:`.upstream` (the upstream trees and their data), :mod:`.slurm` (a local Slurm),
:mod:`.fork_server` (the pools' fork server, started early) and :mod:`.waits` (bounded waits on
other processes)."""
