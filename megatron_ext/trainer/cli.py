"""The main job's flags: Megatron's names for the model, parallelism, training and data, plus the
suite's plugin flags (:mod:`megatron_ext.integration.args`)."""

from __future__ import annotations

import argparse
import difflib
from typing import NoReturn

from megatron_ext.integration.args import extra_args_provider
from megatron_ext.trainer.tokenizer import add_tokenizer_args

DESCRIPTION = (
    "Pretrain a megatron-core GPT under the DeepSpeed engine, with the suite's plugins when enabled. "
    "Without --data-path a small local corpus is generated; without CUDA it runs on CPU with gloo."
)


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except "None": a plugin flag not given leaves the DeepSpeed JSON's
    value, which its help names."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """A bad flag is one ``error:`` line with the nearest valid flag, not the whole usage (a
    job of many ranks would print that once per rank)."""

    def error(self, message: str) -> NoReturn:
        unknown = [w for w in message.partition(": ")[2].split() if w.startswith("--")]
        near = [
            m
            for w in unknown
            for m in difflib.get_close_matches(w, self._option_string_actions, n=1, cutoff=0.8)
        ]
        hint = f"did you mean {', '.join(near)}? " if near else ""
        self.exit(2, f"error: {message}; {hint}{self.prog} --help lists the flags\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed flags (``argv`` None: the command line)."""
    p = _Parser(
        prog="python scripts/pretrain_gpt.py", description=DESCRIPTION, formatter_class=_HelpWithDefaults
    )
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--bf16", action="store_true", help="bf16 parameters and activations")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    add_tokenizer_args(g)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g = p.add_argument_group("activation recomputation (Megatron's flags)")
    g.add_argument(
        "--recompute-granularity",
        choices=["full", "selective"],
        default=None,
        help="recompute activations in backward: each whole layer (full) or the attention core (selective)",
    )
    g.add_argument(
        "--recompute-method",
        choices=["uniform", "block"],
        default=None,
        help="with full: checkpoint groups of --recompute-num-layers layers (uniform), or only the first "
        "--recompute-num-layers layers (block)",
    )
    g.add_argument("--recompute-num-layers", type=int, default=None, help="with full: see --recompute-method")
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument(
        "--global-batch-size", type=int, default=None, help="default: micro batch x data-parallel size"
    )
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument(
        "--dataloader-type",
        choices=["single", "cyclic"],
        default="single",
        help="sample order: Megatron's sequential (single) or random (cyclic) sampler",
    )
    g = p.add_argument_group("data and checkpoints")
    g.add_argument(
        "--data-path", default=None, help="prefix of .bin/.idx files; default: a generated local corpus"
    )
    g.add_argument("--data-cache-path", default=None, help="where dataset indices (and the local corpus) go")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="stop (after saving, with --save) once the iteration count is a multiple of this",
    )
    g.add_argument("--deepspeed-config", "--deepspeed_config", dest="deepspeed_config", default=None)
    g.add_argument(
        "--log-json", default=None, help="also write per-iteration records to this JSON-lines file"
    )
    g.add_argument(
        "--tensorboard-dir",
        default=None,
        help="also write each iteration's figures as TensorBoard scalars here (rank 0; needs tensorboard)",
    )
    extra_args_provider(p)
    args = p.parse_args(argv)
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    return args
