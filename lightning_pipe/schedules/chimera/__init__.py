"""Chimera: its spec and merged order (``spec``), the one-thread runtime driving two pipelines (``runtime``) and the
engine with its process groups and gradient rules (``engine``)."""
