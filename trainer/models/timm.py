"""Any of timm's image models (ResNets, ConvNeXt, EfficientNet, ViT, ...) by name, fitted to the data.

The classes, input channels and (ViTs) the image size come from the data; weights are random unless
``model.pretrained_path`` names a local file, and nothing is downloaded (docs/config.md, "timm's models")."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Optional, Sequence

from torch import nn

from trainer.infra.errors import UserError
from trainer.infra.schema import Doc, Range

#: A few names a newcomer may want, for the error that lists choices.
EXAMPLES = ("resnet18", "resnet50", "convnext_tiny", "efficientnet_b0", "vit_small_patch16_224", "vit_tiny_patch16_224")


def build_timm(
    num_classes: int,
    name: Annotated[str, Doc("a timm model name (python -c 'import timm; print(timm.list_models())'), e.g. "
                             "resnet18, convnext_tiny, efficientnet_b0, vit_small_patch16_224")] = "resnet18",
    in_channels: int = 3,
    image_size: Sequence[int] = (224, 224),
    pretrained_path: Annotated[Optional[str], Doc("a local weights file (.safetensors, .pth, .bin) for this "
                                                  "model; null: random init. Nothing is downloaded")] = None,
    drop_rate: Annotated[float, Range(ge=0, lt=1), Doc("dropout before the classifier")] = 0.0,
    drop_path_rate: Annotated[float, Range(ge=0, lt=1), Doc("stochastic depth: the largest rate, for the last "
                                                            "block (models with residual blocks)")] = 0.0,
    options: Annotated[Optional[dict[str, Any]], Doc("more keyword arguments for timm.create_model, e.g. "
                                                     "{patch_size: 2, depth: 6} for a ViT on small images")] = None,
) -> nn.Module:
    import timm

    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise UserError("model.name", f"'{name}' is not a timm model{hint}", f"a name from timm.list_models(), "
                        f"e.g. {', '.join(EXAMPLES)}")
    options = {**(options or {}), "num_classes": num_classes, "in_chans": in_channels, "drop_rate": drop_rate}
    if drop_path_rate:
        options["drop_path_rate"] = drop_path_rate
    if pretrained_path is not None:
        path = Path(pretrained_path).expanduser()
        if not path.is_file():
            raise UserError("model.pretrained_path", f"'{pretrained_path}' is not a file",
                            "a local weights file for this model (nothing is downloaded)")
        # timm's own loading, from the file only: it drops or adapts the classifier and the stem to
        # num_classes and in_chans (a fine-tuning start), which a plain load_state_dict would refuse.
        options.update(pretrained=True, pretrained_cfg_overlay={"file": str(path), "hf_hub_id": None, "url": ""})
    sized = {**options, "img_size": tuple(int(s) for s in image_size)}
    try:
        return _fits(timm.create_model(name, **sized), name, image_size)  # transformers take the data's size
    except TypeError as ex:
        if "img_size" not in str(ex):
            return _refused(name, ex)
    except (AssertionError, ValueError) as ex:  # e.g. a patch larger than the image
        return _refused(name, ex)
    try:
        return timm.create_model(name, **options)
    except (TypeError, AssertionError, ValueError) as ex:
        return _refused(name, ex)


def _fits(net: nn.Module, name: str, image_size: Sequence[int]) -> nn.Module:
    """A patch embedding whose patch is larger than the image would fail at the first forward."""
    patch = getattr(getattr(net, "patch_embed", None), "patch_size", None)
    if patch is not None and any(int(p) > int(s) for p, s in zip(patch, image_size)):
        raise UserError("model.options", f"timm's '{name}' cuts {tuple(image_size)} images into {tuple(patch)} "
                        "patches, larger than the image", "model.options={patch_size: N} with N dividing the image "
                        "size, e.g. 2 or 4 for 8-32 px images")
    return net


def _refused(name: str, ex: Exception) -> nn.Module:
    key = "drop_path_rate" if "drop_path_rate" in str(ex) else "options"
    raise UserError(f"model.{key}", f"timm's '{name}' refuses it ({str(ex).splitlines()[0]})",
                    "0 for models without residual blocks" if key == "drop_path_rate"
                    else "keyword arguments this model's constructor takes")
