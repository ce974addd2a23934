"""The tiny digits demo through the host (Grain) path and the DALI path.

The bundled digits are arrays, which ``data.decode='dali'`` refuses: this
writes the train split to array_record shards of PNG records (lossless, so
both paths start from the same pixels; the eight captions of each image kept
as ``captions``) with the project's shard writer, then trains
``configs/prolip_tiny.py`` on them once per decode and seed, one run at a
time, and prints the held-out figures of each run's last evaluation
(``metrics.jsonl``) with each decode's mean and seed spread
(docs/data.md's table).

  python benchmarks/dali_demo.py --out /tmp/dali_demo --seeds 0 1 2
  python benchmarks/dali_demo.py --out /tmp/dali_demo --write_only
  python benchmarks/dali_demo.py --throughput

``--throughput``: images per CPU-second (process time, so per core, however
busy the machine) of the two paths' decode + crop + resize of the same
JPEG records at 224 px: the host's (``decode_rgb`` at the reduced DCT
scale, ``train_view_and_order`` with the jitter left to the device) and
DALI's (the plan on the host, then the pipeline with one thread).

The DALI runs need ``pip install -e '.[dali]'`` in the interpreter that
runs this; without a GPU DALI runs on its CPU backend.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import subprocess
import sys

import msgpack
import numpy as np
from PIL import Image

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from prolip_jax.data import digits  # noqa: E402  pylint: disable=g-import-not-at-top
from prolip_jax.data import record_format  # noqa: E402  pylint: disable=g-import-not-at-top

# The held-out figures compared (metrics.jsonl keys, the last row having them).
FIGURES = ('eval/zeroshot_csd_top1', 'eval/zeroshot_cosine_top1',
           'eval/i2t_R@1', 'eval/t2i_R@1', 'eval/sigma2_img',
           'eval/sigma2_captions', 'loss')


def write_shards(out: str, split: str = 'train', shards: int = 2) -> str:
  """The digits' ``split`` as PNG records in ``shards`` array_record files
  under ``out``; returns their glob."""
  os.makedirs(out, exist_ok=True)
  records = digits.records(split)
  for s in range(shards):
    path = os.path.join(out, f'digits-{split}-{s:05d}{record_format.SUFFIX}')
    writer = record_format.ShardWriter(path)
    for i in range(s, len(records), shards):
      buf = io.BytesIO()
      Image.fromarray(records[i]['image'][..., 0], 'L').save(buf, 'PNG')
      writer.write(msgpack.packb(
          {'key': f'{split}-{i:05d}', 'image': buf.getvalue(),
           'captions': list(records[i]['captions'])}, use_bin_type=True))
    writer.close()
  return os.path.join(out, '*' + record_format.SUFFIX)


CONFIG = """from prolip_jax import demos


def get_config():  # written by benchmarks/dali_demo.py
  c = demos.tiny_demo_config('prolip')
  c.data.name = 'array_record'
  c.data.path = {pattern!r}
  c.evals.eval.data = 'digits:heldout'  # the held-out digits, as the demo's
  return c
"""


def write_config(out: str, pattern: str) -> str:
  """The demo's config on the shards ``pattern``: ``OUT/config.py``."""
  path = os.path.join(out, 'config.py')
  with open(path, 'w') as f:
    f.write(CONFIG.format(pattern=pattern))
  return path


def train(config: str, workdir: str, seed: int, decode: str) -> dict:
  """One demo run; the last value of each of ``FIGURES`` it logged."""
  cmd = [sys.executable, '-m', 'prolip_jax.main', '--config', config,
         '--workdir', workdir, f'--config.seed={seed}',
         f'--config.data.decode={decode}']
  subprocess.run(cmd, check=True, cwd=REPO)
  last = {}
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    for line in f:
      row = json.loads(line)
      last.update({k: row[k] for k in row if k in FIGURES})
  return last


def table(results: dict) -> str:
  """A markdown table: one row per run, then each decode's mean ± std."""
  keys = [k for k in FIGURES if any(k in r for r in results.values())]
  lines = ['| decode | seed | ' + ' | '.join(keys) + ' |',
           '|---|---|' + '---|' * len(keys)]
  for (decode, seed), row in sorted(results.items()):
    lines.append(f'| {decode} | {seed} | ' + ' | '.join(
        f'{row.get(k, float("nan")):.4g}' for k in keys) + ' |')
  for decode in sorted({d for d, _ in results}):
    rows = [r for (d, _), r in results.items() if d == decode]
    cells = []
    for k in keys:
      v = np.array([r.get(k, np.nan) for r in rows], float)
      cells.append(f'{v.mean():.4g} ± {v.std(ddof=1) if len(v) > 1 else 0:.2g}')
    lines.append(f'| {decode} | mean ± std | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def throughput(size: int = 224, n: int = 64, batch: int = 32,
               rounds: int = 3) -> dict:
  """Images per CPU-second of each path on ``n`` JPEG crops of the two
  scikit-learn sample photos (q 90, 300-640 px wide)."""
  import time  # pylint: disable=g-import-not-at-top
  from sklearn.datasets import load_sample_images  # pylint: disable=g-import-not-at-top
  from prolip_jax.data import dali_decode, image_decode, transforms  # pylint: disable=g-import-not-at-top
  photos = load_sample_images().images
  rng = np.random.default_rng(0)
  records = []
  for i in range(n):
    h, w = int(rng.integers(300, 427)), int(rng.integers(300, 640))
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(photos[i % 2][:h, :w])).save(
        buf, 'JPEG', quality=90)
    records.append(buf.getvalue())
  aug = transforms.AugmentConfig(color_on_device=True)
  min_pixels = image_decode.train_min_pixels(size, aug.crop_scale,
                                             aug.crop_ratio)

  def host():
    for data in records:
      transforms.train_view_and_order(
          image_decode.decode_rgb(data, min_pixels), size, rng, aug)

  decoder = dali_decode.DaliDecode(size, num_threads=1, device=('cpu', None))
  plan = dali_decode.PlanTransform(lambda text: np.zeros((1, 4), np.int32),
                                   aug)

  def dali():
    for start in range(0, n, batch):
      plans = [plan.random_map(
          {'image': data, 'caption': '',
           'image_size': image_decode.header_size(data, min_pixels)}, rng)
               for data in records[start:start + batch]]
      decoder.map(dali_decode.stack_plans(plans))

  out = {}
  for name, fn in (('host', host), ('dali_cpu', dali)):
    fn()  # warm-up (DALI builds its pipeline)
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(rounds):
      fn()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    out[name] = {'images_per_cpu_s': rounds * n / cpu,
                 'images_per_wall_s': rounds * n / wall}
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default='/tmp/dali_demo')
  parser.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
  parser.add_argument('--decodes', nargs='+', default=['host', 'dali'])
  parser.add_argument('--write_only', action='store_true')
  parser.add_argument('--throughput', action='store_true')
  args = parser.parse_args()
  if args.throughput:
    print(json.dumps(throughput(), indent=1))
    return
  shards = os.path.join(args.out, 'shards')
  pattern = (os.path.join(shards, '*' + record_format.SUFFIX)
             if glob.glob(os.path.join(shards, '*' + record_format.SUFFIX))
             else write_shards(shards))
  config = write_config(args.out, pattern)
  if args.write_only:
    print(config)
    return
  results = {}
  for seed in args.seeds:
    for decode in args.decodes:
      results[decode, seed] = train(
          config, os.path.join(args.out, f'{decode}-{seed}'), seed, decode)
      print(table(results), flush=True)


if __name__ == '__main__':
  main()
