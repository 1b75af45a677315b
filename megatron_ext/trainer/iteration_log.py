"""The main job's iteration line, in Megatron-LM's fields, names and formats (``training_log`` in
``megatron/training/training.py``), so that log parsers written for Megatron read it: averages over
the log interval as Megatron takes them, then the suite's own figures after Megatron's fields, in
the same ``name: value |`` form."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


@dataclass
class Interval:
    """What the iterations since the last printed line did (Megatron's ``total_loss_dict``)."""

    iterations: int = 0
    seconds: float = 0.0
    loss_sum: float = 0.0
    advanced: int = 0
    """Iterations whose step was applied: the loss average is over these, as Megatron's."""
    skipped: int = 0
    """Iterations whose step the loss scaler skipped (an fp16 overflow)."""
    nan: int = 0
    """Applied iterations with a loss that is not finite."""

    def add(self, seconds: float, loss: float, skipped: bool) -> None:
        """Count one iteration."""
        self.iterations += 1
        self.seconds += seconds
        if skipped:
            self.skipped += 1
        elif not math.isfinite(loss):
            self.nan += 1
        else:
            self.advanced += 1
            self.loss_sum += loss


def loss_scale(engine: DeepSpeedEngine) -> float | None:
    """The fp16 loss scale the DeepSpeed engine applies, None where none is used (fp32, bf16)."""
    if not engine.fp16_enabled():
        return None
    optimizer = engine.optimizer
    config = getattr(optimizer, "loss_scale_config", None)  # DeepSpeed's ZeRO optimizers hold it here
    return float(config.cur_scale if config is not None else optimizer.cur_scale)


def iteration_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    interval: Interval,
    learning_rate: float,
    global_batch_size: int,
    scale: float | None,
    grad_norm: float | None,
    throughput: float | None,
    extras: Mapping[str, object],
) -> str:
    """One line as Megatron's ``training_log`` prints it (the timestamp, then ``iteration``,
    ``consumed samples``, ``elapsed time per iteration (ms)``, ``throughput per GPU (TFLOP/s/GPU)``
    where given, ``learning rate``, ``global batch size``, ``lm loss``, ``loss scale`` where one is
    used, ``grad norm`` where known, ``number of skipped iterations``, ``number of nan iterations``),
    followed by ``extras`` as ``name: value |``."""
    ms = interval.seconds * 1000.0 / max(1, interval.iterations)
    line = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
    line += f" iteration {iteration:8d}/{train_iters:8d} |"
    line += f" consumed samples: {consumed_samples:12d} |"
    line += f" elapsed time per iteration (ms): {ms:.1f} |"
    if throughput is not None:
        line += f" throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |"
    line += f" learning rate: {learning_rate:.6E} |"
    line += f" global batch size: {global_batch_size:5d} |"
    if interval.advanced:
        line += f" lm loss: {interval.loss_sum / interval.advanced:.6E} |"
    if scale is not None:
        line += f" loss scale: {scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    line += f" number of skipped iterations: {interval.skipped:3d} |"
    line += f" number of nan iterations: {interval.nan:3d} |"
    return line + "".join(f" {name}: {value} |" for name, value in extras.items())
