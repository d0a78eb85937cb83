"""Example recipes built on lightning_pipe (not part of the installed package)."""
