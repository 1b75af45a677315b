"""The module names that patched upstream trees and Megatron-LM's ``--spec`` import:
``megatron_ext.upstream.megatron_lm`` and ``megatron_ext.upstream.megatron_deepspeed`` are the
modules of :mod:`megatron_ext.integration.upstream` under their published names (one module object
each, so their hooks and PEP 562 attributes are the same)."""

import sys

from megatron_ext.integration.upstream import megatron_deepspeed, megatron_lm

for _module in (megatron_lm, megatron_deepspeed):
    sys.modules[f"{__name__}.{_module.__name__.rsplit('.', 1)[1]}"] = _module
