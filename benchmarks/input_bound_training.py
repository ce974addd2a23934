"""Does the training loop's data-wait metric agree with the input benchmark?

python benchmarks/input_bound_training.py [--images 256] [--steps 120] \
    [--batch 32] [--workers 1] [--color_on_device]

Trains a micro ProLIP (one-layer 32-wide towers, 224 px images in 32 px
patches: a step of tens of ms on a CPU) on the realistic JPEG shards of
``benchmarks/input_pipeline.py`` through the real input path (array_record,
``CheckedSource`` at reduced DCT scale, Grain worker processes), so the
input sets the pace. Colour jitter runs in the worker unless
``--color_on_device``: on a CPU "device" ``data/color.py`` costs about
12 ms per 224 px image, more than the whole host path, and the run would
be device-bound. Before training it times the same dataset on one thread
(``ds[step]``, the benchmark's per-core figure) and predicts the loop's rate: ``--workers`` worker processes give ``workers x``
that rate while there are cores for them (the loop's own process needs
one: on the 2-core VM one worker is the most that does not share a core),
and the loop runs at the smaller of that and the device's own rate (batch
/ the step timed alone, ``time/step_alone_s``). It then prints the loop's
log intervals (images/s = batch / ``time/step_s``, the data-wait fraction,
the step timed alone), the loop's rate over the second half of them (the
first ones drain the prefetch buffer filled while the step compiled)
against the prediction, and whether the loop printed its input-bound note.

Tolerance: the loop's images/s within 25% of the prediction. The worker
and the loop share the machine (XLA's CPU threads, the host-to-device copy,
the batch's pickling between processes) and this VM's speed drifts by
tens of percent between minutes; a wrong prediction (a worker process
taken for two cores, the device rate taken for the input's) is off by 2x.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
sys.path.insert(0, os.path.join(_ROOT, 'benchmarks'))

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np

import input_pipeline  # benchmarks/, beside this file

TOLERANCE = 0.25


def micro_config(pattern: str, tokenizer_path: str, args):
  """The micro model on ``pattern``'s shards, 224 px, nothing but steps."""
  from prolip_jax.config import presets
  c = presets.load_config_file(
      os.path.join(_ROOT, 'configs', 'prolip_micro.py'))
  c.model.vision.image_size = 224
  c.model.vision.patch_size = 32
  c.mesh.num_devices = 1
  c.batch_size = args.batch
  c.total_steps = args.steps
  c.log_every_steps = args.log_every
  c.checkpoint_every_steps = args.steps  # only the last step
  c.data.name = 'array_record'
  c.data.path = pattern
  c.data.color_on_device = args.color_on_device
  c.data.num_workers = args.workers
  c.data.num_threads = 1
  c.tokenizer.model_path = tokenizer_path
  return c


def one_thread_rate(cfg, seconds: float) -> float:
  """Images/s of ``ds[step]`` on one thread for the run's own dataset."""
  from prolip_jax.data import sources
  from prolip_jax.data import pipeline
  from prolip_jax.data.tokenizer import Tokenizer
  from prolip_jax.training import train
  source, _ = sources.train_source(cfg)
  tok = Tokenizer(cfg.tokenizer.model_path,
                  cfg.model.text.context_length)
  ds = pipeline.train_dataset(
      source, tokenizer=tok, image_size=cfg.model.vision.image_size,
      global_batch_size=cfg.batch_size, seed=cfg.seed,
      augment=train.augment_config(cfg.data))
  steps = len(source) // cfg.batch_size
  return input_pipeline._rate(lambda i: ds[i], steps, seconds) * (  # pylint: disable=protected-access
      cfg.batch_size)


def train_rows(cfg, workdir: str) -> tuple[list[dict], str]:
  """Trains ``cfg``; its ``metrics.jsonl`` rows with timings, and what it
  printed."""
  from prolip_jax.training import train
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    train.train_and_evaluate(cfg, workdir)
  printed = out.getvalue()
  sys.stdout.write(printed)
  rows = [json.loads(line) for line in
          open(os.path.join(workdir, 'metrics.jsonl'))]
  return [r for r in rows if 'time/step_s' in r], printed


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--images', type=int, default=256)
  parser.add_argument('--steps', type=int, default=120)
  parser.add_argument('--log_every', type=int, default=15)
  parser.add_argument('--batch', type=int, default=32)
  parser.add_argument('--workers', type=int, default=1)
  parser.add_argument('--seconds', type=float, default=6.0)
  parser.add_argument('--color_on_device', action='store_true')
  args = parser.parse_args(argv)
  from absl import flags
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()  # Grain worker processes read absl flags
  from prolip_jax.data.tokenizer import train_tokenizer

  tmp = tempfile.mkdtemp(prefix='prolip_input_bound_')
  examples = input_pipeline.make_jpegs(args.images)
  pattern = input_pipeline.write_shards(examples, tmp)
  tok_path = train_tokenizer([c for _, c in examples],
                             os.path.join(tmp, 'tok.model'), 256)
  cfg = micro_config(pattern, tok_path, args)
  per_core = one_thread_rate(cfg, args.seconds)
  cores = os.cpu_count() or 1
  worker_cores = min(max(args.workers, 1), max(cores - 1, 1))
  predicted = per_core * worker_cores
  print(f'\nBenchmark: {per_core:.0f} images/s per core (ds[step], one '
        f'thread, batch {args.batch}); {args.workers} worker process(es) '
        f'on {cores} cpus -> predicted input {predicted:.0f} images/s, '
        f'{1e3 * args.batch / predicted:.1f} ms per step')
  t0 = time.time()
  rows, printed = train_rows(cfg, os.path.join(tmp, 'run'))
  print(f'trained {args.steps} steps in {time.time() - t0:.1f} s')
  return report(rows, printed, args.batch, predicted)


def report(rows: list[dict], printed: str, batch: int,
           predicted: float) -> dict:
  """Prints the loop's intervals and the comparison; returns the figures.

  The loop is compared over the second half of its intervals: the worker's
  prefetch buffer, filled while the first step compiled, hides the input's
  pace until it drains.
  """
  print(f'\n{"step":>5s} {"images/s":>9s} {"data_wait":>10s} '
        f'{"alone ms":>9s}')
  for row in rows:
    print(f'{row["step"]:5d} {batch / row["time/step_s"]:9.0f} '
          f'{row["time/data_wait_fraction"]:10.2f} '
          f'{1e3 * row.get("time/step_alone_s", 0.0):9.1f}')
  late = rows[len(rows) // 2:]
  rate = float(np.median([batch / r['time/step_s'] for r in late]))
  wait = float(np.median([r['time/data_wait_fraction'] for r in late]))
  alone = float(np.median([r.get('time/step_alone_s', 0.0) for r in late]))
  device_rate = batch / max(alone, 1e-9)
  expected = min(predicted, device_rate)
  ratio = rate / expected
  note = 'waited for data' in printed
  print(f'\ndevice alone: {device_rate:.0f} images/s ({1e3 * alone:.1f} ms '
        f'per step); input: {predicted:.0f} -> the loop should run at '
        f'{expected:.0f} images/s, '
        f'{"input" if predicted < device_rate else "device"}-bound')
  print(f'loop (second half of the intervals, median): {rate:.0f} images/s '
        f'= {100 * ratio:.0f}% of that (tolerance '
        f'{100 * (1 - TOLERANCE):.0f}-{100 * (1 + TOLERANCE):.0f}%: '
        f'{"agrees" if abs(ratio - 1) <= TOLERANCE else "DISAGREES"}); '
        f'data_wait_fraction {wait:.2f}; input-bound note printed: '
        f'{"yes" if note else "no"}')
  return {'predicted': predicted, 'device_rate': device_rate, 'loop': rate,
          'ratio': ratio, 'data_wait_fraction': wait, 'note': note}


if __name__ == '__main__':
  main()
