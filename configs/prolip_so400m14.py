"""ProLIP SO400M/14: the B/16 recipe (configs/prolip_b16.py) at SigLIP's
shape-optimised ViT.

224 px, patch 14 (256 patches), 27x1152 image and text towers, 16 heads, MLP
4304 with tanh-approximated GELU, text context 16, embedding 1152: SigLIP's
ViT-SO400M/14 at 224 px (the SO400M/14 row of prolip_jax/config/sizes.py),
whose 233.5 GFLOPs per pair the paper's Table C.2 lists for ProLIP
SO400M/14. The vocabulary is ProLIP's 32,100 pieces (SigLIP's 32,000 and
the 100 extra ids, [MASK] among them). The paper fine-tuned it from
SigLIP for 1.28B pairs at lr 5e-5 without weight decay (B.2); this config
keeps the B/16 from-scratch recipe, so it plans memory and throughput at
the shape (docs/scaling.md):

python -m prolip_jax.aot --config configs/prolip_so400m14.py \
    --topology v5p:4x4x4
"""

import os

from prolip_jax.config import presets

_B16 = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'prolip_b16.py')


def get_config():
  c = presets.load_config_file(_B16)
  c.model.update(presets.model_size('SO400M/14'))  # B/16's dtype, pad id
  # Remat (saving nothing) and one scanned block per tower, as measured in
  # docs/scaling.md; B/16 dropped both for speed, not measured at this size.
  c.model.remat = True
  c.model.scan = True
  return c
