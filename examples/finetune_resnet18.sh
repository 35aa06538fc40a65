#!/usr/bin/env bash
# The seed DataParallel recipe (../shared/seeds/004_*.txt) with its bugs fixed and nothing else
# changed: torchvision's ResNet-18 as it is (ImageNet stem: --stem imagenet) from ImageNet
# weights, ToTensor() + Normalize((0.5,)*3, (0.5,)*3) (--normalize half), no augmentation,
# batch 128, shuffled every epoch, SGD lr 0.001 momentum 0.9, no weight decay, constant lr,
# 10 epochs; prints the mean training loss every epoch and, at the end,
# "Accuracy of the network on the N test images: X %".
#
# Fixed: the 1000-class ImageNet head is replaced by a 10-class one (--pretrained keeps every
# weight but the head), and `device`, undefined in the seed's train/test functions, is each
# worker's own. The batch: DataParallel splits ONE batch of 128 over the GPUs, so 128 is the
# seed's global batch, and raytrain's --batch-size is global too: 128 // NUM_WORKERS per
# worker, the same images per optimizer step and the same lr as the seed on any GPU count.
# DDP over Ray workers replaces single-process DataParallel.
#
# Pretrained weights are a local file (no hub download at run time). Make it once, on any
# machine with internet:
#   python -c "import torch, torchvision; torch.save(torchvision.models.resnet18(
#       weights='IMAGENET1K_V1').state_dict(), 'resnet18_imagenet.pt')"
#
#   WEIGHTS=resnet18_imagenet.pt NUM_WORKERS=4 examples/finetune_resnet18.sh --use-gpu
#   WEIGHTS= examples/finetune_resnet18.sh --dataset digits      # random weights, offline
# raytrain's better recipe for the same job: examples/finetune_resnet18_better.sh.
set -euo pipefail
NUM_WORKERS=${NUM_WORKERS:-2}
WEIGHTS=${WEIGHTS-resnet18_imagenet.pt}
exec python -m raytrain.fit \
  --model resnet18 --stem imagenet ${WEIGHTS:+--pretrained "$WEIGHTS"} \
  --dataset cifar10 --normalize half --no-augment \
  --num-workers "$NUM_WORKERS" --batch-size 128 \
  --optimizer sgd --lr 0.001 --momentum 0.9 --weight-decay 0 --lr-schedule constant \
  --epochs 10 --name finetune-resnet18 "$@"
