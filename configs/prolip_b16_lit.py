"""LiT on the released ProLIP ViT-B/16: the image tower locked, the text
tower fine-tuned (Zhai et al., 2022, "LiT: Zero-Shot Transfer with
Locked-image text Tuning").

python -m prolip_jax.main --config configs/prolip_b16_lit.py \
    --workdir DIR --config.init_from=hf-hub:OWNER/NAME \
    --config.data.path='/data/pairs/*.array_record'

``configs/prolip_b16_finetune.py`` (``init_from``, tokenizer, recipe; see
its docstring) with ``optim.freeze = ('visual/.*',)``: every parameter of
the image tower, its [UNC] token and uncertainty head included, keeps the
released value (no update, no weight decay, no AdamW moments: the optimizer
state is about 56% of the fine-tune's, and the image tower's backward pass
is never computed). The text tower, its [UNC] head and the scale and bias
``logit_scale``/``logit_bias`` train. docs/training.md, "Locked and frozen
parameters".
"""

import os

from prolip_jax.config import presets

_FINETUNE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                         'prolip_b16_finetune.py')


def get_config():
  c = presets.load_config_file(_FINETUNE)
  c.optim.freeze = ('visual/.*',)  # the whole image tower, [UNC] head too
  return c
