"""``python -m trainer.deploy export RUN_DIR|CKPT``: the inference form of a trained run.

From the run folder alone: the network rebuilt and loaded, eval mode checked module by module,
Conv-BN pairs folded, and ``model.onnx``, ``model.pt2``, ``weights.safetensors`` (unfolded, for
`build_model`) and ``model.json`` written into ``RUN_DIR/export/``, each checked against PyTorch
(docs/deploy.md, "export"). ``python -m trainer.deploy weights CKPT OUT.safetensors`` writes any
checkpoint's weights alone (`export_safetensors`), with no run folder needed."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Optional, cast

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from trainer.configuration.recipes import TEAM_DIRS_VARIABLE, import_team_folders
from trainer.deploy.export_text import (evaluation_sequences, language_model_card, max_length_of, sequence_card,
                                        write_text_files)
from trainer.infra.atomic import remove_empty_folders, replace_atomic, write_text_atomic
from trainer.infra.checkpoint_files import load_checkpoint, write_safetensors
from trainer.infra.errors import UserError

CONFIG_NAME = "config_resolved.yaml"
#: What a run folder is, for the errors (the folder a run of `python -m trainer` or train.py writes).
RUN_FOLDER = f"a run folder (holding {CONFIG_NAME} and checkpoints/), or a .ckpt in its checkpoints/"
NET_PREFIX = "net."
#: ONNX Runtime and torch.export against eager PyTorch: float32 kernels differ in summation order.
TOLERANCE = 1e-3
CHECK_IMAGES = 64


@dataclass
class Exported:
    """What `export_run` wrote and measured."""

    folder: Path
    checkpoint: Path
    files: dict[str, Path]
    max_abs_diff: dict[str, float]
    images_checked: int
    folded_modules: tuple[int, int]  # modules before, after folding
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        diffs = ", ".join(f"{name} {value:.2e}" for name, value in self.max_abs_diff.items())
        return [f"exported {self.checkpoint} into {self.folder}: " + ", ".join(p.name for p in self.files.values()),
                f"checked on {self.images_checked} evaluation inputs, max abs difference of the logits from "
                f"eager PyTorch: {diffs} (bound {TOLERANCE:g})",
                *self._folding(), *self.notes]

    def _folding(self) -> list[str]:
        """The Conv-BN line where a pair was folded: a model without one (an encoder, a GPT) has none."""
        before, after = self.folded_modules
        return [f"Conv-BN folding: {before} modules -> {after}"] if after != before else []


# -- finding the run -----------------------------------------------------------------------------------
def locate(source: Path, which: str = "best") -> tuple[Path, Path]:
    """(run folder, checkpoint) for a run folder or a checkpoint inside one."""
    source = Path(source).expanduser()
    if not source.exists():
        raise UserError(str(source), "does not exist", RUN_FOLDER)
    if source.is_file() and source.suffix != ".ckpt":
        raise UserError(str(source), f"unknown format '{source.suffix or 'no extension'}'",
                        "a run folder, or a training checkpoint (.ckpt) in its checkpoints/")
    run_dir = source
    if source.is_file():
        run_dir = source.parent.parent if source.parent.name == "checkpoints" else source.parent
    if not (run_dir / CONFIG_NAME).is_file():
        raise UserError(str(run_dir), f"is not a run folder (no {CONFIG_NAME})", RUN_FOLDER)
    return run_dir, source if source.is_file() else _checkpoint_of(run_dir, which)


def _checkpoint_of(run_dir: Path, which: str) -> Path:
    best = _summary(run_dir).get("best_checkpoint")
    if which == "best" and best and Path(best).is_file():
        return Path(best)
    last = run_dir / "checkpoints" / "last.ckpt"
    if last.is_file():
        return last
    raise UserError(str(run_dir), "holds no checkpoint (checkpointing=off?)",
                    "a run trained with checkpointing, or the path of a .ckpt")


def _summary(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


# -- the network ---------------------------------------------------------------------------------------
def load_network(run_dir: Path, checkpoint: Path, scratch: Path) -> tuple[nn.Module, Any, Any, Any]:
    """(network with the checkpoint's weights, run spec, data module, data info); the data module
    writes what it writes (a bad-file list) into `scratch`, never into the run folder. A team's
    classes import from the working directory, TRAINER_TEAM_DIRS and the team folders the run
    recorded, wherever the command is typed (`import_team_folders`)."""
    # Imported here, not with the module: the run's config, data and model groups bring in Lightning
    # (about 4 s), which `deploy serve` of a folder already exported never needs.
    from trainer.configuration.spec import validate
    from trainer.data.group import build_data
    from trainer.models.group import build_model

    recorded = _recorded_team_dirs(run_dir)
    import_team_folders(recorded)
    try:
        spec = validate(cast(DictConfig, OmegaConf.load(run_dir / CONFIG_NAME)))  # a run's config: a mapping
    except UserError as ex:
        raise _with_team_remedy(ex, recorded) from None
    datamodule, info = build_data(spec.data, scratch, spec.top.seed)
    net = build_model(spec.model, info.model_inputs(), required=())  # built for this run once already
    state = load_checkpoint(checkpoint).get("state_dict")
    if not isinstance(state, Mapping) or not state:
        raise UserError(str(checkpoint), "has no state_dict", "a training checkpoint (.ckpt) of this run")
    weights = {k[len(NET_PREFIX):]: v for k, v in state.items() if k.startswith(NET_PREFIX)}
    missing, unexpected = _mismatch(net, weights)
    if missing or unexpected:
        raise UserError(str(checkpoint), f"does not fit the run's model {spec.model['_target_']} (missing "
                        f"{_few(missing)}; unexpected {_few(unexpected)})", "a checkpoint written by this run")
    net.load_state_dict(weights)
    return net, spec, datamodule, info


def _recorded_team_dirs(run_dir: Path) -> list[str]:
    """The team folders the run recorded in summary.json (runs older than the field: none)."""
    recorded = _summary(run_dir).get("team_dirs") or []
    return [str(entry) for entry in recorded if isinstance(entry, str) and entry]


def _with_team_remedy(ex: UserError, recorded: list[str]) -> UserError:
    """A class of the run's config that does not import: the remedy names where a team's classes are
    looked for (TRAINER_TEAM_DIRS, and the folders the run recorded, gone or not importable)."""
    if not (ex.where.endswith("._target_") and "no module named" in ex.problem.lower()):
        return ex  # a module that is found and fails to import: its own error says why
    if recorded:
        gone = [entry for entry in recorded if not Path(entry).is_dir()]
        where = (f"the run's team folder {', '.join(recorded)} " +
                 ("no longer exists" if len(gone) == len(recorded) else "does not hold it" if not gone
                  else f"is partly gone ({', '.join(gone)})"))
    else:
        where = "the run recorded no team folder"
    return UserError(ex.where, ex.problem, f"{where}: put the folder holding its package in {TEAM_DIRS_VARIABLE} "
                     f"(or run the command from it), or install the package")


def _mismatch(net: nn.Module, weights: Mapping[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    own = net.state_dict()
    missing = [k for k in own if k not in weights]
    unexpected = [k for k in weights if k not in own]
    shapes = [f"{k} {tuple(weights[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
              if k in weights and weights[k].shape != v.shape]
    return missing + shapes, unexpected


def _few(names: list[str], limit: int = 3) -> str:
    if not names:
        return "none"
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def checked_eval(net: nn.Module, images: torch.Tensor) -> nn.Module:
    """`net` in eval mode, refused when some part of it still behaves as in training."""
    net.eval()
    stuck = [name or type(net).__name__ for name, module in net.named_modules() if module.training]
    if stuck:
        raise UserError("model", f"still in training mode after eval(): {_few(stuck, 5)}",
                        "modules whose train(False) takes effect (Dropout, BatchNorm and their subclasses)")
    before = {name: buffer.clone() for name, buffer in net.named_buffers()}
    with torch.inference_mode():
        first, second = net(images), net(images)
    changed = [name for name, buffer in net.named_buffers() if not torch.equal(buffer, before[name])]
    if changed:
        raise UserError("model", f"a forward in eval mode changed {_few(changed)} (BatchNorm statistics updated "
                        "at inference)", "BatchNorm layers that use their running statistics in eval mode")
    if not torch.equal(first, second):
        raise UserError("model", "two forwards of the same images differ in eval mode: something is still random "
                        "(a dropout called with training=True?)", "a network whose eval-mode forward is deterministic")
    return net


# -- the files -----------------------------------------------------------------------------------------
def evaluation_images(datamodule: Any, count: int = CHECK_IMAGES) -> torch.Tensor:
    """Up to `count` evaluation inputs as the network receives them (preprocessed images as float32,
    token ids as they are, on the CPU)."""
    datamodule.apply_loader(datamodule.loader_settings(cuda=False))
    datamodule.setup("fit")
    taken: list[torch.Tensor] = []
    for batch in datamodule.val_dataloader():
        images, _ = datamodule.finish_batch(datamodule.transfer_batch_to_device(batch, torch.device("cpu"), 0),
                                            training=False)
        taken.append(images.float() if images.is_floating_point() else images)
        if sum(len(t) for t in taken) >= count:
            break
    return torch.cat(taken)[:count]


def dynamic_dims(images: torch.Tensor, max_length: Optional[int] = None) -> dict[int, Any]:
    """The dimensions left free in an export: the batch, and for token ids of a network that takes any
    length (an encoder) the sequence too, from 1 to `max_length`."""
    dims: dict[int, Any] = {0: torch.export.Dim("batch", min=1, max=4096)}
    if max_length is not None:
        dims[1] = torch.export.Dim("sequence", min=1, max=max_length)
    return dims


def write_onnx(net: nn.Module, images: torch.Tensor, path: Path, max_length: Optional[int] = None) -> None:
    name = "input_ids" if max_length is not None else "images"

    def write(tmp: Path) -> None:
        torch.onnx.export(net, (images[:2],), str(tmp), input_names=[name], output_names=["logits"],
                          dynamic_shapes=(dynamic_dims(images, max_length),), dynamo=True, external_data=False,
                          verbose=False)

    replace_atomic(path, write)


def onnx_logits(path: Path, images: torch.Tensor) -> torch.Tensor:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return torch.from_numpy(session.run(None, {name: images.numpy()})[0])


def write_program(net: nn.Module, images: torch.Tensor, path: Path, max_length: Optional[int] = None) -> None:
    program = torch.export.export(net, (images[:2],), dynamic_shapes=(dynamic_dims(images, max_length),))

    def write(tmp: Path) -> None:  # torch.export wants the .pt2 extension on the file it writes
        named = tmp.with_name(tmp.name + ".pt2")
        torch.export.save(program, str(named))
        os.replace(named, tmp)

    replace_atomic(path, write)


def program_logits(path: Path, images: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return torch.export.load(str(path)).module()(images)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_card(spec: Any, info: Any, datamodule: Any, run_dir: Path, checkpoint: Path) -> dict[str, Any]:
    """What the export holds, for any task: the inputs and outputs (filled in by `describe_tensors`
    once the network has run), the task and every metric it recorded at the end of the run, the
    preprocessing the data module declares; classes for a classifier, the tokenizer for a language
    model."""
    summary = _summary(run_dir)
    metrics = summary.get("metrics", {})
    files = {"onnx": "model.onnx", "torch_export": "model.pt2", "weights": "weights.safetensors"}
    if info.kind in ("sequences", "tokens"):  # copied in by write_text_files: the folder serves alone
        files["tokenizer"] = "tokenizer.json"
    if info.kind == "sequences":
        files["huggingface"] = "huggingface/"
    provenance = {"tested_weights": summary.get("tested_weights"),
                  "checkpoint": {"path": str(checkpoint), "sha256": sha256(checkpoint)},
                  "run": {"folder": str(run_dir), "name": summary.get("run_name") or summary.get("name")},
                  "files": files}
    if info.kind == "tokens":
        return {**language_model_card(spec, info, metrics, run_dir), **provenance}
    recorded = {split: dict(metrics.get(split, {})) for split in ("val", "test") if metrics.get(split)}
    if info.kind == "sequences":
        return {**sequence_card(spec, info, datamodule, run_dir), "metrics": recorded, **provenance}
    card: dict[str, Any] = {"model": spec.model["_target_"], "task": spec.task["_target_"], "kind": info.kind}
    if info.num_classes:
        card["classes"] = list(info.class_names or [str(i) for i in range(info.num_classes)])
    if info.kind == "images":
        card["input"] = {"shape": list(info.input_shape()), "dtype": "float32", "layout": "NCHW",
                         "batch": "dynamic"}
        card["accuracy"] = {split: metrics.get(split, {}).get("acc") for split in ("val", "test")}
    return {**card, "metrics": recorded, "preprocessing": datamodule.inference_preprocessing(), **provenance}


def describe_tensors(card: dict[str, Any], inputs: torch.Tensor, outputs: Any) -> dict[str, Any]:
    """The card with the network's inputs and outputs as the export checked them: a name, a shape
    whose first dimension is the batch (any size), a dtype each."""
    def spec(name: str, tensor: torch.Tensor, free: tuple[str, ...] = ("batch",)) -> dict[str, Any]:
        return {"name": name, "shape": [*free, *tensor.shape[len(free):]], "dtype": str(tensor.dtype).removeprefix("torch.")}

    produced = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    names = ["output"] if len(produced) == 1 else [f"output_{i}" for i in range(len(produced))]
    # an encoder's token ids have a free length too; its logits do not
    free_in = ("batch", "sequence") if card.get("kind") == "sequences" else ("batch",)
    return {**card, "inputs": [spec("input", inputs, free_in)], "outputs": [
        spec(name, tensor) for name, tensor in zip(names, produced) if isinstance(tensor, torch.Tensor)]}


def load_card(path: Path) -> dict[str, Any]:
    """A model.json; one line when it cannot be read."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as ex:
        raise UserError(str(path), f"is not a readable model card ({ex})", "the model.json written by export") from None


def export_folder(source: Path) -> Path:
    """The export folder for an export folder, a run folder or a checkpoint in one; the run is exported
    first when it has no export of this checkpoint (an export of another checkpoint is replaced)."""
    source = Path(source).expanduser()
    if source.is_dir() and (source / "model.json").is_file():
        return source
    run_dir, checkpoint = locate(source)
    card_path = run_dir / "export" / "model.json"
    if card_path.is_file() and load_card(card_path).get("checkpoint", {}).get("sha256") == sha256(checkpoint):
        return card_path.parent
    print(f"no export of {checkpoint.name} in {card_path.parent}: exporting first", flush=True)
    return export_run(source).folder


# -- the command ---------------------------------------------------------------------------------------
def export_run(source: Path, out: Optional[Path] = None, which: str = "best") -> Exported:
    """Export into `out` (default RUN_DIR/export). Every file is written into a temporary folder beside
    it and moved into place once all are written and checked: a failed export leaves nothing behind,
    and an export that was there before is only replaced by a complete one."""
    run_dir, checkpoint = locate(Path(source), which)
    folder = Path(out) if out is not None else run_dir / "export"
    with tempfile.TemporaryDirectory(prefix="export-data-") as scratch:
        net, spec, datamodule, info = load_network(run_dir, checkpoint, Path(scratch))
        # an encoder's batches have their own lengths: checked one by one (export_text.py)
        batches = (evaluation_sequences(datamodule, info.record.pad_id) if info.kind == "sequences"
                   else [evaluation_images(datamodule)])
        card = model_card(spec, info, datamodule, run_dir, checkpoint)
    for batch in batches:
        net = checked_eval(net, batch)
    with torch.inference_mode():
        card = describe_tensors(card, batches[-1], net(batches[-1][:1]))
    created = _first_missing(folder)  # removed again when the export fails
    staging = folder.parent / f".{folder.name}.{os.getpid()}.{secrets.token_hex(4)}.partial"
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        # os.mkdir, not mkdtemp: renamed into place, it has the permissions of any new folder (not 0700)
        staging.mkdir()
        text_files = write_text_files(net, card, run_dir, staging) if info.kind in ("sequences", "tokens") else {}
        exported = _write_export(net, batches, card, checkpoint, staging, folder)
        exported.files.update(text_files)
        files = _move_into_place(staging, folder, exported.files)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created is not None:  # the parents this export made for its folder, where still empty
            remove_empty_folders(folder.parent, below=created.parent)
        raise
    return replace(exported, folder=folder, files=files)


def _write_export(net: nn.Module, batches: list[torch.Tensor], card: dict[str, Any], checkpoint: Path,
                  folder: Path, final: Path) -> Exported:
    """The files written into `folder` (the staging folder) and checked on each of `batches` (one for
    images; an encoder's several, each of its own length); errors name `final`."""
    from trainer.models.fuse import fuse_for_inference  # torchvision's ResNet (1.6 s): exporting only

    folded = fuse_for_inference(net)
    max_length = max_length_of(card)
    example = max(batches, key=lambda batch: batch.shape[0] * batch.shape[-1])
    files = {"onnx": folder / "model.onnx", "torch_export": folder / "model.pt2",
             "weights": folder / "weights.safetensors", "card": folder / "model.json"}
    write_onnx(folded, example, files["onnx"], max_length)
    write_program(folded, example, files["torch_export"], max_length)
    diffs = {"folded": 0.0, "onnxruntime": 0.0, "torch_export": 0.0}
    largest = 1.0
    for batch in batches:
        with torch.inference_mode():
            reference = net(batch)
            got = {"folded": folded(batch)}
        got["onnxruntime"] = onnx_logits(files["onnx"], batch)
        got["torch_export"] = program_logits(files["torch_export"], batch)
        diffs = {name: max(diffs[name], float((got[name] - reference).abs().max())) for name in diffs}
        largest = max(largest, float(reference.abs().max()))
    bound = TOLERANCE * largest
    worst = max(diffs, key=diffs.__getitem__)
    if diffs[worst] > bound:
        raise UserError(str(final / files[worst].name if worst in files else final), f"the {worst} model's logits "
                        f"differ from PyTorch's by {diffs[worst]:.2e} on evaluation inputs (bound {bound:.2e})",
                        "an exportable network (report it: the export is not trustworthy)")
    write_safetensors(net.state_dict(), files["weights"], {"source": str(checkpoint)})
    checked = sum(len(batch) for batch in batches)
    card["checked"] = {"images": checked, "max_abs_diff": diffs, "bound": bound}
    if max_length is not None:
        card["checked"]["sequences"] = {"count": checked, "lengths": [int(batch.shape[1]) for batch in batches]}
    write_text_atomic(files["card"], json.dumps(card, indent=2) + "\n")
    return Exported(folder, checkpoint, files, diffs, checked,
                    (sum(1 for _ in net.modules()), sum(1 for _ in folded.modules())))


def _move_into_place(staging: Path, folder: Path, files: Mapping[str, Path]) -> dict[str, Path]:
    """A new folder: the staging folder renamed into place, at once. An existing one (an earlier export,
    or a folder of the person's given by --out): each file replaced in turn, the model card last, so
    that the card never names files older than itself; nothing else in the folder is touched."""
    if not folder.exists():
        os.replace(staging, folder)
    else:
        for name in sorted(files, key=lambda name: name == "card"):
            if files[name].is_dir() and (folder / files[name].name).is_dir():  # os.replace cannot replace a full folder
                shutil.rmtree(folder / files[name].name)
            os.replace(files[name], folder / files[name].name)
        shutil.rmtree(staging, ignore_errors=True)
    return {name: folder / path.name for name, path in files.items()}


def _first_missing(folder: Path) -> Optional[Path]:
    """The outermost of `folder` and its parents that does not exist yet (None: it exists)."""
    missing = None
    for path in [folder.absolute(), *folder.absolute().parents]:
        if path.exists():
            break
        missing = path
    return missing


# -- the weights alone ---------------------------------------------------------------------------------
def export_safetensors(checkpoint_path: str | Path, out: str | Path, prefix: str = NET_PREFIX) -> Path:
    """The model's weights from a training checkpoint as a safetensors file (`prefix` stripped, so
    the keys are the network's own); returns the written path."""
    checkpoint = load_checkpoint(checkpoint_path)
    state = checkpoint.get("state_dict")
    if not isinstance(state, Mapping) or not state:
        raise UserError(str(checkpoint_path), "has no state_dict", "a training checkpoint (.ckpt)")
    weights = {k[len(prefix):] if k.startswith(prefix) else k: v
               for k, v in state.items() if isinstance(v, torch.Tensor)}
    out = Path(out)
    write_safetensors(weights, out, {"source": str(checkpoint_path),
                                     "global_step": str(checkpoint.get("global_step", ""))})
    return out
