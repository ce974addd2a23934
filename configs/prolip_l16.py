"""ProLIP ViT-L/16: the B/16 recipe (configs/prolip_b16.py) at the L/16 shape.

224 px, patch 16, 24x1024 image and text towers (16 heads), context 64,
embedding 1024. The paper's L/16 (Table C.2) was fine-tuned from SigLIP for
1.28B pairs at lr 5e-5 without weight decay (B.2); this config keeps the
B/16 from-scratch recipe, so it plans memory and throughput at the shape
(docs/scaling.md):

python -m prolip_jax.aot --config configs/prolip_l16.py --topology v5p:4x4x4
"""

import os

from prolip_jax.config import presets

_B16 = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'prolip_b16.py')


def get_config():
  c = presets.load_config_file(_B16)
  c.model.update(presets.model_size('L/16'))  # B/16's dtype, pad id
  # Remat (saving nothing) and one scanned block per tower, as measured in
  # docs/scaling.md; B/16 dropped both for speed, not measured at this size.
  c.model.remat = True
  c.model.scan = True
  return c
