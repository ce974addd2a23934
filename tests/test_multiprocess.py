"""Two processes on 127.0.0.1 train like one process with as many devices.

Each process has 2 CPU devices; together they form a 4-device mesh, talk over
Gloo, feed only their half of every global batch and write one collective
Orbax checkpoint. Their loss curve must match one process with 4 devices, and
so must their configured evaluator (each process decodes half of every eval
batch; the embeddings are gathered on both).
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, 'configs', 'prolip_micro.py')
STEPS = 4


def _free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _env(devices):
  env = dict(os.environ)
  env['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={devices}'
  env['JAX_PLATFORMS'] = 'cpu'
  return env


def _config_with_evaluator(tmp_path) -> str:
  """The micro config plus a zero-shot evaluator on the held-out digits,
  run at the end of training."""
  path = tmp_path / 'micro_with_eval.py'
  path.write_text(
      'from prolip_jax import presets\n'
      'def get_config():\n'
      f'  c = presets.load_config_file({CONFIG!r})\n'
      "  c.evals = {'digits_zs': {'kind': 'zero_shot', "
      "'data': 'digits:heldout', 'every_steps': 0, 'batch_size': 200}}\n"
      '  return c\n')
  return str(path)


def _cmd(workdir, extra=(), config=CONFIG):
  return [sys.executable, '-m', 'prolip_jax.main', f'--config={config}',
          f'--workdir={workdir}', f'--config.total_steps={STEPS}',
          '--config.batch_size=32', '--config.mesh.data=-1', *extra]


def _rows(workdir):
  return [json.loads(l) for l in open(os.path.join(workdir, 'metrics.jsonl'))]


def _losses(workdir):
  return [r['loss'] for r in _rows(workdir) if 'loss' in r]


def _evaluated(workdir):
  return [r for r in _rows(workdir) if 'digits_zs/csd_top1' in r]


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
  config = _config_with_evaluator(tmp_path)
  single = str(tmp_path / 'single')
  subprocess.run(_cmd(single, config=config), env=_env(4), check=True,
                 cwd=REPO, timeout=600, capture_output=True)

  multi = str(tmp_path / 'multi')
  port = _free_port()
  procs = [
      subprocess.Popen(
          _cmd(multi, [f'--coordinator_address=127.0.0.1:{port}',
                       '--num_processes=2', f'--process_id={i}'],
               config=config),
          env=_env(2), cwd=REPO, stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  outputs = []
  for p in procs:
    try:
      out, _ = p.communicate(timeout=600)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    outputs.append(out)
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  assert '4 device(s)' in outputs[0]

  one, two = _losses(single), _losses(multi)
  assert len(one) == len(two) == STEPS
  np.testing.assert_allclose(two, one, rtol=1e-5)
  assert one[-1] != one[0]  # it trained
  assert os.path.isdir(os.path.join(multi, 'checkpoints', str(STEPS)))
  # The evaluator: one row at the last step, the same numbers (1,000 digits;
  # parameters equal to float tolerance, so at most a tie may flip).
  (ev_one,), (ev_two,) = _evaluated(single), _evaluated(multi)
  assert ev_one['step'] == ev_two['step'] == STEPS
  for key in ('digits_zs/csd_top1', 'digits_zs/cosine_top5'):
    assert ev_two[key] == pytest.approx(ev_one[key], abs=2e-3)
  assert 'digits_zs: csd_top1' in outputs[0]
