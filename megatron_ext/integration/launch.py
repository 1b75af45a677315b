"""Run an upstream ``pretrain_gpt.py`` (Megatron-LM core_v0.16.1 or Megatron-DeepSpeed) in this process.

    torchrun --nproc-per-node 4 -m megatron_ext.launch PATH/TO/pretrain_gpt.py [upstream flags...]
    srun -n 4 python -m megatron_ext.launch PATH/TO/pretrain_gpt.py [upstream flags...]

The upstream scripts assume what a plain ``torchrun`` or ``srun`` does not give them everywhere: the
launcher sets it up (rendezvous variables, ``PATH``, stand-ins, the CPU mapping, the suite's loggers,
the start-up checks around ``init_process_group``), runs the script as ``__main__`` and undoes every
change afterwards. A refusal ends as one ``error:`` line and exit status 2 (docs/integration.md,
"Launching").
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
import sysconfig

from mdsp_base.installer import Installer
from mdsp_base.section import ConfigError
from megatron_ext.integration.refusal import refuse
from megatron_ext.integration.shm_comm_op import without_shm_comm_op

MEGATRON_LM = "Megatron-LM"
MEGATRON_DEEPSPEED = "Megatron-DeepSpeed"
USAGE = "usage: python -m megatron_ext.launch PATH/TO/pretrain_gpt.py [upstream flags...]"


class LaunchError(Exception):
    """Bad input to the launcher; the message names the problem and the fix."""


def upstream_kind(script: str) -> str:
    """Which upstream tree ``script`` belongs to, from the layout of its ``megatron`` package."""
    tree = os.path.dirname(os.path.abspath(script))
    if os.path.isfile(os.path.join(tree, "megatron", "training", "initialize.py")):
        return MEGATRON_LM
    if os.path.isfile(os.path.join(tree, "megatron", "training.py")):
        return MEGATRON_DEEPSPEED
    raise LaunchError(
        f"{script} is not in the root of a Megatron-LM or Megatron-DeepSpeed checkout (no "
        f"megatron/training package or megatron/training.py beside it): pass the upstream "
        "checkout's pretrain_gpt.py"
    )


def _tasks_per_node(value: str) -> str:
    """Slurm's SLURM_NTASKS_PER_NODE / SLURM_STEP_TASKS_PER_NODE look like '4' or '4(x2),3'."""
    return value.split(",")[0].split("(")[0]


def launch_env(environ: dict[str, str]) -> dict[str, str]:
    """The variables to add to ``environ`` (never one that is set) for the upstream script."""
    added: dict[str, str] = {}
    slurm = {
        "RANK": environ.get("SLURM_PROCID"),
        "WORLD_SIZE": environ.get("SLURM_NTASKS"),
        "LOCAL_RANK": environ.get("SLURM_LOCALID"),
    }
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_NTASKS_PER_NODE")
    if "RANK" not in environ and slurm["RANK"] is not None:  # srun without torchrun
        added.update({k: v for k, v in slurm.items() if v is not None and k not in environ})
        if per_node and "LOCAL_WORLD_SIZE" not in environ:
            added["LOCAL_WORLD_SIZE"] = _tasks_per_node(per_node)
    merged = {**environ, **added}
    if "LOCAL_SIZE" not in merged:
        if "LOCAL_WORLD_SIZE" in merged:
            added["LOCAL_SIZE"] = merged["LOCAL_WORLD_SIZE"]
        elif per_node:
            added["LOCAL_SIZE"] = _tasks_per_node(per_node)
        elif merged.get("WORLD_SIZE", "1") == "1":
            added["LOCAL_SIZE"] = "1"
        else:
            raise LaunchError(
                "cannot tell the ranks per node: WORLD_SIZE is set but neither LOCAL_WORLD_SIZE "
                "(torchrun) nor SLURM_NTASKS_PER_NODE (srun) is; set LOCAL_SIZE=<ranks per node>"
            )
    if int(merged.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" not in merged:
        raise LaunchError(
            "WORLD_SIZE > 1 but MASTER_ADDR is unset: under srun export MASTER_ADDR and MASTER_PORT "
            "(the suite's Slurm scripts do), or start the ranks with torchrun"
        )
    dirs = [os.path.dirname(sys.executable), sysconfig.get_path("scripts", vars={"base": sys.base_prefix})]
    path = environ.get("PATH", "")
    added["PATH"] = os.pathsep.join(dict.fromkeys([*dirs, *path.split(os.pathsep)])).rstrip(os.pathsep)
    return added


_LOGGERS = ("megatron_ext", "deepspeed_ext", "plugin_config")
OWNER = __name__
logger = logging.getLogger(OWNER)


def _log_plugins(installer: Installer) -> None:
    """A stderr handler at INFO on each suite logger without one."""
    for name in _LOGGERS:
        suite_logger = logging.getLogger(name)
        if suite_logger.handlers:
            continue
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:%(name)s:%(message)s"))
        level, propagate = suite_logger.level, suite_logger.propagate
        suite_logger.addHandler(handler)
        suite_logger.setLevel(logging.INFO)
        suite_logger.propagate = False  # a root handler the script adds later would print each line twice

        def restore(
            log: logging.Logger = suite_logger,
            h: logging.Handler = handler,
            lv: int = level,
            pr: bool = propagate,
        ) -> None:
            log.removeHandler(h)
            log.setLevel(lv)
            log.propagate = pr

        installer.add(OWNER, "a stderr handler at INFO on the suite's loggers that have none", restore)


def _prepare(installer: Installer, script: str, args: list[str], kind: str) -> None:
    """Every change the upstream script needs, made through ``installer``."""
    from megatron_ext.integration.upstream import hooks, standins, startup
    from megatron_ext.integration.upstream import scripts_on_cpu as cpu_upstream

    saved_env, saved_path, saved_argv = dict(os.environ), list(sys.path), list(sys.argv)
    added = launch_env(dict(os.environ))
    os.environ.update(added)

    def restore_env() -> None:
        os.environ.clear()
        os.environ.update(saved_env)

    installer.add(
        OWNER,
        "the environment: rendezvous variables, LOCAL_SIZE and PATH, and what the script sets",
        restore_env,
    )
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    installer.add(
        OWNER,
        "sys.path: the script's directory first",
        lambda: sys.path.__setitem__(slice(None), saved_path),
    )
    sys.argv = [script, *args]
    installer.add(OWNER, "sys.argv: the script's", lambda: setattr(sys, "argv", saved_argv))
    standins.install()
    installer.add(
        "megatron_ext.integration.upstream.standins",
        "stand-ins for modules that are not installed",
        standins.uninstall,
    )
    _log_plugins(installer)
    startup.check_around_process_group(installer)  # the plugins and NCCL's network, before heavy work
    if kind == MEGATRON_DEEPSPEED:  # Megatron-LM trains without DeepSpeed
        without_shm_comm_op(installer)
    enable = cpu_upstream.enable if kind == MEGATRON_LM else cpu_upstream.enable_megatron_deepspeed
    if enable():
        installer.add(
            "megatron_ext.integration.upstream.scripts_on_cpu",
            "the upstream tree's CUDA calls mapped to the CPU (no CUDA)",
            cpu_upstream.disable,
        )
    installer.enter(OWNER, "the owner of the upstream hooks' changes", hooks.owning(installer))


def run(script: str, args: list[str]) -> None:
    """Run the upstream ``script`` with ``args`` as described in the module docstring."""
    if not script.endswith(".py") or not os.path.isfile(script):
        raise LaunchError(f"{script!r} is not a Python file: pass the path of the upstream pretrain_gpt.py")
    kind = upstream_kind(script)
    with Installer() as installer:
        _prepare(installer, script, args, kind)
        # the script returned, exited 0 or refused (every rank at the same point): its peers are past
        # every collective too
        ended = [False]
        if not _distributed_started():
            installer.add(
                OWNER,
                "the process groups the script leaves (destroyed when it ends normally)",
                lambda: _destroy_process_groups() if ended[0] else None,
            )
        refused = False
        try:
            runpy.run_path(script, run_name="__main__")
            ended[0] = True
        except SystemExit as exc:
            ended[0] = exc.code in (None, 0)
            raise
        except ConfigError:
            ended[0] = refused = True
            raise
        finally:
            if not refused:  # a refusal is the one error line
                logger.info(
                    "undoing the run's process-wide changes, newest first: %s",
                    "; ".join(f"{c.owner}: {c.what}" for c in reversed(installer.changes)),
                )


def _distributed_started() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _destroy_process_groups() -> None:
    """Destroy every process group while the interpreter is alive: their threads end now, after
    the work they hold (a script that ends normally, or refuses on every rank at the same point, has
    matched every collective). Upstream's ``pretrain`` never does, and a backend thread that drops a
    tensor's last reference while the interpreter finalizes cannot take the GIL, which can abort a
    rank that trained ("terminate called without an active exception"). A script that fails
    otherwise keeps its groups: its peers may still be inside a collective a destroy would wait on."""
    import torch.distributed as dist

    if _distributed_started():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code: 2 on bad input or a refusal of the plugin
    configuration or the network transport (:mod:`megatron_ext.integration.upstream.startup`), with
    one ``error:`` line from the first rank of each node (:func:`~megatron_ext.integration.refusal.refuse`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        return 0 if argv else 2
    try:
        run(argv[0], argv[1:])
    except (LaunchError, ConfigError) as exc:
        return refuse(exc)
    return 0
