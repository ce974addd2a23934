"""Model sizes: one row per named size, the architecture fields only.

``SIZES['L/16']`` is everything that makes ViT-L/16 what it is (image and
patch size, both towers' width, depth, heads, MLP ratio and activation, the
text context and vocabulary, the embedding dimension); every other
``model.*`` setting (dtype, remat, scan, pad id, LayerNorm epsilons, inits)
is a run or family setting declared once in ``config_keys.KEYS``.
``presets.model_preset(name)`` is the declared defaults with one row laid
over them, ``presets.model_size(name)`` the row alone as a ``config.model``
update. A new model size is one row here.

No imports from the rest of the package and no JAX: ``config_keys`` reads
the ``tiny`` row for its declared defaults.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Tower:
  """One transformer tower: ``layers`` pre-LN blocks ``width`` wide with
  ``heads`` heads, an MLP ``mlp_ratio * width`` wide and ``act`` its
  activation (gelu | gelu_tanh | quick_gelu)."""
  width: int
  layers: int
  heads: int
  mlp_ratio: float = 4.0
  act: str = 'gelu'


@dataclasses.dataclass(frozen=True)
class Size:
  """A model size: square ``image_size`` images cut into ``patch_size``
  patches, captions of ``context_length`` tokens from ``vocab_size``
  pieces, the two towers and the shared embedding dimension."""
  image_size: int
  patch_size: int
  vision: Tower
  context_length: int
  vocab_size: int
  text: Tower
  embed_dim: int

  def to_dict(self) -> dict[str, Any]:
    """The ``config.model`` fields this size sets, nested as
    ``ModelConfig.to_dict()`` nests them."""
    vision = dict(dataclasses.asdict(self.vision),
                  image_size=self.image_size, patch_size=self.patch_size)
    text = dict(dataclasses.asdict(self.text),
                context_length=self.context_length,
                vocab_size=self.vocab_size)
    return {'embed_dim': self.embed_dim, 'vision': vision, 'text': text}


# SigLIP's sentencepiece model with T5's 100 extra ids: ProLIP's [MASK] is
# id 32000 (<extra_id_99>), so the table has 32,100 rows.
SIGLIP_VOCAB = 32100

SIZES: dict[str, Size] = {
    # The CPU demos' model (and the declared model.* defaults).
    'tiny': Size(image_size=32, patch_size=8, vision=Tower(128, 4, 4),
                 context_length=32, vocab_size=256, text=Tower(128, 3, 4),
                 embed_dim=64),
    'B/32': Size(image_size=224, patch_size=32, vision=Tower(768, 12, 12),
                 context_length=64, vocab_size=SIGLIP_VOCAB,
                 text=Tower(768, 12, 12), embed_dim=768),
    # The paper's ProLIP ViT-B/16 (4.1): SigLIP B/16's towers, context 64.
    'B/16': Size(image_size=224, patch_size=16, vision=Tower(768, 12, 12),
                 context_length=64, vocab_size=SIGLIP_VOCAB,
                 text=Tower(768, 12, 12), embed_dim=768),
    'L/16': Size(image_size=224, patch_size=16, vision=Tower(1024, 24, 16),
                 context_length=64, vocab_size=SIGLIP_VOCAB,
                 text=Tower(1024, 24, 16), embed_dim=1024),
    # SigLIP's shape-optimised ViT (Alabdulmohsin et al., 2023) at 224 px,
    # as SigLIP's so400m-patch14-224 release: MLP 4304, tanh-approximated
    # GELU (flax's nn.gelu default), text context 16.
    'SO400M/14': Size(image_size=224, patch_size=14,
                      vision=Tower(1152, 27, 16, mlp_ratio=4304 / 1152,
                                   act='gelu_tanh'),
                      context_length=16, vocab_size=SIGLIP_VOCAB,
                      text=Tower(1152, 27, 16, mlp_ratio=4304 / 1152,
                                 act='gelu_tanh'),
                      embed_dim=1152),
}
