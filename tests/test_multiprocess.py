"""Two processes on 127.0.0.1 train like one process with as many devices.

Each process has 2 CPU devices; together they form a 4-device mesh, talk over
Gloo, feed only their half of every global batch and write one collective
Orbax checkpoint. Their loss curve must match one process with 4 devices, and
so must their configured evaluator (each process decodes half of every eval
batch; the embeddings are gathered on both).

One stop for every host: SIGTERM or Ctrl-C on one process stops both after
the same step with one checkpoint (exit 75; 130 on the Ctrl-C'd one), and
resuming gives the loss curve of an uninterrupted run; an exception on one
process ends both within a minute, with one ``error:`` line naming it;
processes started with different settings both stop at start, naming the
keys.
"""

import os
import signal
import subprocess
import time

import numpy as np
import pytest

from prolip_jax.training import host_agreement
import support
from support import free_port
from support import main_command
from support import metric_rows
from support import metric_values
from support import stop_steps
from support import TWO_PROCESS_STEPS
from support import TwoProcesses

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, 'configs', 'prolip_micro.py')
STEPS = 4


def _env(devices):
  return support.cpu_env(devices)


def _config_with_evaluator(tmp_path) -> str:
  """The micro config plus a zero-shot evaluator on the held-out digits,
  run at the end of training."""
  path = tmp_path / 'micro_with_eval.py'
  path.write_text(
      'from prolip_jax.config import presets\n'
      'def get_config():\n'
      f'  c = presets.load_config_file({CONFIG!r})\n'
      "  c.evals = {'digits_zs': {'kind': 'zero_shot', "
      "'data': 'digits:heldout', 'every_steps': 0, 'batch_size': 200}}\n"
      '  return c\n')
  return str(path)


def _evaluated(workdir):
  return [r for r in metric_rows(workdir) if 'digits_zs/csd_top1' in r]


@pytest.mark.serial
@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
  config = _config_with_evaluator(tmp_path)
  single = str(tmp_path / 'single')
  subprocess.run(main_command(single, config=config, steps=STEPS),
                 env=_env(4), check=True, cwd=REPO, timeout=600,
                 capture_output=True)

  multi = str(tmp_path / 'multi')
  port = free_port()
  procs = [
      subprocess.Popen(
          main_command(multi, [f'--coordinator_address=127.0.0.1:{port}',
                               '--num_processes=2', f'--process_id={i}'],
                       config=config, steps=STEPS),
          env=_env(2), cwd=REPO, stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  outputs = support.outputs_of(procs, 600)
  assert '4 device(s)' in outputs[0]

  one, two = metric_values(single), metric_values(multi)
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


# ----------------------------------------------------------------------------
# One stop for every host

def _trained_past(workdir, step):
  """A ``done()`` for ``wait_until``: metrics.jsonl has a row past ``step``."""
  def done():
    try:
      return metric_rows(workdir)[-1]['step'] > step
    except (FileNotFoundError, IndexError, ValueError, KeyError):
      return False  # not written yet, or a line being written
  return done


def _checkpoints(workdir) -> list[int]:
  return sorted(int(d) for d in os.listdir(os.path.join(workdir, 'checkpoints'))
                if d.isdigit())


@pytest.mark.serial
@pytest.mark.slow
def test_sigterm_or_ctrl_c_on_one_host_stops_every_host_at_one_step(
    tmp_path, two_process_losses):
  work = str(tmp_path / 'interrupted')
  # The scheduler's SIGTERM reaches process 1 only.
  first = TwoProcesses(work, tmp_path, 'first')
  first.wait_until(_trained_past(work, 2))
  first.procs[1].send_signal(signal.SIGTERM)
  assert first.wait() == [75, 75], first.output(1)[-3000:]
  stop, other = stop_steps(first)
  assert stop == other and 3 <= stop < TWO_PROCESS_STEPS
  assert _checkpoints(work) == [stop]  # one collective checkpoint
  assert 'Stopped by SIGTERM at step' in first.output(0)

  # The resumed run: Ctrl-C on process 0 only.
  second = TwoProcesses(work, tmp_path, 'second')
  second.wait_until(_trained_past(work, stop + 1))
  second.procs[0].send_signal(signal.SIGINT)
  assert second.wait() == [130, 75], second.output(0)[-3000:]
  stop2, other = stop_steps(second)
  assert stop2 == other and stop < stop2 < TWO_PROCESS_STEPS
  assert _checkpoints(work) == [stop, stop2]

  third = TwoProcesses(work, tmp_path, 'third')
  assert third.wait() == [0, 0], third.output(0)[-3000:]
  resumed = metric_values(work)
  assert len(resumed) == len(two_process_losses) == TWO_PROCESS_STEPS
  np.testing.assert_allclose(resumed, two_process_losses, rtol=1e-6)


@pytest.mark.serial
@pytest.mark.slow
def test_an_exception_on_one_host_ends_every_host_within_a_minute(tmp_path):
  work = str(tmp_path / 'failing')
  run = TwoProcesses(work, tmp_path, 'failing',
                      ['--config.debug_raise_at_step=3',
                       '--config.debug_raise_process=1'])
  run.wait_until(lambda: 'fault injected' in run.output(1))
  raised = time.time()
  codes = run.wait(timeout=120)
  assert time.time() - raised < 60
  assert all(code != 0 for code in codes), codes
  lines = [l for l in run.output(1).splitlines() if l.startswith('error:')]
  assert len(lines) == 1, run.output(1)[-3000:]
  assert 'process 1 of 2' in lines[0]
  assert 'fault injected after step 3' in lines[0]


# ----------------------------------------------------------------------------
# Hosts started with different settings


def test_hosts_with_different_settings_are_named_key_by_key():
  """The line every host prints: each differing key with process 0's value
  and the other's, the code digest as another checkout (issue 45,
  finding 5)."""
  config = support.micro_config(total_steps=20)
  chief = host_agreement.settings(config)
  config.total_steps = 12
  config.optim.lr = 0.5
  other = host_agreement.settings(config)
  assert chief[host_agreement.CODE_KEY] == other[host_agreement.CODE_KEY]
  assert host_agreement.differences(other, chief) == ['optim.lr',
                                                      'total_steps']
  stale_code = dict(chief, **{host_agreement.CODE_KEY: 'another'})
  line = host_agreement.message([chief, other, chief, stale_code])
  assert line == (
      'the hosts of this run were started with different settings, which '
      'would leave them waiting for each other: process 1: optim.lr '
      f'({chief["optim.lr"]} on process 0, 0.5 on process 1), total_steps '
      '(20 on process 0, 12 on process 1); process 3: (the prolip_jax code) '
      '(another checkout or version); start every host with the same '
      'command line, config file and prolip_jax version')
  assert '\n' not in line


@pytest.mark.serial
@pytest.mark.slow
def test_hosts_started_with_different_settings_stop_before_any_step(
    tmp_path):
  """Process 1 given another total_steps: both stop at start, before any
  step or lock, each with one line naming the key (they waited for each
  other forever before)."""
  work, port = str(tmp_path / 'run'), free_port()
  logs = [tmp_path / f'p{i}.log' for i in range(2)]
  procs = []
  for i, log in enumerate(logs):
    with open(log, 'w') as out:
      procs.append(subprocess.Popen(
          main_command(work, [f'--coordinator_address=127.0.0.1:{port}',
                              '--num_processes=2', f'--process_id={i}'],
                       steps=20 if i == 0 else 12),
          env=_env(2), cwd=REPO, stdout=out, stderr=subprocess.STDOUT))
  codes = [p.wait(timeout=300) for p in procs]
  for i, code in enumerate(codes):
    text = logs[i].read_text()
    assert code == 2, text[-3000:]
    lines = [l for l in text.splitlines() if l.startswith('error:')]
    assert len(lines) == 1, text[-3000:]
    assert (f'process {i} of 2' in lines[0] and 'total_steps (20 on process '
            '0, 12 on process 1)' in lines[0]), lines[0]
    assert 'Compiling' not in text
  assert not os.path.exists(os.path.join(work, '.lock'))
