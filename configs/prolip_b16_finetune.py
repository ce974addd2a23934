"""Fine-tune the released ProLIP ViT-B/16 (paper B.2) in JAX.

python -m prolip_jax.main --config configs/prolip_b16_finetune.py \
    --workdir DIR --config.init_from=hf-hub:OWNER/NAME \
    --config.data.path='/data/pairs/*.array_record'

``init_from`` (a Hugging Face snapshot directory or ``hf-hub:OWNER/NAME``,
see ``prolip_jax/interop/hub.py``) decides the model (the release's
architecture and forward pass, ``release_compat=True``), the tokenizer (the
release's ``timm/ViT-B-16-SigLIP`` tokenizer.json through the Hugging Face
cache, canonicalize cleaning, 64 tokens, pad ``</s>`` = 1, [MASK] =
``<extra_id_99>`` = 32000) and the normalisation. The weights become step 0
without optimizer state, so AdamW starts afresh. The recipe is the paper's
fine-tuning one (B.2: lr 5e-5, no weight decay); the seen-sample budget is
a placeholder to set for the task.

``--config.init_image_size=256`` (or 384) fine-tunes at that size instead
of the snapshot's 224 px, the image position embeddings resampled from 14x14
to 16x16 (24x24) patches (docs/interop.md, "Fine-tuning at another
resolution").
"""

from prolip_jax.config import presets

BATCH_SIZE = 4096


def get_config():
  c = presets.base_config()
  c.objective = 'prolip'
  c.model = presets.model_preset('B/16')  # replaced by the snapshot's
  c.model.release_compat = True
  c.model.compute_dtype = 'bfloat16'
  c.model.remat = True
  # One scanned block per tower: the same function, compiled 2.5x faster on
  # CPU and 5.7x for an H100 (docs/layer_scan.md).
  c.model.scan = True
  c.init_from = ''  # required: --config.init_from=hf-hub:OWNER/NAME or a dir
  c.batch_size = BATCH_SIZE
  c.total_steps = 10_000
  c.optim.lr = 5e-5  # B.2
  c.optim.weight_decay = 0.0  # B.2
  c.optim.b1 = 0.9
  c.optim.b2 = 0.95
  c.optim.warmup_steps = 500
  c.optim.end_lr_ratio = 0.0
  c.loss.alpha1 = 1e-7
  c.loss.alpha2 = 1e-3
  c.loss.beta = 1e-4
  c.loss.c = 1000.0
  c.loss.eps = -20.0
  c.masking.image_keep_ratio = 0.25
  c.data.name = 'array_record'
  c.data.path = ''
  c.data.num_workers = 16
  c.log_every_steps = 50
  c.checkpoint_every_steps = 1000
  # ImageNet-1k / -v2 zero-shot, COCO 5k retrieval, the uncertainty summary.
  c.evals = presets.benchmark_evals(every_steps=1000)
  return c
