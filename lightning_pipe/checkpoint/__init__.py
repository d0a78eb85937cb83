"""Sharded checkpoints that outlive the pipeline layout that wrote them (see [Note: checkpoint format]).

``format`` says what a checkpoint holds, ``files`` writes it on disk (atomically), ``reading`` reads it — as data
unless trusted (``trust``, ``reader``, ``plain``: [Note: a checkpoint is data]) —, ``checksums`` guards its bytes,
``convert`` turns it into one ordinary ``.ckpt`` and back. ``python -m lightning_pipe.checkpoint
consolidate|shard|info`` is the command line. Plain torch: nothing here imports Lightning.
"""

from lightning_pipe.checkpoint.checksums import read_checksums, verify_checksums
from lightning_pipe.checkpoint.convert import as_file, checkpoint_size, consolidate, consolidated, shard
from lightning_pipe.checkpoint.files import (
    aside_path,
    commit,
    partial_path,
    recover,
    remove,
    save_file_atomic,
    write_shards,
)
from lightning_pipe.checkpoint.format import (
    CHECKSUMS_FILENAME,
    DCP_METADATA,
    FORMAT,
    META_FILENAME,
    MODEL_PREFIX,
    NAMES_KEY,
    CheckpointError,
    ModuleNames,
    ShardedOptimizerState,
)
from lightning_pipe.checkpoint.reading import describe, load_file, read_sharded_metadata

__all__ = [
    "CHECKSUMS_FILENAME", "DCP_METADATA", "FORMAT", "META_FILENAME", "MODEL_PREFIX", "NAMES_KEY", "CheckpointError", "aside_path",
    "ModuleNames", "ShardedOptimizerState", "as_file", "checkpoint_size", "commit", "consolidate", "consolidated",
    "describe", "load_file", "partial_path", "read_checksums", "read_sharded_metadata", "recover", "remove",
    "save_file_atomic", "shard", "verify_checksums", "write_shards",
]
