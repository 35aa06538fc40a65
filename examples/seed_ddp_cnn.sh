#!/usr/bin/env bash
# The seed DDP recipe (../shared/seeds/000_*.txt) as one raytrain command, otherwise unchanged:
# its Net (--model seed-cnn: conv 3->32, conv 32->64, fc 4096->512->10), ToTensor() inputs only
# (--normalize none: pixels in [0, 1], no mean/std), SGD lr 0.001 momentum 0.9 no weight
# decay, constant lr, batch 64 PER WORKER, 10 epochs, no augmentation, and its loss line every
# 100 batches: "Train Epoch: E [N/TOTAL (P%)]\tLoss: L" (epochs count from 1, the seed's from 0).
#
# What raytrain fixes: the seed used an undefined `rank`/`size`, forgot
# `import torch.nn.functional as F`, hard-coded NCCL (gloo here on CPUs) and was launched with
# torch.distributed.launch on every node. raytrain's --batch-size is the GLOBAL batch, so 64 per
# worker is 64 x NUM_WORKERS; DDP averages the gradients, so lr 0.001 at that global batch is
# exactly what the seed's N processes did.
#
#   NUM_WORKERS=2 examples/seed_ddp_cnn.sh --dataset digits    # offline, measured in the README
#   NUM_WORKERS=2 examples/seed_ddp_cnn.sh                     # CIFAR-10 (downloads on first use)
#   NUM_WORKERS=8 examples/seed_ddp_cnn.sh --use-gpu           # 8 GPUs anywhere in the cluster
#   examples/seed_ddp_cnn.sh --data-dir /data/cifar             # an offline CIFAR-10 copy
#
# The run is named seed-ddp-cnn: a re-run with other flags is refused (its run directory holds
# another config); append --name NAME (the last --name wins) or --fresh. On digits an epoch is
# 12 steps with 2 workers, so --log-every 100 prints only each epoch's step 0, as the seed
# would; append --log-every 5 to see more.
set -euo pipefail
NUM_WORKERS=${NUM_WORKERS:-2}
PER_WORKER_BATCH=64
exec python -m raytrain.fit \
  --model seed-cnn --dataset cifar10 --normalize none --no-augment \
  --num-workers "$NUM_WORKERS" --batch-size $((PER_WORKER_BATCH * NUM_WORKERS)) \
  --optimizer sgd --lr 0.001 --momentum 0.9 --weight-decay 0 --lr-schedule constant \
  --epochs 10 --log-every 100 --name seed-ddp-cnn "$@"
