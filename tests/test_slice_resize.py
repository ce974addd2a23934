"""A run checkpointed on one slice resumes on another (docs/training.md,
"Resuming on another slice").

The global batch of a step does not depend on how many devices or hosts
split it (``pipeline.train_dataset``: each host reads its contiguous rows of
one stream; the masked copies are the same rows of the global batch for any
device count), and Orbax restores a checkpoint into the new mesh's
shardings. So a run resumed on another slice logs the losses of an
uninterrupted run, up to rounding: the sums over the batch (the ring
losses, the gradient all-reduce; Gloo's between processes) add the same
numbers in another order when the batch is split another way. Measured on
CPU over 12 steps: at most 1.9e-7 relative for 4 -> 2 devices, 2.0e-7 for
2 processes -> 1 (one or two float32 ulps), hence ``RTOL`` = 1e-6.

A slice the global batch cannot be split over stops before any work with
one ``error:`` line naming the setting; the workdir is left as it was.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import object_stores
import support

from prolip_jax import errors
from prolip_jax.config import presets
from prolip_jax.data import mixture
from prolip_jax.training import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO = os.path.join(REPO, 'configs', 'prolip_micro.py')
STEPS = 12
# Float32 sums over another split of the batch round differently: at most
# 2.0e-7 relative measured (module docstring).
RTOL = 1e-6


def _config(num_devices):
  """The micro config (its warm-up and cosine) on the first ``num_devices``
  devices: batch 32 (a multiple of the masking stride 8 on 1, 2 or 4
  devices), no evaluator, checkpoints only where a run stops."""
  c = presets.load_config_file(MICRO)
  c.batch_size, c.total_steps, c.evals = 32, STEPS, {}
  c.checkpoint_every_steps = 1000
  c.mesh.num_devices = num_devices
  return c


def _rows(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return {r['step']: r for r in map(json.loads, f) if 'loss' in r}


def _losses(workdir):
  return {step: r['loss'] for step, r in _rows(workdir).items()}


def _assert_losses_match(resumed, uninterrupted, steps, rtol=RTOL):
  assert sorted(resumed) == sorted(uninterrupted) == list(range(1, STEPS + 1))
  np.testing.assert_allclose([resumed[s] for s in steps],
                             [uninterrupted[s] for s in steps], rtol=rtol)


def _one_error_line(text):
  lines = [l for l in text.strip().splitlines() if l.startswith('error: ')]
  assert len(lines) == 1, text
  return lines[0]


def _refused(config, workdir, capfd) -> str:
  """The one ``error:`` line of a run of ``config`` on ``workdir`` (as
  ``prolip_jax.main`` prints it), checking that nothing was written."""
  before = sorted(os.listdir(os.path.join(workdir, 'checkpoints')))
  capfd.readouterr()
  status = errors.cli_main(
      lambda: train.train_and_evaluate(config, workdir))
  assert status == errors.EXIT_USER_ERROR
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints'))) == before
  return _one_error_line(capfd.readouterr().err)


@pytest.mark.slow
def test_four_devices_resume_on_two(tmp_path, capfd):
  """Steps 1-6 on 4 devices, 7-12 on 2: the losses of an uninterrupted
  4-device run. 8 devices, or 3, cannot split the batch of 32: one line,
  nothing touched."""
  full, split = str(tmp_path / 'full'), str(tmp_path / 'split')
  train.train_and_evaluate(_config(4), full)
  assert train.train_and_evaluate(_config(4), split, max_steps=6)['step'] == 6

  # 8 devices: 4 pairs each, less than the masking stride of 8.
  line = _refused(_config(8), split, capfd)
  assert 'batch_size 32' in line and '8 batch shards' in line, line
  # 3 devices: the batch does not divide.
  line = _refused(_config(3), split, capfd)
  assert 'batch_size 32 is not divisible by the 3 batch shards' in line, line

  capfd.readouterr()
  assert train.train_and_evaluate(_config(2), split)['step'] == STEPS
  out = capfd.readouterr().out
  assert ('Resuming step 6 with changed settings (applied): '
          'mesh.num_devices: 4 -> 2') in out, out
  assert "mesh {'data': 2, 'fsdp': 1}" in out

  resumed, uninterrupted = _losses(split), _losses(full)
  # Before the resume: the same run, bit for bit.
  assert [resumed[s] for s in range(1, 7)] == [
      uninterrupted[s] for s in range(1, 7)]
  _assert_losses_match(resumed, uninterrupted, range(7, STEPS + 1))
  assert uninterrupted[STEPS] < uninterrupted[1]  # it trained


# ----------------------------------------------------------------------------
# Two processes -> one (helpers from tests/test_multiprocess.py and
# tests/test_mixture.py)



def _mixture_config_file(tmp_path) -> str:
  """A config file: ``_config``'s settings on all devices, a mixture of the
  digits (0.75) and a red array_record set (0.25), and a flat learning rate
  (no warm-up, the cosine's end equal to its peak): a run of 6 total steps
  resumed to 12 follows the lr of a 12-step run."""
  path = tmp_path / 'mixture.py'
  path.write_text(
      'from prolip_jax.config import presets\n'
      'def get_config():\n'
      f'  c = presets.load_config_file({MICRO!r})\n'
      f'  c.batch_size, c.total_steps, c.evals = 32, {STEPS}, {{}}\n'
      '  c.checkpoint_every_steps = 1000\n'
      '  c.optim.warmup_steps, c.optim.end_lr_ratio = 0, 1.0\n'
      '  c.data.sources = {\n'
      "      'red': {'name': 'array_record', 'weight': 0.25,\n"
      f"              'path': {support.red_shard(str(tmp_path / 'red'))!r}}},\n"
      "      'digits': {'name': 'digits', 'weight': 0.75}}\n"
      '  return c\n')
  return str(path)


def _two_processes(config_file, workdir, steps, timeout=600):
  """``prolip_jax.main`` as processes 0 and 1 of one run, 2 CPU devices
  each (a 4-device mesh); fails unless both end with status 0."""
  port = object_stores.free_port()
  procs = [subprocess.Popen(
      [sys.executable, '-m', 'prolip_jax.main', f'--config={config_file}',
       f'--workdir={workdir}', f'--config.total_steps={steps}',
       f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2',
       f'--process_id={i}'],
      env=support.cpu_env(2), cwd=REPO, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True) for i in range(2)]
  return support.outputs_of(procs, timeout)


@pytest.mark.serial
@pytest.mark.slow
def test_two_processes_resume_as_one_on_a_mixture(tmp_path, capfd):
  """A mixture run of 2 processes x 2 devices (data 4) stopped at step 6
  (its total) and resumed to step 12 by one process on 2 devices as an
  FSDP mesh that splits every parameter (fsdp 2, no size floor): the losses
  and each source's counts of an uninterrupted run on that one process
  (which compiles the step the resumed run then loads from the cache)."""
  config_file = _mixture_config_file(tmp_path)
  split, full = str(tmp_path / 'split'), str(tmp_path / 'full')

  def config(num_devices, **mesh):
    c = presets.load_config_file(config_file)
    c.mesh.num_devices = num_devices
    c.mesh.update(mesh)
    return c

  fsdp = config(2, data=1, fsdp=2, fsdp_min_size_mb=0.0)
  train.train_and_evaluate(fsdp, full)
  outputs = _two_processes(config_file, split, steps=6)
  assert "4 device(s) mesh {'data': 4, 'fsdp': 1}" in outputs[0]
  # This process has 8 devices: all of them cannot split the batch of 32.
  line = _refused(config(0), split, capfd)
  assert 'batch_size 32' in line and '8 batch shards' in line, line
  capfd.readouterr()
  assert train.train_and_evaluate(fsdp, split)['step'] == STEPS
  out = capfd.readouterr().out
  assert ('Resuming step 6 with changed settings (applied): mesh.data: -1 -> '
          '1; mesh.fsdp: 1 -> 2; mesh.fsdp_min_size_mb: 4.0 -> 0.0; '
          'mesh.num_devices: 0 -> 2; total_steps: 6 -> 12') in out, out
  assert "mesh {'data': 1, 'fsdp': 2}" in out
  assert 'Mixture from step' not in out  # same weights: no new stretch

  resumed, uninterrupted = _losses(split), _losses(full)
  # Steps 1-6: two processes (Gloo's sums, data 4) against one (fsdp 2).
  _assert_losses_match(resumed, uninterrupted, range(1, 7))
  _assert_losses_match(resumed, uninterrupted, range(7, STEPS + 1))
  # The same records: each source's count at every step is Grain's
  # interleave of the one global stream.
  rows = _rows(split)
  for step in range(1, STEPS + 1):
    expected = mixture.records_drawn((0.75, 0.25), step * 32)
    got = (rows[step]['data/source_count/digits'],
           rows[step]['data/source_count/red'])
    assert got == tuple(expected), step
