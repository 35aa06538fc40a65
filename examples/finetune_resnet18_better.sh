#!/usr/bin/env bash
# raytrain's recipe for the seed's fine-tuning job (examples/finetune_resnet18.sh is the seed's
# own): ResNet-18 with a CIFAR stem on 32x32 images (conv1 at stride 1, no max-pool: the
# weights are the same tensors, the feature maps 4x larger), the dataset's own mean/std,
# random crop + flip, batch 128 PER WORKER, SGD lr 0.02 momentum 0.9 weight decay 5e-4 with a
# cosine schedule, 5 epochs. The measured difference is in the README ("The seed recipes").
#
#   WEIGHTS=resnet18_imagenet.pt NUM_WORKERS=4 examples/finetune_resnet18_better.sh --use-gpu
#   WEIGHTS= examples/finetune_resnet18_better.sh --dataset digits    # random weights, offline
set -euo pipefail
NUM_WORKERS=${NUM_WORKERS:-2}
PER_WORKER_BATCH=128
WEIGHTS=${WEIGHTS-resnet18_imagenet.pt}
exec python -m raytrain.fit \
  --model resnet18 --stem cifar ${WEIGHTS:+--pretrained "$WEIGHTS"} --dataset cifar10 \
  --num-workers "$NUM_WORKERS" --batch-size $((PER_WORKER_BATCH * NUM_WORKERS)) \
  --optimizer sgd --lr 0.02 --momentum 0.9 --weight-decay 5e-4 --lr-schedule cosine \
  --epochs 5 --name finetune-resnet18-better "$@"
