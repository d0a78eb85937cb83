"""``python -m lightning_pipe.checkpoint consolidate|shard|info ...``: convert and inspect checkpoints."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from lightning_pipe.checkpoint.checksums import read_checksums
from lightning_pipe.checkpoint.convert import checkpoint_size, consolidate, consolidated, shard
from lightning_pipe.checkpoint.files import recover
from lightning_pipe.checkpoint.format import CheckpointError
from lightning_pipe.checkpoint.reading import describe

TRUST_HELP = ("the checkpoint comes from a source you trust: unpickle any object it holds, which can run code from "
              "the file. Without it a checkpoint is read as data (tensors, numbers, strings, containers, the types "
              "registered with torch.serialization.add_safe_globals) and anything else is refused; what "
              "lightning_pipe writes needs no trust")
EPILOG = ("A checkpoint from someone else (a shared directory, a download, a colleague's archive) can hold pickled "
          "objects whose loading runs code. Every command reads checkpoints as data unless --trust is given; see "
          "docs/checkpoints.md, \"Checkpoints from others\".")


def _info(path: str, weights_only: bool | None) -> str:
    kind = describe(path)
    ckpt = consolidated(path, weights_only)  # verifies the checksums of a sharded directory
    n = sum(v.numel() for v in ckpt["state_dict"].values() if isinstance(v, Tensor))
    checked = read_checksums(Path(path)) if kind == "sharded" else None
    integrity = ("" if kind == "file" else f", checksums of {len(checked)} files verified" if checked is not None
                 else ", no checksums (written before lightning_pipe recorded them)")
    return (f"{path}: {kind} checkpoint, {len(ckpt['state_dict'])} tensors ({n:,} elements), "
            f"{len(ckpt.get('optimizer_states') or [])} optimizer(s), epoch {ckpt.get('epoch')}, "
            f"global_step {ckpt.get('global_step')}, {checkpoint_size(path) / 2**20:.2f} MiB on disk{integrity}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 with the reason on stderr for a bad checkpoint)."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_pipe.checkpoint", epilog=EPILOG,
        description="Convert between lightning_pipe's sharded checkpoint directories and single-file .ckpt files. "
                    "Every command verifies a sharded directory's checksums before reading it.")
    trust = argparse.ArgumentParser(add_help=False)
    trust.add_argument("--trust", action="store_true", help=TRUST_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", parents=[trust], epilog=EPILOG,
                       help="sharded directory -> one .ckpt loadable on one device (first puts back a checkpoint left "
                            "aside by a save interrupted between its two renames)")
    c.add_argument("src")
    c.add_argument("dst")
    s = sub.add_parser("shard", parents=[trust], epilog=EPILOG,
                       help="single .ckpt (from `consolidate`, or weights only) -> sharded directory")
    s.add_argument("src")
    s.add_argument("dst")
    i = sub.add_parser("info", parents=[trust], epilog=EPILOG, help="print what a checkpoint holds (reads only)")
    i.add_argument("path")
    args = parser.parse_args(argv)
    weights_only = False if args.trust else None
    try:
        if args.command == "consolidate":
            out = consolidate(recover(Path(args.src)), args.dst, weights_only)
            print(f"wrote {out} ({checkpoint_size(out) / 2**20:.2f} MiB)")
        elif args.command == "shard":
            out = shard(args.src, args.dst, weights_only)
            print(f"wrote {out}/ ({checkpoint_size(out) / 2**20:.2f} MiB)")
        else:
            print(_info(args.path, weights_only))
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
