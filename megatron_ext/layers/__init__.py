"""Flash-Overlap tensor/sequence-parallel linears.

* :mod:`~megatron_ext.layers.config`: the ``flash_overlap`` section (imports no megatron-core);
* :mod:`~megatron_ext.layers.linear`: the drop-in layers; :mod:`~megatron_ext.layers.p2p.linear`:
  their P2P backend over the schedules of :mod:`~megatron_ext.layers.p2p.overlap` and
  :mod:`~megatron_ext.layers.p2p.link`; :mod:`~megatron_ext.layers.symm_mem`: the backend on
  torch's fused symmetric-memory ops; :mod:`~megatron_ext.layers.backend`: which of the two, by
  evidence; :mod:`~megatron_ext.layers.wgrad`: GEMM precision and the weight gradient;
* :mod:`~megatron_ext.layers.spec`: the GPT layer spec (builds on :mod:`megatron_ext.integration.gpt`).
"""
