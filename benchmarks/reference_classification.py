"""torchvision's classification reference recipe (references/classification/train.py) on an
ImageFolder, as a new user would run it: the baseline that time_to_accuracy.py races.

Written for this benchmark, following the reference's defaults and flags rather than its code:
- ClassificationPresetTrain: RandomResizedCrop(crop, bilinear), RandomHorizontalFlip(0.5),
  PILToTensor, float, Normalize(ImageNet mean/std); ClassificationPresetEval: Resize(resize),
  CenterCrop(crop), the same normalization (resize = crop x 256/224, as 256/224 at ImageNet size);
- torchvision.models.resnet18(weights=None), cross-entropy (`--label-smoothing`, default 0), SGD
  momentum 0.9, weight decay 1e-4, lr 0.1 per 256 samples (linear rule);
- the reference's schedule flags, stepped once per epoch as its script does: `--lr-scheduler steplr`
  (default: StepLR(`--lr-step-size` 30, `--lr-gamma` 0.1)) or `cosineannealinglr`
  (CosineAnnealingLR(T_max = epochs - warmup epochs, eta_min `--lr-min`)); `--lr-warmup-epochs N`
  (default 0) puts a LinearLR (`--lr-warmup-method linear`, from `--lr-warmup-decay` x lr up to lr)
  or a ConstantLR (`constant`, the reference's default: `--lr-warmup-decay` x lr) before it, chained
  with SequentialLR(milestones=[N]);
- DataLoader with shuffling, pinned memory off on a CPU, `--workers` processes.

Prints one JSON line per epoch ({"epoch", "train_s", "val_acc", "lr"}: train_s is seconds since the
first training batch at the end of that epoch's validation, validation included; lr the one the
epoch trained with) and a last line with the totals.

    python benchmarks/reference_classification.py DATA_ROOT --epochs 8 --batch-size 64 --crop 32
    python benchmarks/reference_classification.py DATA_ROOT --epochs 8 --batch-size 64 --crop 32 \\
        --lr-scheduler cosineannealinglr --lr-warmup-epochs 1 --lr-warmup-method linear --lr-warmup-decay 0.01
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np
import torch
import torchvision
from torch import nn
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def presets(crop: int) -> tuple[v2.Compose, v2.Compose]:
    resize = round(crop * 256 / 224)
    finish = [v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD), v2.ToPureTensor()]
    train = v2.Compose([v2.RandomResizedCrop(crop, antialias=True), v2.RandomHorizontalFlip(0.5), *finish])
    evaluate = v2.Compose([v2.Resize(resize, antialias=True), v2.CenterCrop(crop), *finish])
    return train, evaluate


def accuracy(model: nn.Module, loader: torch.utils.data.DataLoader) -> float:
    model.eval()
    right = total = 0
    with torch.inference_mode():
        for images, labels in loader:
            right += int((model(images).argmax(1) == labels).sum())
            total += len(labels)
    model.train()
    return right / total


def build_schedule(optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> torch.optim.lr_scheduler.LRScheduler:
    """The reference's lr schedule, stepped once per epoch: its main scheduler, after a warmup if any."""
    if args.lr_scheduler == "steplr":
        main: torch.optim.lr_scheduler.LRScheduler = torch.optim.lr_scheduler.StepLR(
            optimizer, step_size=args.lr_step_size, gamma=args.lr_gamma)
    else:
        main = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs - args.lr_warmup_epochs,
                                                          eta_min=args.lr_min)
    if args.lr_warmup_epochs <= 0:
        return main
    if args.lr_warmup_method == "linear":
        warmup: torch.optim.lr_scheduler.LRScheduler = torch.optim.lr_scheduler.LinearLR(
            optimizer, start_factor=args.lr_warmup_decay, total_iters=args.lr_warmup_epochs)
    else:
        warmup = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=args.lr_warmup_decay,
                                                     total_iters=args.lr_warmup_epochs)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers=[warmup, main],
                                                 milestones=[args.lr_warmup_epochs])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    # The reference's own schedule and loss flags, with its defaults.
    parser.add_argument("--lr-scheduler", type=str.lower, default="steplr", choices=("steplr", "cosineannealinglr"))
    parser.add_argument("--lr-step-size", type=int, default=30, help="StepLR: epochs between two decays")
    parser.add_argument("--lr-gamma", type=float, default=0.1, help="StepLR: the factor of each decay")
    parser.add_argument("--lr-min", type=float, default=0.0, help="cosine: the lr it ends at")
    parser.add_argument("--lr-warmup-epochs", type=int, default=0)
    parser.add_argument("--lr-warmup-method", type=str.lower, default="constant", choices=("linear", "constant"))
    parser.add_argument("--lr-warmup-decay", type=float, default=0.01, help="warmup: its (first) lr as a share of lr")
    parser.add_argument("--label-smoothing", type=float, default=0.0)
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error(f"--epochs {args.epochs}: must be at least 1")
    if args.lr_warmup_epochs < 0:
        parser.error(f"--lr-warmup-epochs {args.lr_warmup_epochs}: must be 0 or more")
    if args.lr_scheduler == "cosineannealinglr" and args.lr_warmup_epochs >= args.epochs:
        parser.error(f"--lr-warmup-epochs {args.lr_warmup_epochs}: the cosine needs epochs after the warmup; "
                     f"allowed: below --epochs {args.epochs}")
    if not 0.0 <= args.label_smoothing < 1.0:
        parser.error(f"--label-smoothing {args.label_smoothing}: allowed 0 <= value < 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    train_tf, eval_tf = presets(args.crop)
    train_set = ImageFolder(f"{args.root}/train", transform=train_tf)
    val_set = ImageFolder(f"{args.root}/val", transform=eval_tf)
    train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                                               num_workers=args.workers, drop_last=False)
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=args.batch_size, num_workers=args.workers)
    model = torchvision.models.resnet18(weights=None, num_classes=len(train_set.classes))
    lr = 0.1 * args.batch_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    schedule = build_schedule(optimizer, args)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    started = time.perf_counter()
    acc = 0.0
    for epoch in range(1, args.epochs + 1):
        epoch_lr = optimizer.param_groups[0]["lr"]
        for images, labels in train_loader:
            loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        schedule.step()
        acc = accuracy(model, val_loader)
        print(json.dumps({"epoch": epoch, "train_s": round(time.perf_counter() - started, 2), "val_acc": acc,
                          "lr": epoch_lr}), flush=True)
    print(json.dumps({"final": True, "epochs": args.epochs, "train_s": round(time.perf_counter() - started, 2),
                      "val_acc": acc, "lr": lr, "lr_scheduler": args.lr_scheduler,
                      "lr_warmup_epochs": args.lr_warmup_epochs, "lr_warmup_method": args.lr_warmup_method,
                      "lr_warmup_decay": args.lr_warmup_decay, "label_smoothing": args.label_smoothing,
                      "torch_threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    main()
