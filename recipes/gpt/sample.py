"""Generate text from a trained GPT on one device.

    python recipes/gpt/sample.py --ckpt outputs/<date>/<time>/checkpoints/last.ckpt --prompt "def " --tokens 300

Bytes are decoded with ``errors="replace"`` (a byte-level model can cut a UTF-8 character in half).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from lightning_pipe.checkpoint import consolidated  # noqa: E402
from recipes.gpt.model import GPT  # noqa: E402


def load_gpt(ckpt_path: str | Path, weights_only: bool | None = None) -> GPT:
    """Build the GPT from a checkpoint: hyper-parameters + ``state_dict`` with the plain model's ``layers.*`` names.

    Reads an ordinary Lightning ``.ckpt`` file or a sharded pipeline checkpoint directory, both through
    ``lightning_pipe.checkpoint.consolidated`` (which verifies a directory's checksums first), as data unless
    ``weights_only=False`` trusts its source.
    """
    ckpt = consolidated(ckpt_path, weights_only)
    model = GPT(**ckpt["hyper_parameters"])
    # A partial checkpoint (one pipeline stage's layers) must fail loudly rather than sample from random layers.
    missing = sorted({k.split(".")[1] for k in model.state_dict()} - {k.split(".")[1] for k in ckpt["state_dict"]})
    if missing:
        raise ValueError(
            f"{ckpt_path} lacks layers {', '.join(missing)} of the GPT: it holds one pipeline stage only. "
            "Sample from a checkpoint of a single-device run (strategy=single), or a consolidated one."
        )
    model.load_state_dict(ckpt["state_dict"], strict=True)
    # Tying survives load_state_dict (it copies into the shared Parameter); check it anyway.
    if model.layers[-1].head.weight is not model.layers[0].wte.weight:
        raise RuntimeError("The GPT's output head is no longer tied to its token embedding after loading "
                           f"{ckpt_path}: GPT.__init__ must tie them (layers[-1].head.weight is layers[0].wte.weight).")
    return model.eval()


def encode(prompt: str, vocab_size: int) -> list[int]:
    if vocab_size != 256:
        raise ValueError(
            f"This sampler speaks bytes (vocab 256); the checkpoint's vocabulary is {vocab_size}. "
            "Token-level models need their tokenizer, which this recipe does not download."
        )
    return list(prompt.encode("utf-8")) or [ord("\n")]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True, help="Lightning .ckpt written by recipes/gpt/train.py")
    parser.add_argument("--prompt", default="import ", help="text to continue")
    parser.add_argument("--tokens", type=int, default=200, help="new tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--trust", action="store_true",
                        help="the checkpoint comes from a source you trust: unpickle any object it holds (which can "
                             "run code from the file); without it, the checkpoint is read as data")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    model = load_gpt(args.ckpt, weights_only=False if args.trust else None)
    prompt = torch.tensor([encode(args.prompt, model.hparams.vocab_size)] * args.num_samples, dtype=torch.long)
    out = model.generate(prompt, args.tokens, temperature=args.temperature, top_k=args.top_k)
    texts = [bytes(row.tolist()).decode("utf-8", errors="replace") for row in out]
    text = "\n---------------\n".join(texts)
    print(text)
    return text


if __name__ == "__main__":
    main()
