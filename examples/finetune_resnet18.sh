#!/usr/bin/env bash
# The seed DataParallel recipe, fixed: fine-tune an ImageNet-pretrained ResNet-18 on
# CIFAR-10 and report test accuracy (printed every epoch and in the final summary).
#
# Fixes over the seed: the 1000-class ImageNet head is replaced by a 10-class one
# (--pretrained keeps every weight but the head), DDP over Ray workers instead of
# single-process DataParallel, and the batch is explicit: 128 per worker.
#
# Pretrained weights are a local file (no hub download at run time). Make it once, on any
# machine with internet:
#   python -c "import torch, torchvision; torch.save(torchvision.models.resnet18(
#       weights='IMAGENET1K_V1').state_dict(), 'resnet18_imagenet.pt')"
#
#   WEIGHTS=resnet18_imagenet.pt NUM_WORKERS=4 examples/finetune_resnet18.sh --use-gpu
set -euo pipefail
NUM_WORKERS=${NUM_WORKERS:-2}
PER_WORKER_BATCH=128
exec python -m raytrain.fit \
  --model resnet18 --pretrained "${WEIGHTS:-resnet18_imagenet.pt}" --dataset cifar10 \
  --num-workers "$NUM_WORKERS" --batch-size $((PER_WORKER_BATCH * NUM_WORKERS)) \
  --optimizer sgd --lr 0.02 --momentum 0.9 --weight-decay 5e-4 --lr-schedule cosine \
  --epochs 5 --name finetune-resnet18 "$@"
