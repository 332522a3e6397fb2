#!/usr/bin/env bash
# The ResNet-50 ladder on one CUDA GPU, throughput-only on device-generated 224x224 images:
# baseline -> data pipeline -> mixed precision -> channels_last -> compile -> optimized, 300 steps
# each at batch 256. Writes benchmarks/results/ladder_resnet50.md and .png.
#   benchmarks/ladder_gpu.sh                       # as above
#   benchmarks/ladder_gpu.sh data.batch_size=128   # extra overrides go to every stage
exec "$(dirname "$0")/ladder.sh" resnet50 data=synthetic 'data.shape=[3,224,224]' data.num_classes=1000 \
  data.train_samples=76800 data.val_samples=5120 data.test_samples=5120 "$@"
