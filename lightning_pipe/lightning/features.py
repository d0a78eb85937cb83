"""Lightning features the strategy adapts to a split module at each setup, undone at teardown: prediction writers
([Note: collectives over the data ranks] in collectives.py) and the model summary ([Note: the model summary of a
split model] in summary.py). docs/features.md lists every everyday Lightning feature under the pipeline."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn

from lightning_pipe.lightning.collectives import writers_on_data_ranks
from lightning_pipe.lightning.summary import summaries_of_whole_model

# ``strategy`` is the PipelineStrategy (typed Any: strategy.py imports this module).


def adapt_features(strategy: Any, trainer: Trainer) -> Callable[[], None]:
    """Adapt the trainer's callbacks to this rank's part of the module; returns the undo. Collective where a model
    summary will print (every rank alike)."""
    undos = [writers_on_data_ranks(trainer, strategy._topology())]
    module, engine = strategy.lightning_module, strategy.engine
    if trainer.state.fn == TrainerFn.FITTING and engine is not None and module is not None:
        layout = getattr(module, "_pipeline_layout", None)
        aliases = {name for tie in (layout.tied if layout is not None else ()) for name in tie.names[1:]}
        undos.append(summaries_of_whole_model(trainer, module, engine, strategy.pipeline_config.layers_attr,
                                              aliases))

    def undo() -> None:
        for step in undos:
            step()

    return undo


__all__ = ["adapt_features"]
