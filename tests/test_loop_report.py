"""What a training run reports beyond the loss: the step time split into
data wait and device work (against iterators that sleep a known time), the
MFU (against a hand computation), the one-time data-wait note and its core
estimate, the ``profile_steps`` trace and the optional W&B rows (offline,
read back from W&B's own run file and compared with ``metrics.jsonl``)."""

import contextlib
import glob
import json
import math
import os
import struct
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prolip_jax import errors
from prolip_jax import objectives
from prolip_jax.config import presets
from prolip_jax.models import ModelConfig
from prolip_jax.training import loop_report
from prolip_jax.training import mfu
from prolip_jax.training import profiling
from prolip_jax.training import progress
from prolip_jax.training import step_timing
from prolip_jax.training import train
from prolip_jax.training import wandb_sink

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100 = types.SimpleNamespace(device_kind='NVIDIA H100 80GB HBM3')
CPU = types.SimpleNamespace(device_kind='cpu')


def _config(name='prolip_micro.py', **overrides):
  config = presets.load_config_file(os.path.join(REPO, 'configs', name))
  for key, value in overrides.items():
    node = config
    *parents, last = key.split('.')
    for part in parents:
      node = node[part]
    node[last] = value
  return config


def _report(config, devices, is_chief=True, tensorboard='/nonexistent',
            start=0, end=1000):
  return loop_report.LoopReport(
      config, objectives.get(config.objective), devices,
      ModelConfig.from_config(config.model).to_dict(),
      start, end, is_chief, lambda: None, tensorboard)


class _SleepingIterator:
  """Yields a batch after sleeping ``seconds`` (a slow input pipeline)."""

  def __init__(self, seconds):
    self.seconds = seconds

  def __iter__(self):
    return self

  def __next__(self):
    time.sleep(self.seconds)
    return np.zeros((4, 2), np.float32)


def _run_steps(report, data_iter, device_s, steps, start=0):
  """Drives ``report`` as the training loop does, with a jitted step and
  ``device_s`` of simulated device work per step (a host sleep where the
  loop waits for the device); returns the last log step's fields."""
  fn = jax.jit(lambda x: x + 1)
  fields = {}
  for step in range(start, start + steps):
    batch = report.data(next, data_iter)
    batch = report.data(jnp.asarray, batch)
    report.before_step(step)
    out = fn(batch)
    time.sleep(device_s)
    report.after_step(step + 1, out)
    if (step + 1) % report.log_every == 0:
      jax.block_until_ready(out)
      fields = report.end_interval(step + 1)
      report.start_interval(step + 1)
  return fields


# ----------------------------------------------------------------------------
# The step-time split


@pytest.mark.serial
def test_data_wait_split_against_a_sleeping_iterator():
  """30 ms asleep in next() and 10 ms of 'device' per step: the split says
  30 / 10 of 40 ms, 75% waiting."""
  config = _config(log_every_steps=5)
  report = _report(config, [CPU])
  it = _SleepingIterator(0.030)
  jax.jit(lambda x: x + 1)(jnp.zeros((4, 2)))  # compiled before timing
  report.start_interval(0)
  fields = _run_steps(report, it, 0.010, 10)
  assert fields['time/data_wait_s'] == pytest.approx(0.030, abs=0.006)
  assert fields['time/device_s'] == pytest.approx(0.010, abs=0.006)
  assert fields['time/step_s'] == pytest.approx(
      fields['time/data_wait_s'] + fields['time/device_s'], rel=1e-9)
  assert fields['time/data_wait_fraction'] == pytest.approx(0.75, abs=0.1)
  # The log step, timed alone: its 10 ms of device work.
  assert fields['time/step_alone_s'] == pytest.approx(0.010, abs=0.006)


def test_step_timer_arithmetic_on_a_fake_clock():
  """Exact seconds on a fake clock: data wait, excluded time (a checkpoint)
  and the log step timed alone."""
  now = [100.0]
  drained = []
  timer = step_timing.StepTimer(drain=lambda: drained.append(now[0]),
                                clock=lambda: now[0])

  def sleep(seconds):
    now[0] += seconds

  timer.start()
  for number in (1, 2, 3, 4):
    timer.data(sleep, 0.2)  # next(data_iter)
    timer.data(sleep, 0.05)  # host_to_global
    timer.before_step(number, timed_alone=number == 4)
    sleep(0.5)  # dispatch and device
  timer.excluded(sleep, 7.0)  # a checkpoint: no step time
  interval = timer.stop(4)
  assert interval.steps == 4
  assert interval.step_s == pytest.approx((4 * 0.75) / 4)
  assert interval.data_wait_s == pytest.approx(0.25)
  assert interval.device_s == pytest.approx(0.5)
  assert interval.data_wait_fraction == pytest.approx(1 / 3)
  assert interval.step_alone_s == pytest.approx(0.5 + 7.0)  # to the log step
  assert len(drained) == 1  # only the log step waits for the previous one
  timer.start()
  assert timer.stop(5) is None  # no step in the interval: nothing to say


def test_first_interval_of_only_the_compiling_step_has_no_fields():
  config = _config(log_every_steps=1)
  report = _report(config, [CPU])
  report.before_step(0)  # the compiling step
  report.start_interval(1)  # what the loop does once step 1 is done
  assert report.end_interval(1) == {}


# ----------------------------------------------------------------------------
# MFU


def test_mfu_matches_a_hand_computation():
  """256 pairs of 147.6 GFLOP every 0.5 s on 8 devices of 989 TFLOP/s."""
  got = step_timing.mfu(256, 147.6e9, 0.5, 8, 989e12)
  assert got == pytest.approx(256 * 147.6e9 / 0.5 / 8 / 989e12)
  assert got == pytest.approx(0.0095515, rel=1e-4)
  assert step_timing.model_flops_per_device(256, 147.6e9, 0.5, 8) == \
      pytest.approx(9.4464e12)


def test_loop_mfu_uses_the_aot_flops_and_the_chip_table():
  """The loop's MFU for B/16 on H100s: the aot report's analytic FLOPs per
  pair (``run_flops_per_pair``, with the masked copies) over the measured
  step, against the table's 989 TFLOP/s."""
  config = _config('prolip_b16.py', batch_size=4096)
  report = _report(config, [H100] * 8)
  flops = mfu.run_flops_per_pair(
      config, ModelConfig.from_config(config.model).to_dict(),
      objectives.get(config.objective))['train']
  assert report.flops_per_pair == flops
  assert 147e9 < flops < 148.5e9  # docs/performance.md: 147 GFLOP per pair
  interval = step_timing.Interval(steps=20, step_s=1.6, data_wait_s=0.1,
                                  step_alone_s=1.45)
  fields = report.fields(interval)
  assert fields['perf/mfu'] == pytest.approx(
      4096 * flops / 1.6 / 8 / 989e12)
  assert fields['perf/model_tflops_per_device'] == pytest.approx(
      4096 * flops / 1.6 / 8 / 1e12)
  assert 'dense bf16 peak of 989 TFLOP/s' in loop_report.mfu_basis(
      report.chip, report.kind, flops, 8)


def test_chip_table_by_device_kind():
  assert mfu.chip_of_device_kind('TPU v5 lite').peak_bf16_flops == \
      197e12
  assert mfu.chip_of_device_kind('TPU v4').peak_bf16_flops == 275e12
  assert mfu.chip_of_device_kind('NVIDIA H200').peak_bf16_flops == \
      989e12
  for unknown in ('cpu', 'NVIDIA H100 PCIe', 'TPU v3'):
    assert mfu.chip_of_device_kind(unknown) is None


def test_cpu_gets_model_flops_and_no_mfu(capsys):
  config = _config()
  report = _report(config, [CPU])
  assert 'No MFU: no peak FLOP/s known' in capsys.readouterr().out
  fields = report.fields(step_timing.Interval(10, 0.01, 0.001, None))
  assert 'perf/mfu' not in fields
  assert fields['perf/model_tflops_per_device'] == pytest.approx(
      16 * report.flops_per_pair / 0.01 / 1e12)
  assert 'time/step_alone_s' not in fields


def test_progress_line_shows_the_split_and_the_mfu():
  row = {'loss': 1.0, 'scale': 10.0, 'bias': -10.0, 'lr': 1e-4,
         'samples_per_sec': 1000.0, 'time/step_s': 0.3125,
         'time/data_wait_s': 0.0125, 'time/device_s': 0.3,
         'time/data_wait_fraction': 0.04,
         'perf/model_tflops_per_device': 400.0, 'perf/mfu': 0.4131}
  line = progress.progress_line(20, 100, row, 10.0, 5.0)
  assert 'step 312 ms (data 12.5 ms 4%, device 300 ms), MFU 41.3%' in line
  del row['perf/mfu']
  line = progress.progress_line(20, 100, row, 10.0, 5.0)
  assert '400 model TFLOP/s/device (no peak known: no MFU)' in line
  plain = {k: v for k, v in row.items() if not k.startswith(('time/',
                                                             'perf/'))}
  assert 'step' not in progress.progress_line(20, 100, plain, 1.0, 1.0)[8:]


# ----------------------------------------------------------------------------
# The data-wait note


def test_cores_needed_against_a_hand_computation():
  """2 cores make a batch per 40 ms; free input would step every 12 ms
  (the step alone) -> 2 x 40 / 12 = 6.7 -> 7 cores."""
  interval = step_timing.Interval(20, 0.040, 0.030, 0.012)
  assert interval.device_s == pytest.approx(0.010)
  assert step_timing.cores_needed(2, interval) == 7
  # Not timed alone: the non-waiting 10 ms -> 2 x 40 / 10 = 8.
  assert step_timing.cores_needed(
      2, step_timing.Interval(20, 0.040, 0.030, None)) == 8
  # The device alone takes the whole step: more cores gain nothing.
  balanced = step_timing.Interval(20, 0.040, 0.030, 0.040)
  assert step_timing.cores_needed(2, balanced) == 2
  note = step_timing.data_wait_note(balanced, 21, 40, 2, 16)
  assert 'would not speed it up' in note
  assert step_timing.input_cores(0) == 1 and step_timing.input_cores(6) == 6


def test_data_wait_note_text():
  note = step_timing.data_wait_note(
      step_timing.Interval(20, 0.040, 0.030, 0.012), 21, 40, 0, 2)
  assert note.startswith('note: steps 21-40 waited for data 75% of the time')
  # In-process loading counts as 1 core: 1 x 40 / 12 = 3.3 -> 4.
  assert 'data.num_workers=4; it uses 1 now' in note
  assert 'more than the 2 this host has' in note
  assert 'Estimate: cores now x step time / step time with free input' in \
      note
  assert '\n' not in note


@pytest.mark.serial
def test_a_data_bound_run_says_so_once(capsys):
  config = _config(log_every_steps=3)
  report = _report(config, [CPU])
  jax.jit(lambda x: x + 1)(jnp.zeros((4, 2)))
  capsys.readouterr()
  report.start_interval(0)
  _run_steps(report, _SleepingIterator(0.02), 0.002, 12)
  notes = [l for l in capsys.readouterr().out.splitlines()
           if l.startswith('note:')]
  assert len(notes) == 1, notes
  # Not from the first interval (the prefetch buffer hides waits there).
  assert notes[0].startswith('note: steps 4-6 waited for data')
  quiet = _report(config, [CPU], is_chief=False)
  quiet.start_interval(0)
  _run_steps(quiet, _SleepingIterator(0.02), 0.002, 9)
  assert capsys.readouterr().out == ''


@pytest.mark.serial
def test_a_run_that_keeps_up_says_nothing(capsys):
  config = _config(log_every_steps=3)
  report = _report(config, [CPU])
  jax.jit(lambda x: x + 1)(jnp.zeros((4, 2)))
  capsys.readouterr()
  report.start_interval(0)
  # 100 ms of 'device' per step: the note's 5% is then 5 ms, well above
  # the host's own jitter in a step (about 1 ms was seen against 20 ms).
  _run_steps(report, iter([np.zeros((4, 2), np.float32)] * 9), 0.1, 9)
  assert 'note:' not in capsys.readouterr().out


# ----------------------------------------------------------------------------
# profile_steps


def test_profile_steps_are_parsed_and_checked():
  assert profiling.parse_steps('') is None
  assert profiling.parse_steps('10:12') == (10, 12)
  assert profiling.parse_steps(' 3 : 3 ') == (3, 3)
  for bad in ('5', '0:2', '4:3', 'a:b', '1:2:3'):
    with pytest.raises(ValueError, match='profile_steps'):
      profiling.parse_steps(bad)
  with pytest.raises(ValueError, match='profile_steps'):
    train.validate_config(_config(profile_steps='12'))


def _profile_files(folder):
  return glob.glob(os.path.join(str(folder), 'plugins', 'profile', '*',
                                '*.xplane.pb'))


def test_profile_writes_a_trace_of_the_steps(tmp_path, capsys):
  config = _config(log_every_steps=100, profile_steps='2:3')
  tb = tmp_path / 'tensorboard'
  report = _report(config, [CPU], tensorboard=tb, end=5)
  _run_steps(report, iter([np.zeros((4, 2), np.float32)] * 5), 0.0, 2)
  assert report.profiler.active and not _profile_files(tb)
  _run_steps(report, iter([np.zeros((4, 2), np.float32)] * 5), 0.0, 1,
             start=2)
  assert not report.profiler.active  # stopped after step 3
  assert len(_profile_files(tb)) == 1
  assert 'Wrote the profile of steps 2-3' in capsys.readouterr().out
  report.close()  # nothing left to stop


def test_profile_is_written_locally_then_uploaded(tmp_path, monkeypatch):
  """A gs:// workdir: the trace goes to a local folder and is copied to the
  TensorBoard folder when it stops (nothing there before)."""
  bucket = tmp_path / 'bucket_tensorboard'
  staged = []

  @contextlib.contextmanager
  def local_dir_for(dest):
    local = tmp_path / 'local'
    local.mkdir()
    staged.append(str(local))
    yield str(local)
    from prolip_jax.storage import paths  # pylint: disable=g-import-not-at-top
    paths.upload_tree(str(local), str(dest))

  monkeypatch.setattr(profiling.paths, 'local_dir_for', local_dir_for)
  profiler = profiling.StepProfiler((1, 5), bucket, 0, 2, is_chief=False)
  profiler.before_step(1)
  out = jax.jit(lambda x: x * 2)(jnp.ones(3))
  profiler.after_step(1, out)
  assert profiler.active and not _profile_files(bucket)
  profiler.close()  # the run ended at step 2, before step 5
  assert len(_profile_files(staged[0])) == 1  # written here first,
  assert len(_profile_files(bucket)) == 1  # then copied


def test_profile_range_outside_the_run_is_skipped(capsys):
  profiler = profiling.StepProfiler((2, 4), '/nonexistent', 10, 20, True)
  assert profiler.first is None
  assert 'no trace' in capsys.readouterr().out
  resumed = profiling.StepProfiler((5, 30), '/nonexistent', 10, 20, True)
  assert (resumed.first, resumed.last) == (11, 20)


# ----------------------------------------------------------------------------
# Weights & Biases


def _wandb_records(path):
  """The ``Record`` protos of a ``run-*.wandb`` file (a LevelDB-style log:
  32 KiB blocks, a 7-byte header per piece, after W&B's 7-byte header)."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top
  with open(path, 'rb') as f:
    data = f.read()
  assert data[:4] == b':W&B'
  records, chunks, pos, block = [], [], 7, 32768
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a header
      pos += block - pos % block
      continue
    length, kind = struct.unpack('<HB', data[pos + 4:pos + 7])
    if pos + 7 + length > len(data):  # still being written
      break
    chunks.append(data[pos + 7:pos + 7 + length])
    pos += 7 + length
    if kind in (1, 4):  # a full record, or the last piece of one
      record = wandb_internal_pb2.Record()
      record.ParseFromString(b''.join(chunks))
      chunks = []
      records.append(record)
  return records


def wandb_rows(wandb_dir, timeout=30.0):
  """``{step: row}`` of an offline W&B run, read from its ``run-*.wandb``
  file (W&B's own keys, those starting with '_', left out). W&B's service
  may still be writing the file when ``finish()`` has returned: it is read
  again until its ``exit`` record is there."""
  (path,) = glob.glob(os.path.join(str(wandb_dir), 'wandb', 'offline-run-*',
                                   'run-*.wandb'))
  deadline = time.time() + timeout
  while True:
    records = _wandb_records(path)
    kinds = [r.WhichOneof('record_type') for r in records]
    if 'exit' in kinds or time.time() > deadline:
      break
    time.sleep(0.1)
  assert 'exit' in kinds, kinds
  rows = {}
  for record in records:
    if record.WhichOneof('record_type') == 'history':
      row = rows.setdefault(record.history.step.num, {})
      for item in record.history.item:
        key = '/'.join(item.nested_key) or item.key
        if not key.startswith('_'):
          row[key] = json.loads(item.value_json)
  return rows


def jsonl_rows(path):
  """``{step: row}`` of ``metrics.jsonl``, rows of one step merged (W&B
  keeps one row per step)."""
  rows = {}
  with open(path) as f:
    for line in f:
      row = json.loads(line)
      rows.setdefault(row.pop('step'), {}).update(row)
  return rows


def _same(a, b):
  assert a.keys() == b.keys()
  for step in a:
    assert a[step].keys() == b[step].keys(), step
    for key in a[step]:
      x, y = float(a[step][key]), float(b[step][key])
      assert (math.isnan(x) and math.isnan(y)) or x == y, (step, key, x, y)


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
  """W&B offline, writing under the test's own folder. W&B keeps its
  settings (WANDB_DIR too) for the life of the process: torn down before
  and after, so the next test's settings are read afresh."""
  wandb = pytest.importorskip('wandb')
  folder = tmp_path / 'wandb_dir'
  folder.mkdir()
  monkeypatch.setenv('WANDB_MODE', 'offline')
  monkeypatch.setenv('WANDB_DIR', str(folder))
  monkeypatch.setenv('WANDB_SILENT', 'true')
  monkeypatch.setenv('WANDB_CONSOLE', 'off')
  wandb.teardown()
  yield folder
  wandb.teardown()


def test_wandb_rows_equal_metrics_jsonl(tmp_path, wandb_offline):
  workdir = tmp_path / 'run'
  workdir.mkdir()
  config = _config(**{'wandb.project': 'prolip-test'})
  writer = wandb_sink.tee(progress.MetricWriter(str(workdir), True), config,
                          str(workdir), True)
  assert isinstance(writer, wandb_sink.Tee)
  writer.write(1, {'loss': 2.5, 'time/step_s': 0.125})
  writer.write(2, {'loss': float('nan'), 'perf/mfu': 0.4})
  writer.write(2, {'eval/top1': 0.75})  # an eval row at the same step
  writer.write(3, {'loss': 1.5, 'lr': np.float32(1e-4)})
  writer.close()
  _same(jsonl_rows(workdir / 'metrics.jsonl'), wandb_rows(wandb_offline))


def test_wandb_is_off_by_default_and_only_on_the_chief(tmp_path,
                                                       wandb_offline):
  writer = object()
  assert wandb_sink.tee(writer, _config(), str(tmp_path), True) is writer
  config = _config(**{'wandb.project': 'p'})
  assert wandb_sink.tee(writer, config, str(tmp_path), False) is writer
  with pytest.raises(errors.ConfigError, match='wandb.mode'):
    wandb_sink.open_sink(_config(**{'wandb.project': 'p',
                                    'wandb.mode': 'sometimes'}),
                         str(tmp_path), True)


def test_missing_wandb_is_one_user_error(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, 'wandb', None)  # import wandb fails
  config = _config(**{'wandb.project': 'p'})
  for is_chief in (True, False):  # every host stops alike
    with pytest.raises(errors.UserError, match='pip install wandb'):
      wandb_sink.open_sink(config, str(tmp_path), is_chief)
  assert wandb_sink.open_sink(_config(), str(tmp_path), True) is None
  with pytest.raises(errors.UserError, match='pip install wandb'):
    train.validate_config(config)  # before the run builds anything


@pytest.mark.slow
def test_training_reports_the_split_profile_and_wandb(tmp_path, capsys,
                                                      wandb_offline):
  """A micro run: every logged row after the compiling step has the split
  and model FLOP/s, the progress line shows them, steps 3-4 are traced
  into the TensorBoard folder, and the W&B rows equal metrics.jsonl's."""
  config = _config(total_steps=6, log_every_steps=2, profile_steps='3:4',
                   **{'wandb.project': 'prolip-test', 'mesh.num_devices': 1})
  workdir = tmp_path / 'run'
  train.train_and_evaluate(config, str(workdir))
  out = capsys.readouterr().out
  assert 'No MFU: no peak FLOP/s known' in out
  assert 'model TFLOP/s/device (no peak known: no MFU)' in out
  assert 'Wrote the profile of steps 3-4' in out
  assert len(_profile_files(workdir / 'tensorboard')) == 1
  rows = jsonl_rows(workdir / 'metrics.jsonl')
  for step in (2, 4, 6):
    row = rows[step]
    assert row['time/step_s'] == pytest.approx(
        row['time/data_wait_s'] + row['time/device_s'])
    assert row['time/step_alone_s'] > 0
    assert 'perf/mfu' not in row and row['perf/model_tflops_per_device'] > 0
  _same(rows, wandb_rows(wandb_offline))


def _tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
  """``{tag: [(step, value), ...]}`` read back from the TFRecord event files
  in ``folder`` (length, its CRC, the Event proto, its CRC)."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  scalars = {}
  for path in sorted(glob.glob(os.path.join(str(folder), 'events.out.*'))):
    data = open(path, 'rb').read()
    at = 0
    while at < len(data):
      (length,) = struct.unpack('<Q', data[at:at + 8])
      event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
      at += 12 + length + 4
      for value in event.summary.value:
        scalars.setdefault(value.tag, []).append(
            (event.step, value.simple_value))
  return scalars


def test_tensorboard_scalars_are_written_without_importing_torch(
    tmp_path, monkeypatch):
  """The metrics reach TensorBoard's event files, and importing tensorboardX
  for them leaves PyTorch unimported (2 s of every start otherwise), and
  its S3 and GCS clients too (the loop uploads the events itself); a later
  import of those modules still works."""
  unused = ('torch', 'boto3', 'google.cloud.storage', 'tensorboardX')
  for name in [m for m in sys.modules
               if m in unused or m.startswith(tuple(u + '.' for u in unused))]:
    monkeypatch.delitem(sys.modules, name)
  cloud = sys.modules.get('google.cloud')
  if cloud is not None and hasattr(cloud, 'storage'):  # `from` finds it there
    monkeypatch.delattr(cloud, 'storage')
  writer = progress.MetricWriter(tmp_path, enabled=True)
  writer.write(3, {'loss': 1.5, 'lr': 0.25})
  writer.write(4, {'loss': 0.75})
  writer.close()
  assert not {'torch', 'boto3', 'google.cloud.storage'} & set(sys.modules)
  record_writer = sys.modules['tensorboardX.record_writer']
  assert not record_writer.S3_ENABLED and not record_writer.GCS_ENABLED
  import boto3  # pylint: disable=g-import-not-at-top
  from google.cloud import storage  # pylint: disable=g-import-not-at-top
  assert boto3.client and storage.Client
  assert sys.modules['tensorboardX.writer'].numpy_compatible is np.ndarray
  assert _tensorboard_scalars(tmp_path / 'tensorboard') == {
      'loss': [(3, 1.5), (4, 0.75)], 'lr': [(3, 0.25)]}
  rows = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
  assert rows == [{'step': 3, 'loss': 1.5, 'lr': 0.25},
                  {'step': 4, 'loss': 0.75}]
