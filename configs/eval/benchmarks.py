"""The benchmarks people report, for any checkpoint: ImageNet-1k zero-shot
(80 templates, CSD and cosine), ImageNet-v2, COCO 5k retrieval (Karpathy
test split) and the uncertainty summary on COCO, from prepared TFDS data.

  tfds build imagenet2012 imagenet_v2 coco_captions --data_dir /data/tfds \
      --file_format=array_record      # ImageNet: its tars in /data/tfds/downloads/manual
  python -m prolip_jax.evaluate --workdir DIR --config configs/eval/benchmarks.py \
      --config.tfds_data_dir=/data/tfds

Run one of them with ``--evals=imagenet``. The entries are those of
``configs/prolip_b16.py`` (``presets.benchmark_evals``); see
docs/evaluation.md for the settings of each kind.
"""

import ml_collections

from prolip_jax.config import presets


def get_config():
  c = ml_collections.ConfigDict()
  c.tfds_data_dir = ''  # where `tfds build` put the data sets
  c.evals = presets.benchmark_evals()
  return c
