"""The upstream run's start-up checks, made around the script's ``torch.distributed.init_process_group``.

In both trees the group is made after the flags are parsed and before the dataset, model and
DeepSpeed: the first point where the job's whole configuration is known, the last before heavy
work. Before the group, the hooks' plugin configuration is checked (and cached for the hooks that
ask later); after it, on NCCL, the network transport. A refusal raises ``ConfigError`` on every
rank, which ``python -m megatron_ext.launch`` prints as one ``error:`` line, exit status 2. Both
trees find the wrapper by attribute at call time (Megatron-DeepSpeed through DeepSpeed's
``init_distributed``).
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

import torch.distributed as dist

from mdsp_base.installer import Installer
from megatron_ext.integration import transport
from megatron_ext.integration.args import has_plugin_flags
from megatron_ext.integration.upstream.hooks import plugin_config

OWNER = __name__
# Where each tree keeps Megatron's global args (Megatron-LM's, Megatron-DeepSpeed's).
GLOBAL_VARS = ("megatron.training.global_vars", "megatron.global_vars")


def parsed_args() -> argparse.Namespace | None:
    """Megatron's global ``args`` once ``initialize_megatron`` has set them, else None (read from
    the module: its ``get_args`` asserts before)."""
    for name in GLOBAL_VARS:
        args = getattr(sys.modules.get(name), "_GLOBAL_ARGS", None)
        if args is not None:
            return args
    return None


def check_plugins() -> None:
    """The plugin configuration checked, where the job's args are set and hold the suite's flags."""
    args = parsed_args()
    if args is not None and has_plugin_flags(args):
        plugin_config(args)


def check_around_process_group(installer: Installer) -> None:
    """Wrap ``torch.distributed.init_process_group`` (through ``installer``) with the module's checks:
    the plugins before the group, NCCL's transport after it where its init log is captured."""
    checks_transport = transport.capture_init_log(installer)
    original = dist.init_process_group

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        check_plugins()
        result = original(*args, **kwargs)
        if checks_transport:
            transport.check_transport()
        return result

    installer.setattr(
        OWNER,
        "torch.distributed.init_process_group: the plugin configuration checked before the group, "
        "NCCL's transport after it",
        dist,
        "init_process_group",
        init_process_group,
    )
