"""torchvision's classification reference recipe (references/classification/train.py, its defaults)
on an ImageFolder, as a new user would run it: the baseline that time_to_accuracy.py compares with.

Written for this benchmark, following the reference's defaults rather than its code:
- ClassificationPresetTrain: RandomResizedCrop(crop, bilinear), RandomHorizontalFlip(0.5),
  PILToTensor, float, Normalize(ImageNet mean/std); ClassificationPresetEval: Resize(resize),
  CenterCrop(crop), the same normalization (resize = crop x 256/224, as 256/224 at ImageNet size);
- torchvision.models.resnet18(weights=None), cross-entropy, SGD momentum 0.9, weight decay 1e-4,
  lr 0.1 per 256 samples (linear rule), StepLR(step 30 epochs, gamma 0.1);
- DataLoader with shuffling, pinned memory off on a CPU, `--workers` processes.

Prints one JSON line per epoch ({"epoch", "train_s", "val_acc"}: seconds since training began,
validation included) and a last line with the totals.

    python benchmarks/reference_classification.py DATA_ROOT --epochs 8 --batch-size 64 --crop 32
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
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
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.1)
    criterion = nn.CrossEntropyLoss()

    started = time.perf_counter()
    acc = 0.0
    for epoch in range(1, args.epochs + 1):
        for images, labels in train_loader:
            loss = criterion(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        schedule.step()
        acc = accuracy(model, val_loader)
        print(json.dumps({"epoch": epoch, "train_s": round(time.perf_counter() - started, 2), "val_acc": acc}),
              flush=True)
    print(json.dumps({"final": True, "epochs": args.epochs, "train_s": round(time.perf_counter() - started, 2),
                      "val_acc": acc, "lr": lr, "torch_threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    main()
