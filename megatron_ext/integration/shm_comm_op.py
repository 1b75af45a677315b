"""DeepSpeed's CPU shared-memory communication op, left unbuilt where training runs.

DeepSpeed 0.19's torch backend builds ``deepspeed_shm_comm`` when it starts (on a machine without
a GPU; ``deepspeed/comm/torch.py``, ``build_shm_op``), though only its ``inference_all_reduce``
uses it and training never calls that. The build is a JIT compile of 20 s to 2 minutes, repeated
whenever the virtualenv's or the checkout's path changes (its cache key holds them), each rank
prints ``built successfully``, and each leaves a 69 MB buffer in ``/dev/shm``. The main job and the
upstream launcher make the backend start without it.
"""

from __future__ import annotations

import sys

from mdsp_base.installer import Installer

OWNER = "megatron_ext.integration.shm_comm_op"


def without_shm_comm_op(installer: Installer) -> None:
    """Until ``installer`` closes, DeepSpeed's torch backend starts without its CPU shared-memory op."""
    import deepspeed.comm.torch  # noqa: F401  # its package binds the name "torch" to torch itself

    backend = sys.modules["deepspeed.comm.torch"]

    def build_shm_op() -> None:
        return None

    installer.setattr(
        OWNER, "DeepSpeed's CPU shared-memory comm op not built", backend, "build_shm_op", build_shm_op
    )
