"""A user's own callback, listed in YAML by the CLI tests."""

import json
from pathlib import Path

import lightning as L


class RecordLearningRates(L.Callback):
    """Writes the lr of the first param group at every step to ``path`` at the end of training."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lrs: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))

    def on_train_end(self, trainer, pl_module) -> None:
        Path(self.path).write_text(json.dumps(self.lrs))
