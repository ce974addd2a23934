"""What several test modules share and no test module should import from
another: the environment of a training process on N host CPU devices, the
outputs of processes run together, and a small array_record shard of solid
red images (a second data source that no digit resembles)."""

import io
import os
import subprocess

from prolip_jax.data import record_format

RED = (250, 0, 0)


def cpu_env(devices: int) -> dict[str, str]:
  """``os.environ`` for a process of ``prolip_jax.main`` on ``devices``
  host CPU devices. A hung process's log holds everything it printed, and
  SIGABRT makes it print where every thread is."""
  env = dict(os.environ)
  env['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={devices}'
  env['JAX_PLATFORMS'] = 'cpu'
  env['PYTHONUNBUFFERED'] = '1'
  env['PYTHONFAULTHANDLER'] = '1'
  return env


def red_shard(directory, n: int = 40) -> str:
  """One array_record shard of ``n`` solid red JPEGs (digits are grey) in
  ``directory``; returns its glob."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  os.makedirs(directory, exist_ok=True)
  writer = record_format.ShardWriter(os.path.join(directory,
                                                  'red.array_record'))
  for i in range(n):
    buf = io.BytesIO()
    Image.new('RGB', (40, 40), RED).save(buf, 'JPEG')
    writer.write(record_format.serialize_example(
        buf.getvalue(), f'a red square number {i}', f'red{i}'))
  writer.close()
  return os.path.join(directory, '*.array_record')


def outputs_of(procs: list[subprocess.Popen], timeout: float) -> list[str]:
  """The output of each process (started with ``stdout=PIPE``, text),
  once every one has exited 0; all are killed if one outlives
  ``timeout``."""
  outputs = []
  for p in procs:
    try:
      out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    outputs.append(out)
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  return outputs
