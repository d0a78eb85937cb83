"""The user's layer list: cut it into stages (``partition``, ``stages``), feed it batches and read its loss
(``batches``). Knows no process group and no schedule."""
