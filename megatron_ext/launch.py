"""Run an upstream ``pretrain_gpt.py`` (Megatron-LM core_v0.16.1 or Megatron-DeepSpeed) in this process.

    torchrun --nproc-per-node 4 -m megatron_ext.launch PATH/TO/pretrain_gpt.py [upstream flags...]
    srun -n 4 python -m megatron_ext.launch PATH/TO/pretrain_gpt.py [upstream flags...]

Before the script runs, the launcher
* sets ``LOCAL_SIZE`` (Megatron-DeepSpeed reads it; torchrun sets ``LOCAL_WORLD_SIZE`` only), and
  under srun ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` from Slurm's variables
  when they are unset (a variable already set is never changed);
* puts this interpreter's directories first on ``PATH``: upstream compiles its dataset helper with
  ``make``, which asks ``python3`` for pybind11 and the extension suffix;
* adds stand-ins for the modules in :data:`megatron_ext.upstream.standins.STANDINS` that are not installed;
* on a machine without CUDA: for Megatron-LM :func:`megatron_ext.upstream.cpu.enable`; for
  Megatron-DeepSpeed (which goes through DeepSpeed's accelerator)
  :func:`megatron_ext.upstream.cpu.enable_megatron_deepspeed`, one gloo shape rule;
* gives the suite's loggers (``megatron_ext``, ``deepspeed_ext``) a handler at INFO when they have
  none, so the effective plugin configuration is printed also where the script configures no logging;
then runs the script as ``__main__`` with the script's directory first on ``sys.path``, as
``python pretrain_gpt.py`` would, and undoes the process-wide changes afterwards. When the script
ends normally (returns, or exits with status 0) it destroys the process groups the script created
and left: upstream's ``pretrain`` never does, and a backend thread that drops a tensor's last
reference while the interpreter finalizes cannot take the GIL, which can abort a rank that trained
successfully ("terminate called without an active exception"). A failing script keeps its groups:
its peers may still be inside a collective, which a destroy would wait on.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
import sysconfig

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


def _log_plugins() -> list[tuple[logging.Logger, logging.Handler, int, bool]]:
    """A stderr handler at INFO on each suite logger without one; returns what to undo."""
    changed = []
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if logger.handlers:
            continue
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:%(name)s:%(message)s"))
        changed.append((logger, handler, logger.level, logger.propagate))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # a root handler the script adds later would print each line twice
    return changed


def run(script: str, args: list[str]) -> None:
    """Run the upstream ``script`` with ``args`` as described in the module docstring."""
    from megatron_ext.upstream import standins

    if not script.endswith(".py") or not os.path.isfile(script):
        raise LaunchError(f"{script!r} is not a Python file: pass the path of the upstream pretrain_gpt.py")
    kind = upstream_kind(script)
    saved_env, saved_path, saved_argv = dict(os.environ), list(sys.path), list(sys.argv)
    os.environ.update(launch_env(dict(os.environ)))
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    sys.argv = [script, *args]
    standins.install()
    logged = _log_plugins()
    cpu_mode = None
    try:
        from megatron_ext.upstream import cpu as cpu_upstream

        enable = cpu_upstream.enable if kind == MEGATRON_LM else cpu_upstream.enable_megatron_deepspeed
        cpu_mode = cpu_upstream if enable() else None
        started = _distributed_started()
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            if exc.code in (None, 0) and not started:
                _destroy_process_groups()
            raise
        if not started:
            _destroy_process_groups()
    finally:
        if cpu_mode is not None:
            cpu_mode.disable()
        standins.uninstall()
        for logger, handler, level, propagate in logged:
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.environ.clear()
        os.environ.update(saved_env)


def _distributed_started() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _destroy_process_groups() -> None:
    """Destroy every process group while the interpreter is alive: their threads end now, after
    the work they hold (a script that ends normally has matched every collective)."""
    import torch.distributed as dist

    if _distributed_started():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (2 with one ``error:`` line on bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        return 0 if argv else 2
    try:
        run(argv[0], argv[1:])
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
