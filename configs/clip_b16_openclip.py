"""open_clip's ViT-B-16 CLIP architecture, for importing its weights.

python tools/import_pytorch.py --src open_clip_model.safetensors \
    --config configs/clip_b16_openclip.py --workdir /tmp/clip_b16

The deterministic dual encoder (``use_unc=False``, objective 'clip'): 224px,
patch 16, 12x768 image tower (12 heads), 12x512 text tower (8 heads) with a
causal mask, context 77, vocabulary 49,408 and pad id 0 (OpenAI's BPE),
end-of-text (argmax) pooling, text projection without bias, exact GELU,
LayerNorm eps 1e-5 everywhere, embedding 512. For the QuickGELU checkpoints
(OpenAI's, ``ViT-B-16-quickgelu``) override
``--config.model.vision.act=quick_gelu --config.model.text.act=quick_gelu``.
The imported model computes exactly what open_clip's ``encode_image`` and
``encode_text`` compute; note that this project's tokenizers are
sentencepiece models, not OpenAI's BPE.
"""

import ml_collections

from prolip_jax.config import presets


def model_config() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({
      'embed_dim': 512,
      'vision': {'image_size': 224, 'patch_size': 16, 'width': 768,
                 'layers': 12, 'heads': 12, 'mlp_ratio': 4.0, 'act': 'gelu',
                 'ln_eps': 1e-5},
      'text': {'vocab_size': 49408, 'context_length': 77, 'width': 512,
               'layers': 12, 'heads': 8, 'mlp_ratio': 4.0, 'act': 'gelu',
               'ln_eps': 1e-5, 'pad_id': 0, 'proj_bias': False,
               'pool': 'argmax', 'causal': True},
      'use_unc': False,
      'release_compat': False,
      'init_logit_scale': 1 / 0.07,  # open_clip's CLIP init; stored as log
      'init_logit_bias': -10.0,  # CLIP has none; created on import
      'init_unc_bias': -10.0,  # unused: no [UNC] heads
      'compute_dtype': 'float32',
      'remat': False,
  })


def get_config():
  c = presets.base_config()
  c.objective = 'clip'
  c.model = model_config()
  c.evals = presets.benchmark_evals(probabilistic=False)
  return c
