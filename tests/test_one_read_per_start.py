"""A start reads the workdir's stored state once.

On an object store every opening of Orbax's ``CheckpointManager`` is a round
of listings, and every read of a checkpoint's ``meta`` item a request: a
start opens the one manager the run saves with, reads the stored state
through it once (``checkpoint.StoredState``) and passes that down to the
checks, the tokenizer and the restore.
"""

import importlib.util
import os

import orbax.checkpoint as ocp
import pytest

from prolip_jax.config import presets
from prolip_jax.storage import checkpoint
from prolip_jax.training import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO = os.path.join(REPO, 'configs', 'prolip_micro.py')


def _export(workdir: str, out: str):
  """``tools/export_pytorch.py``: ``workdir``'s weights as a snapshot for
  ``init_from``."""
  spec = importlib.util.spec_from_file_location(
      'export_pytorch', os.path.join(REPO, 'tools', 'export_pytorch.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  module.export(workdir, out)


def _micro(total_steps: int):
  config = presets.load_config_file(MICRO)
  config.total_steps = total_steps
  config.checkpoint_every_steps = 1
  config.mesh.num_devices = 1
  return config


@pytest.fixture
def counted(monkeypatch):
  """``{'opened': [directories], 'meta': [steps]}``: every construction of
  a ``CheckpointManager`` (ours subclass it) and every read of a
  checkpoint's meta item while the test runs."""
  seen = {'opened': [], 'meta': []}
  real_init, real_meta = ocp.CheckpointManager.__init__, checkpoint.read_meta

  def init(self, directory, *args, **kwargs):
    seen['opened'].append(str(directory))
    real_init(self, directory, *args, **kwargs)

  def read_meta(mngr, step):
    seen['meta'].append(step)
    return real_meta(mngr, step)

  monkeypatch.setattr(ocp.CheckpointManager, '__init__', init)
  monkeypatch.setattr(checkpoint, 'read_meta', read_meta)
  return seen


@pytest.mark.slow
def test_a_start_a_resume_and_init_from_open_the_checkpoints_once(
    tmp_path, counted):
  workdir = str(tmp_path)
  checkpoints = os.path.join(workdir, 'checkpoints')
  config = _micro(total_steps=3)
  first = train.train_and_evaluate(config, workdir, max_steps=2)
  assert first['step'] == 2
  assert counted == {'opened': [checkpoints], 'meta': []}  # nothing stored
  counted['opened'].clear()

  resumed = train.train_and_evaluate(config, workdir)
  # The resumed step's meta is read once: for the drift check, the
  # tokenizer check and the restore.
  assert counted == {'opened': [checkpoints], 'meta': [2]}
  assert resumed['step'] == 3 and checkpoint.latest_step(workdir) == 3

  # init_from: the run's manager writes the imported weights as step 0,
  # whose meta is read once after that write.
  _export(workdir, str(tmp_path / 'snapshot'))
  config.init_from = str(tmp_path / 'snapshot')
  tuned = str(tmp_path / 'tuned')
  counted['opened'].clear()
  counted['meta'].clear()
  assert train.train_and_evaluate(config, tuned, max_steps=1)['step'] == 1
  assert counted == {'opened': [os.path.join(tuned, 'checkpoints')],
                     'meta': [0]}
