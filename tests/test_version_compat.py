"""A checkpoint written under the oldest supported JAX stack restores and
resumes under this one (the project asks for version ranges, not pins).

Needs a second Python with the oldest stack (CI's Python 3.12 leg points
``PROLIP_OLDEST_PYTHON`` at the reference Python 3.11 environment of
``constraints/py311.txt``, jax 0.10.2); skipped without one.

The old stack trains the micro config for 4 steps with checkpoints at 2
and 4 and records the parameters of both. This stack then (1) reads step 2
and must find the very same bytes, and (2) resumes the run from step 2 and
trains steps 3 and 4, which must match the old stack's own steps 3 and 4 to
float32 rounding (two XLA versions need not round alike, so not bit for
bit).
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from prolip_jax.storage import checkpoint

from support import xla_flags

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO = os.path.join(REPO, 'configs', 'prolip_micro.py')
FLAGS = ['--config', MICRO, '--config.total_steps=4',
         '--config.checkpoint_every_steps=2', '--config.keep_checkpoints=5',
         '--config.mesh.num_devices=1']

# Run by the old Python: its jax version, and each checkpoint's parameters.
DUMP = '''
import sys, jax, numpy as np
from prolip_jax.storage import checkpoint
workdir, out = sys.argv[1], sys.argv[2]
arrays = {}
for step in (2, 4):
  params, _ = checkpoint.load_params(workdir, step)
  for i, leaf in enumerate(jax.tree.leaves(params)):
    arrays[f'{step}/{i}'] = np.asarray(leaf)
np.savez(out, **arrays)
print(jax.__version__)
'''


def _env():
  env = dict(os.environ)
  env['PYTHONPATH'] = REPO + os.pathsep + env.get('PYTHONPATH', '')
  env['JAX_PLATFORMS'] = 'cpu'
  env['XLA_FLAGS'] = xla_flags(1)
  return env


def _run(python, *args):
  proc = subprocess.run([python, *args], cwd=REPO, env=_env(),
                        capture_output=True, text=True, timeout=600,
                        check=False)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  return proc.stdout


def _losses(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return {r['step']: r['loss'] for r in rows if 'loss' in r}


def test_oldest_stacks_checkpoint_restores_and_resumes_here(tmp_path):
  oldest = os.environ.get('PROLIP_OLDEST_PYTHON')
  if not oldest:
    pytest.skip('set PROLIP_OLDEST_PYTHON to a Python with the oldest '
                'supported JAX stack (CI\'s Python 3.12 leg does)')
  old_run = str(tmp_path / 'old')
  _run(oldest, '-m', 'prolip_jax.main', '--workdir', old_run, *FLAGS)
  dump = str(tmp_path / 'old_params.npz')
  old_jax = _run(oldest, '-c', DUMP, old_run, dump).strip().splitlines()[-1]
  if old_jax == jax.__version__:
    pytest.skip(f'both Pythons have jax {old_jax}: nothing to compare')
  old = np.load(dump)

  # (1) The old step 2 reads back here byte for byte.
  params, _ = checkpoint.load_params(old_run, 2)
  leaves = jax.tree.leaves(params)
  assert len(leaves) == len([k for k in old.files if k.startswith('2/')])
  for i, leaf in enumerate(leaves):
    np.testing.assert_array_equal(np.asarray(leaf), old[f'2/{i}'])

  # (2) Resume from step 2 under this stack: steps 3 and 4 as the old
  # stack trained them. Step 4's checkpoint goes, as after a crash at step 3.
  resumed = str(tmp_path / 'resumed')
  shutil.copytree(old_run, resumed)
  shutil.rmtree(os.path.join(resumed, 'checkpoints', '4'))
  out = _run(sys.executable, '-m', 'prolip_jax.main', '--workdir', resumed,
             *FLAGS)
  assert 'step 2' in out.lower() or 'resum' in out.lower(), out[-2000:]
  old_losses, new_losses = _losses(old_run), _losses(resumed)
  for step in (3, 4):
    np.testing.assert_allclose(new_losses[step], old_losses[step], rtol=1e-5)
  # The parameters: Adam moves a parameter whose gradient is near zero by
  # up to a full learning rate on rounding noise alone, so element-wise
  # tolerances do not fit; the update of steps 3-4 as a whole must agree.
  params, _ = checkpoint.load_params(resumed, 4)
  leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(params)]
  new4 = np.concatenate([x.ravel() for x in leaves])
  old4, old2 = (np.concatenate([old[f'{s}/{i}'].astype(np.float64).ravel()
                                for i in range(len(leaves))]) for s in (4, 2))
  disagreement = np.linalg.norm(new4 - old4) / np.linalg.norm(old4 - old2)
  assert disagreement < 1e-2, disagreement
