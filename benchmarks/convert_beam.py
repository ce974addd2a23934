"""Conversion throughput: the one-machine converter against Beam's DirectRunner.

python benchmarks/convert_beam.py [--images 4096] [--tars 16] [--repeats 2]

Writes ``--images`` realistic JPEGs (``input_pipeline.make_jpegs``: web-photo
sizes, quality 90) with captions into ``--tars`` webdataset tars, then
converts them to array_record shards with

* ``webdataset.convert_webdataset`` (``tools/convert_webdataset.py``), one
  process and ``--workers 2``;
* ``beam.convert_webdataset`` (``tools/convert_beam.py``) on the
  DirectRunner in one process, and with two worker processes
  (``--direct_num_workers=2 --direct_running_mode=multi_processing``);

and prints records/s of each (the best of ``--repeats`` runs, start-up
included: worker processes, Beam's pipeline set-up) with the machine it ran
on. Needs apache-beam (``pip install 'prolip_jax[beam]'``, docs/data.md).
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import shutil
import sys
import tarfile
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from benchmarks import input_pipeline
from prolip_jax.conversion import beam
from prolip_jax.conversion import webdataset
# pylint: enable=g-import-not-at-top,wrong-import-position


def write_tars(examples, directory: str, tars: int) -> str:
  """The examples as ``tars`` webdataset tars; returns their glob."""
  per = -(-len(examples) // tars)
  for t in range(tars):
    with tarfile.open(os.path.join(directory, f'{t:05d}.tar'), 'w') as tar:
      for k, (image, caption) in enumerate(examples[t * per:(t + 1) * per]):
        for ext, data in (('jpg', image), ('txt', caption.encode())):
          info = tarfile.TarInfo(f'{t}_{k:05d}.{ext}')
          info.size = len(data)
          tar.addfile(info, io.BytesIO(data))
  return os.path.join(directory, '*.tar')


def best_rate(convert, repeats: int, scratch: str) -> float:
  """Best records/s of ``convert(out_dir) -> summary`` over ``repeats``
  fresh output folders."""
  best = 0.0
  for r in range(repeats):
    out = os.path.join(scratch, f'out{r}')
    t0 = time.perf_counter()
    summary = convert(out)
    rate = summary['records_written'] / (time.perf_counter() - t0)
    best = max(best, rate)
    shutil.rmtree(out)
  return best


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--images', type=int, default=4096)
  parser.add_argument('--tars', type=int, default=16)
  parser.add_argument('--repeats', type=int, default=2)
  args = parser.parse_args(argv)
  beam.require_beam()
  print(f'machine: {platform.node()}, {os.cpu_count()} CPU cores, '
        f'{platform.processor() or platform.machine()}')
  with tempfile.TemporaryDirectory() as scratch:
    examples = input_pipeline.make_jpegs(args.images)
    mb = sum(len(i) for i, _ in examples) / 1e6
    os.makedirs(os.path.join(scratch, 'in'))
    tars = write_tars(examples, os.path.join(scratch, 'in'), args.tars)
    print(f'{args.images} JPEGs ({mb:.0f} MB) in {args.tars} tars')
    two = ['--direct_num_workers=2', '--direct_running_mode=multi_processing']
    runs = {
        'webdataset.convert_webdataset, 1 process':
            lambda src, out: webdataset.convert_webdataset(src, out,
                                                           workers=1),
        'webdataset.convert_webdataset, --workers 2':
            lambda src, out: webdataset.convert_webdataset(src, out,
                                                           workers=2),
        'Beam DirectRunner, 1 process (in_memory)':
            beam.convert_webdataset,
        'Beam DirectRunner, 2 worker processes':
            lambda src, out: beam.convert_webdataset(
                src, out, pipeline_args=two),
    }
    # The fixed cost inside those rates (processes, pipeline set-up): the
    # same conversion of one tar of one record.
    os.makedirs(os.path.join(scratch, 'tiny'))
    tiny = write_tars(examples[:1], os.path.join(scratch, 'tiny'), 1)
    for name, convert in runs.items():
      rate = best_rate(lambda out: convert(tars, out), args.repeats, scratch)
      start = 1 / best_rate(lambda out: convert(tiny, out), args.repeats,
                            scratch)
      print(f'{name:45s} {rate:7.1f} records/s  (one record: {start:.2f} s)',
            flush=True)


if __name__ == '__main__':
  main()
