"""``python -m trainer.generate RUN_DIR --prompt "text"``: continue a prompt with a trained language model.

The run folder alone is enough: its network is rebuilt and loaded as export does it (the saved
config, the best or last checkpoint), and its tokenizer is the ``tokenizer.json`` the text data
module wrote beside them. Prints the prompt and its continuation, up to the end-of-text token.
Sampling is `trainer.models.gpt.generate`, with its KV cache (`--no-cache`: the whole context for
each token, the same tokens). A user mistake is one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any, Optional

from trainer.infra.errors import UserError, exception_line, one_line_on_user_error
from trainer.infra.extras import require

#: Where the text data module saves the tokenizer it trained, in the run folder.
TOKENIZER_NAME = "tokenizer.json"
PROG = "python -m trainer.generate"


def main(argv: Optional[list[str]] = None) -> None:
    args = _parser().parse_args(argv)
    with one_line_on_user_error():
        print(continue_prompt(args.run_dir, args.prompt, max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, top_k=args.top_k, greedy=args.greedy,
                              which=args.checkpoint, seed=args.seed, device=args.device, cache=not args.no_cache))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Continue a prompt with a language model trained "
                                                            "by this framework (data=text, model=gpt).")
    parser.add_argument("run_dir", type=Path, help="a run folder (or a .ckpt in its checkpoints/)")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=100, help="tokens to add (default 100)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="divides the logits before sampling: lower is more conservative (default 0.8)")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (default 50)")
    parser.add_argument("--greedy", action="store_true", help="always the most likely token (deterministic)")
    parser.add_argument("--checkpoint", choices=("best", "last"), default="best",
                        help="with a run folder: its best checkpoint (default) or last.ckpt")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda when there is one (default)")
    parser.add_argument("--no-cache", action="store_true",
                        help="run the whole context for every new token instead of keeping its keys and values "
                             "(slower; the same tokens)")
    return parser


def continue_prompt(run_dir: Path, prompt: str, max_new_tokens: int = 100, temperature: float = 0.8,
                    top_k: Optional[int] = 50, greedy: bool = False, which: str = "best", seed: int = 0,
                    device: str = "auto", cache: bool = True) -> str:
    """The prompt and up to `max_new_tokens` more tokens from the run's network, decoded (generation
    stops at the end-of-text token, which the decoded text leaves out)."""
    _check_options(prompt, max_new_tokens, temperature, top_k)
    require("text", PROG)
    import torch

    from trainer.data.corpus import END_OF_TEXT
    from trainer.deploy.export import locate
    from trainer.models.gpt import generate

    run_dir, checkpoint = locate(Path(run_dir), which)
    tokenizer = load_tokenizer(run_dir)
    net = load_language_model(run_dir, checkpoint)
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise UserError("--prompt", f"{prompt!r} encodes to no tokens with {run_dir / TOKENIZER_NAME}",
                        "text with at least one character the tokenizer keeps")
    target = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
    net = net.to(target)
    generator = torch.Generator(device=target).manual_seed(seed)
    out = generate(net, torch.tensor([ids], device=target), max_new_tokens, temperature=temperature,
                   top_k=top_k, greedy=greedy, generator=generator, cache=cache,
                   stop_token=tokenizer.token_to_id(END_OF_TEXT))
    return str(tokenizer.decode(out[0].tolist()))


def _check_options(prompt: str, max_new_tokens: int, temperature: float, top_k: Optional[int]) -> None:
    """The command line's numbers, refused in one line before anything is loaded."""
    if not prompt.strip():
        raise UserError("--prompt", "is empty", "some text for the model to continue")
    if max_new_tokens < 0:
        raise UserError("--max-new-tokens", f"must be at least 0, got {max_new_tokens}")
    if not temperature > 0:
        raise UserError("--temperature", f"must be greater than 0, got {temperature}",
                        "a positive number (--greedy for the most likely token every step)")
    if top_k is not None and top_k < 1:
        raise UserError("--top-k", f"must be at least 1, got {top_k}")


def load_tokenizer(run_dir: Path) -> Any:
    """The run's tokenizer (a `tokenizers.Tokenizer`); a run without one is not a language model."""
    path = run_dir / TOKENIZER_NAME
    if not path.is_file():
        raise UserError(str(run_dir), f"is not a language-model run (no {TOKENIZER_NAME})",
                        "the folder of a run trained with data=text and model=gpt")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as ex:  # noqa: BLE001 - tokenizers raises its own exception types for a bad file
        raise UserError(str(path), f"is not a readable tokenizer ({exception_line(ex)})",
                        "the tokenizer.json written by the text data module") from None


def load_language_model(run_dir: Path, checkpoint: Path) -> Any:
    """The run's network with the checkpoint's weights, refused unless it is a `GPT`."""
    from trainer.deploy.export import load_network
    from trainer.models.gpt import GPT

    with tempfile.TemporaryDirectory(prefix="generate-") as scratch:
        net = load_network(run_dir, checkpoint, Path(scratch))[0]
    if not isinstance(net, GPT):
        raise UserError(str(run_dir), f"is not a language-model run (its network is {type(net).__name__})",
                        "the folder of a run trained with model=gpt")
    return net


if __name__ == "__main__":
    main()
