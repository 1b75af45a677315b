"""Upstream training scripts with the plugins: Megatron-LM (core_v0.16.1) and Megatron-DeepSpeed (4efb479).

* :mod:`.hooks`: what both share (plugin flags, effective configuration, data iterators);
* :mod:`.megatron_lm` and :mod:`.megatron_deepspeed`: what each script calls through ``patches/``;
* :mod:`.layer_specs`: the blocks behind Megatron-LM's ``--spec megatron_ext.integration.upstream.megatron_lm <name>``;
* :mod:`.scripts_on_cpu` and :mod:`.standins`: what ``python -m megatron_ext.launch`` installs so that the
  scripts run on a machine without CUDA, undone when the script returns;
* :mod:`.startup`: the plugin configuration and NCCL's transport checked around the script's process group.
"""
