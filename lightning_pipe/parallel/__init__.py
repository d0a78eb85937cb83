"""The world and its collectives: rank arithmetic, mesh and process groups (``topology``), gradient collectives
(``grads``), DTensor helpers (``dtensor``), FSDP2 stages (``fsdp``), tensor-parallel stages (``tensor_parallel``) and
the overlapped data-parallel sync (``dp_overlap``). Knows no schedule; nothing here is public API."""
