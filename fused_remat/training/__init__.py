"""The training application: ``python -m fused_remat.train`` (or ``python -m fused_remat.training``).
It sits on top of the op library (it imports ``fused_remat``'s model, planner and meter; the
library never imports it). Modules:

    cli.py          the command line: argparse flags -> TrainConfig, main() with its exit statuses
    config.py       TrainConfig (every setting of a run, defaults by device and preset), parse_size
    step.py         train_step (forward under autocast, backward, clipping, AdamW step, zero_grad),
                    make_optimizer, forward_loss: the one step of training, capacity and bench
    graphs.py       GraphedTrainStep: train_step captured as one CUDA graph (--cuda-graphs), and
                    the refusals of what a replay would ignore or a graph cannot hold
    loop.py         train(): data, model and remat policies, resume, the step loop, evaluation,
                    metrics, checkpoints, Ctrl-C, and the failures: a checkpoint after an error,
                    a stop (or a skip) on a NaN, the header naming the backend that runs
    data.py         the token sources (stdlib corpus, text, nanoGPT .bin), checked when loaded, and
                    deterministic batches
    distributed.py  torchrun: process group, DDP/FSDP2 wrapping, gradient sync, state dicts
    checkpoint.py   atomic, rotated checkpoints; the checks made before resuming and the fallback
                    to a predecessor; stale partial files; write errors that say why
    reporting.py    the progress line, metrics.jsonl, the training plot
    capacity.py     --find-max-seq-len: the longest trainable sequence per remat policy
"""

from .graphs import GraphedTrainStep
from .step import make_optimizer, set_learning_rate, train_step

__all__ = ["GraphedTrainStep", "make_optimizer", "set_learning_rate", "train_step"]
