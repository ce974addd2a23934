"""UniCLIP (Lee et al., NeurIPS 2022) on the bundled digits.

Deterministic towers (no [UNC]) whose features feed UniCLIP's heads: an
augmentation-aware residual image head and a linear text head into one space.
Each image gives data.num_views = 3 augmented views (crops, brightness and
contrast; their 11-number augmentation vectors go to the image head), and the
loss is MP-NCE (eq. 12) over all image-image, image-text and text-text pairs
with learnable per-domain temperatures and offsets (eq. 16). The heads and
the scalars are in params['uniclip']. Train-time zero-shot eval goes through
the heads with the identity augmentation vector.
"""

from prolip_jax import demos


def get_config():
  return demos.tiny_demo_config('uniclip')
