r"""ViT-B/16 at 224 px, 1000 classes (ImageNet-1k shape), standard Pre-LN, AdamW: the ViT benchmark shape.

Command (the throughput benchmark this config exists for; benchmarks/README.md):

  python -m dsjax.bench --config=configs/vit_b16.py

The benchmark times random images of the configured shape (224×224×3, 1000 classes), so ImageNet need
not be present. Expected runtime and result: see the GPU table of benchmarks/README.md (images/s and MFU per
device, with the device and date of each measurement).

Training it needs ImageNet prepared for TFDS (`imagenet2012`, which cannot be downloaded automatically):

  python -m dsjax.main --config=configs/vit_b16.py --workdir=/tmp/vit_b16 --config.data.data_dir=...

Without it the run stops with one line saying how to prepare it.

Settings: ViT-B/16 (Dosovitskiy et al. 2021, arXiv:2010.11929, Table 1: 12 layers, width 768, 12 heads,
MLP 3072, patch 16) with the DNT paper's AdamW ViT recipe (Qi et al. 2025, arXiv:2507.17501, Table 4:
lr 1e-3, weight decay 0.1, betas (0.9, 0.99), minimum lr 1e-8), class token pooling as in the ViT paper,
at the per-GPU batch of 128 (the paper's global batch is 1024).
"""

from dsjax.train.config import base_config


def get_config():
  c = base_config('vit', optimizer_name='adamw')
  c.total_steps = 100_000
  c.batch_size = 128
  c.eval_batch_size = 256
  c.eval_every = 5000
  c.checkpoint_every = 5000
  c.log_every = 100
  c.data.name = 'imagenet2012'
  c.data.image_size = 224
  c.data.augment = True

  c.model.depth = 12
  c.model.width = 768
  c.model.num_heads = 12
  c.model.patch_size = 16
  c.model.pooling = 'cls'
  c.model.block = 'preln'
  c.model.init_distribution = 'truncated_normal'
  # All 12 layers in one scan iteration: 43 ms/step instead of 64 at batch 128 on one H100
  # (benchmarks/README.md), for a compile of ~16 s instead of ~11 s.
  c.model.scan_unroll = 12

  c.optimizer.lr = 1e-3
  c.optimizer.weight_decay = 0.1
  c.optimizer.warmup_steps = 10_000
  c.optimizer.min_lr_ratio = 1e-5  # 1e-8 / 1e-3 (Qi et al. 2025, Table 4).
  return c
