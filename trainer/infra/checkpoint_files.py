"""Checkpoint files that cannot be half-written or poisoned, keyed like the plain model.

Atomic writes, ``torch.load(weights_only=True)`` reads and keys of the plain model (no
``_orig_mod.`` or ``module.``, on saving and loading) are described in docs/reliability.md
("Checkpoints"). Lightning's own writer streams into the target path, so a kill mid-write leaves a
truncated file under the real name. When checkpoints are written is the `checkpointing` group's
(trainer/groups/checkpointing.py)."""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import save_file

from trainer.infra.atomic import replace_atomic
from trainer.infra.errors import UserError, first_line

COMPILE_PREFIX = "_orig_mod."
WRAPPER_PREFIX = "module."


def clean_key(key: str) -> str:
    """The key as the plain model names it."""
    return key.removeprefix(WRAPPER_PREFIX).removeprefix(COMPILE_PREFIX).replace("." + COMPILE_PREFIX, ".")


def clean_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    cleaned = {clean_key(k): v for k, v in state_dict.items()}
    if len(cleaned) != len(state_dict):
        raise ValueError("state dict has keys that differ only by _orig_mod./module. prefixes")
    return cleaned


def load_weights(module: torch.nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
    """Load a (clean or prefixed) state dict into `module`, which may itself be compiled or wrapped."""
    inner = module
    while True:
        if isinstance(inner, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel):
            inner = inner.module
        elif hasattr(inner, "_orig_mod") and isinstance(inner._orig_mod, torch.nn.Module):
            inner = inner._orig_mod  # torch.compile(module) wraps it in an OptimizedModule
        else:
            break
    return inner.load_state_dict(clean_state_dict(state_dict), strict=strict)


def load_checkpoint(path: str | Path, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint safely; a refused, truncated or missing file is a one-line `UserError`.
    `mmap` maps the tensors instead of reading them (for a look at the other fields)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(str(path), "checkpoint not found", "the path of a .ckpt file")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as ex:
        reason = first_line(ex) or type(ex).__name__
        raise UserError(str(path), f"refused: its pickle asks for more than tensors and plain data ({reason[:200]})",
                        "a checkpoint of tensors and plain containers, as this framework writes them") from None
    except (EOFError, zipfile.BadZipFile, RuntimeError) as ex:
        raise UserError(str(path), f"not a readable checkpoint (truncated or not written by torch.save): "
                        f"{first_line(ex, 200) or type(ex).__name__}",
                        "a complete .ckpt file") from None
    if not isinstance(checkpoint, dict):
        raise UserError(str(path), f"holds a {type(checkpoint).__name__}, not a checkpoint dictionary",
                        "a .ckpt file written by this framework")
    if isinstance(checkpoint.get("state_dict"), Mapping):
        checkpoint["state_dict"] = clean_state_dict(checkpoint["state_dict"])
    return checkpoint


def write_safetensors(weights: Mapping[str, torch.Tensor], out: Path, metadata: dict[str, str]) -> None:
    """`weights` as a safetensors file, atomically. Tensors that share memory (a language model's
    tied embedding and output head) are stored once, under the first name; the metadata's "tied"
    maps each other name to it (safetensors refuses shared tensors; loading with
    `load_state_dict(strict=False)` and re-tying is what transformers' `tie_weights` does too)."""
    kept: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    first_of: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for name, tensor in weights.items():
        tensor = tensor.detach().contiguous().cpu()
        key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), tuple(tensor.shape))
        if key in first_of:
            tied[name] = first_of[key]
            continue
        first_of[key] = name
        kept[name] = tensor
    if tied:
        metadata = {**metadata, "tied": json.dumps(tied)}
    replace_atomic(out, lambda tmp: save_file(kept, str(tmp), metadata=metadata))
