"""A rank's evaluation: the whole eval split forwarded through the (drained) training pipeline in eval
mode, and its metrics (AUC, NE, logloss, accuracy: `tpurec.dlrm.metrics`) over all ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tpurec.dlrm.training.data import TrainingData
    from tpurec.dlrm.training.model import ShardedModel
    from tpurec.dlrm.training.rank_run import RankRun
    from tpurec.dlrm.training.step import TrainingStep


def evaluate(run: RankRun, model: ShardedModel, step: TrainingStep, data: TrainingData) -> dict:
    """The metrics of the eval split (every rank calls it: the metrics gather over all ranks)."""
    import torch

    from tpurec.dlrm import metrics

    run.emulation.begin("eval")
    model.dmp.eval()
    if model.remap is not None:
        model.remap.reset_eval()  # the eval figures are this evaluation's
    logits, labels = [], []
    it = data.eval_batches()
    with torch.no_grad():
        while True:
            try:
                _, lo, la = step.pipeline.progress(it)
            except StopIteration:
                break
            logits.append(lo)
            labels.append(la)
    model.dmp.train()
    rows = data.readers.eval_rows
    lo = torch.cat(logits)[:rows]  # drop the padding of the last batch
    la = torch.cat(labels)[:rows]
    return metrics.compute(*metrics.gather(lo, la))
