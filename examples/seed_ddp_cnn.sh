#!/usr/bin/env bash
# The seed DDP recipe as one raytrain command: seed CNN, SGD lr 0.001 momentum 0.9,
# batch 64 PER WORKER, 10 epochs, a loss line every 100 batches, CIFAR-10.
#
# The seed script was launched with torch.distributed.launch on every node, used an undefined
# `rank`/`device`, and left per-GPU vs global batch implicit. raytrain's --batch-size is the
# GLOBAL batch, so 64 per worker is 64 x NUM_WORKERS. DDP averages gradients over workers, so
# lr 0.001 at global batch 64*N is exactly what the seed's N processes did.
#
#   NUM_WORKERS=2 examples/seed_ddp_cnn.sh                # CPUs, local cluster
#   NUM_WORKERS=8 examples/seed_ddp_cnn.sh --use-gpu      # 8 GPUs anywhere in the cluster
#   examples/seed_ddp_cnn.sh --data-dir /data/cifar        # an offline CIFAR-10 copy
set -euo pipefail
NUM_WORKERS=${NUM_WORKERS:-2}
PER_WORKER_BATCH=64
exec python -m raytrain.fit \
  --model seed-cnn --dataset cifar10 \
  --num-workers "$NUM_WORKERS" --batch-size $((PER_WORKER_BATCH * NUM_WORKERS)) \
  --optimizer sgd --lr 0.001 --momentum 0.9 --weight-decay 0 --lr-schedule constant \
  --no-augment --epochs 10 --log-every 100 --name seed-ddp-cnn "$@"
