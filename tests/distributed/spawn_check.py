"""``python -m tests.distributed.spawn_check``: strategy="pipeline_spawn" from a plain script (as in a notebook).

The main process must end up with the trained weights of *every* stage, equal to a single-device run.
"""

import copy

import lightning.pytorch as L
import torch

import lightning_pipe  # noqa: F401
from tests.models import ToyRegressor, loader, reference_train_loader, regression_data


def fit(model, strategy, devices, train_loader):
    L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=3, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(model, train_loader)


if __name__ == "__main__":
    data = regression_data(64)
    model = ToyRegressor()
    reference = copy.deepcopy(model)
    fit(model, "pipeline_spawn", 2, loader(data, 8))
    fit(reference, "auto", 1, reference_train_loader(data, 8))
    for (name, got), (_, want) in zip(model.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    print("SPAWN_PARITY_OK")
