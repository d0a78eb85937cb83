"""PipeDream-2BW and PipeDream: their specs (``spec``) and the weight-versioned / weight-stashing stages they run
(``stages``); the Lightning-loop rules are in ``lightning_pipe/lightning/microbatch_updates.py``."""
