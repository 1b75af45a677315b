"""The layer above the plugins: it imports them, none imports it. The assembler of every plugin's
section (:mod:`.plugin_config`), Megatron's flags (:mod:`.args`), the GPT builder (:mod:`.gpt`),
megatron-core on CPU (:mod:`.core_on_cpu`), DeepSpeed's ``mpu`` (:mod:`.mpu`), the partitioned
build (:mod:`.partitioned_build`), the upstream scripts' hooks (:mod:`.upstream`) and their
launcher (:mod:`.launch`, ``python -m megatron_ext.launch``)."""
