"""Sharded checkpoints that outlive the pipeline layout that wrote them (see [Note: checkpoint format]).

``python -m lightning_pipe.checkpoint consolidate|shard|info`` is the command line.
"""

from lightning_pipe.checkpoint.format import (
    CheckpointError,
    DCP_METADATA,
    FORMAT,
    META_FILENAME,
    MODEL_PREFIX,
    ModuleNames,
    NAMES_KEY,
    ShardedOptimizerState,
    as_file,
    build_local_optimizer_state,
    check_groups,
    checkpoint_size,
    commit,
    consolidate,
    consolidated,
    describe,
    flatten_optimizer,
    load_file,
    load_flat,
    merge_groups,
    name_mismatch_message,
    names_from_positions,
    optimizer_entries,
    partial_path,
    read_sharded_metadata,
    save_file_atomic,
    split,
    tied_canonical,
    write_shards,
)
