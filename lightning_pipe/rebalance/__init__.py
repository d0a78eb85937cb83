"""Dynamic rebalancing: move layers between pipeline ranks mid-run when measured times say another split is faster
(:class:`~lightning_pipe.rebalance.rebalancer.Rebalancer`; measure.py, decide.py, move.py). The Lightning side is
``lightning_pipe/lightning/rebalancing.py``; this package does not import Lightning."""

from lightning_pipe.rebalance.decide import Decision, LayerTime, Move, decide
from lightning_pipe.rebalance.rebalancer import RebalanceEvent, Rebalancer, check_rebalance

__all__ = ["Decision", "LayerTime", "Move", "RebalanceEvent", "Rebalancer", "check_rebalance", "decide"]
