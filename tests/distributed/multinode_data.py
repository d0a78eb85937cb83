"""Model and data of the two-"node" test, shared by the ranks and the single-device reference."""

from __future__ import annotations

from torch.utils.data import DataLoader

from tests.models import ToyRegressor, loader, reference_train_loader, regression_data

STEPS = 3
ROWS_PER_REPLICA = 8


def make_model() -> ToyRegressor:
    return ToyRegressor(n_layers=6, seed=0)


def replica_loader() -> DataLoader:
    """What each replica is given; Lightning shards it with a DistributedSampler over the two replicas."""
    return loader(regression_data(64), ROWS_PER_REPLICA)


def reference_loader() -> DataLoader:
    """One device sees each step's global batch: both replicas' rows, in the DistributedSampler's order."""
    return reference_train_loader(regression_data(64), 2 * ROWS_PER_REPLICA)
