"""PipeMare: its rule as numbers (``rule``: delays, learning-rate factor, velocity decay, options), its stage
(``stages``) and spec (``spec``); the Lightning-loop rules are PipeDream's (``lightning_pipe/lightning/microbatch_updates.py``)."""
