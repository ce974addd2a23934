"""The targets ``python -m prolip_jax.aot`` compiles for, without the
hardware: TPU topologies (chip grids and Cloud's slice names, through
libtpu's topology API) and H100 SXM GPUs (the packaged target spec,
through the CUDA toolchain). ``resolve('v5p:4x4x2')`` -> a ``Target`` with
its devices; a name it does not know is a ``TopologyError``, a missing
toolchain a ``ToolchainError`` (both one line).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import re

from prolip_jax import errors
from prolip_jax.training import mfu

_SPEC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                         'specs')
# Cloud's slice names -> chip grids (v4/v5p count TensorCores: 2 per chip).
_CLOUD_3D = {8: '2x2x1', 16: '2x2x2', 32: '2x2x4', 64: '2x4x4', 128: '4x4x4',
             256: '4x4x8', 512: '4x8x8', 1024: '8x8x8', 2048: '8x8x16',
             4096: '8x16x16'}
_CLOUD_2D = {1: '1x1', 4: '2x2', 8: '2x4', 16: '4x4', 32: '4x8', 64: '8x8',
             128: '8x16', 256: '16x16'}
KNOWN = ('v4:AxBxC, v5p:AxBxC, v5e:AxB, v6e:AxB (chip grids); '
         f'v4-N, v5p-N (N in {sorted(_CLOUD_3D)}), v5e-N, v6e-N (N in '
         f'{sorted(_CLOUD_2D)}); h100:N (N GPUs)')


class TopologyError(errors.UserError):
  """An unknown topology name, or one the compiler refuses."""


class ToolchainError(errors.UserError):
  """libtpu or the CUDA toolchain is not installed."""


@dataclasses.dataclass
class Target:
  """Where to compile: the canonical name, platform and devices."""
  name: str
  platform: str  # 'tpu' | 'cuda'
  chip: mfu.Chip
  devices: list


def parse_topology(name: str) -> tuple[str, str, str]:
  """``(generation, platform, grid)`` of a ``--topology`` name; raises
  ``TopologyError`` (with the known forms) for anything else."""
  name = name.strip().lower()
  m = re.fullmatch(r'(v4|v5p|v5e|v6e):(\d+(?:x\d+)*)', name)
  if m:
    gen, grid = m.groups()
    dims = 3 if gen in ('v4', 'v5p') else 2
    if grid.count('x') + 1 != dims:
      raise TopologyError(f'topology {name!r}: {gen} takes a {dims}-D chip '
                          f'grid; known: {KNOWN}')
    return gen, 'tpu', grid
  m = re.fullmatch(r'(v4|v5p|v5e|v6e)-(\d+)', name)
  if m:
    gen, n = m.group(1), int(m.group(2))
    table = _CLOUD_3D if gen in ('v4', 'v5p') else _CLOUD_2D
    if n not in table:
      raise TopologyError(f'topology {name!r}: no {gen} slice of that size; '
                          f'known: {KNOWN}')
    return gen, 'tpu', table[n]
  m = re.fullmatch(r'h100(?::(\d+))?', name)
  if m:
    n = int(m.group(1) or 1)
    if n < 1 or (n > 8 and n % 8):
      raise TopologyError(f'topology {name!r}: h100:N takes N <= 8 or a '
                          f'multiple of 8 (8 GPUs per host); known: {KNOWN}')
    hosts, per_host = (1, n) if n <= 8 else (n // 8, 8)
    return 'h100', 'cuda', f'1x{hosts}x{per_host}'
  raise TopologyError(f'unknown topology {name!r}; known: {KNOWN}')


def h100_spec() -> str:
  """The H100 SXM target description shipped with the package (comment
  lines stripped: XLA's text-proto parser does not take them)."""
  with open(os.path.join(_SPEC_DIR, 'h100_sxm.txtpb')) as f:
    return ''.join(l for l in f if not l.lstrip().startswith('#'))



@contextlib.contextmanager
def _quiet_tpu_environment(gen: str, grid: str):
  """libtpu on a machine without TPUs: no lockfile between compiling
  processes, no metadata-server or worker-hostname probing (their warnings
  are noise here). The worker variables are put back on exit: a process
  started later from this one (``prolip_jax.main``) would take them for a
  TPU pod's."""
  chips = 1
  for d in grid.split('x'):
    chips *= int(d)
  cloud = {'v4': f'v4-{2 * chips}', 'v5p': f'v5p-{2 * chips}',
           'v5e': f'v5litepod-{chips}', 'v6e': f'v6e-{chips}'}[gen]
  before = set(os.environ)
  for key, value in (('TPU_ACCELERATOR_TYPE', cloud),
                     ('TPU_SKIP_MDS_QUERY', '1'),
                     ('TPU_WORKER_ID', '0'),
                     ('TPU_WORKER_HOSTNAMES', 'localhost')):
    os.environ.setdefault(key, value)
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')  # kept: harmless
  added = [k for k in ('TPU_ACCELERATOR_TYPE', 'TPU_SKIP_MDS_QUERY',
                       'TPU_WORKER_ID', 'TPU_WORKER_HOSTNAMES')
           if k not in before]
  try:
    yield
  finally:
    for key in added:
      os.environ.pop(key, None)


def _gpu_environment():
  """Deviceless CUDA compilation: no driver-version check, no Triton GEMM
  autotuning (it needs a device)."""
  os.environ.setdefault('JAX_SKIP_CUDA_CONSTRAINTS_CHECK', '1')
  flag = '--xla_gpu_enable_triton_gemm=false'
  if flag not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' '
                               + flag).strip()


def resolve(name: str) -> Target:
  """Device descriptions of a topology (no device needed)."""
  gen, platform, grid = parse_topology(name)
  if platform == 'tpu':
    if importlib.util.find_spec('libtpu') is None:
      raise ToolchainError("libtpu is not installed (TPU topologies need it):"
                           " pip install -e '.[tpu]'")
  else:
    _gpu_environment()
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    if platform == 'tpu':
      with _quiet_tpu_environment(gen, grid):
        topo = topologies.get_topology_desc(
            topology_name=f'{gen}:{grid}', platform='tpu',
            chip_config_name='megacore' if gen in ('v4', 'v5p')
            else 'default')
    else:
      topo = topologies.get_topology_desc(
          platform='cuda', target_config=h100_spec(), topology=grid)
  except Exception as e:  # pylint: disable=broad-except
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if platform == 'cuda':
      raise ToolchainError(
          "the GPU toolchain is missing or does not load (pip install -e "
          f"'.[gpu]'; no GPU is needed): {text}") from e
    raise TopologyError(f'topology {name!r} refused by libtpu: {text}; '
                        f'known: {KNOWN}') from e
  devices = list(topo.devices)
  if platform == 'tpu':
    kind = mfu.DEVICE_KINDS.get(devices[0].device_kind, gen)
    if kind != gen:
      raise TopologyError(f'topology {name!r} gave {devices[0].device_kind} '
                          'devices')
  label = f'{gen}:{grid}' if platform == 'tpu' else f'h100:{len(devices)}'
  return Target(label, platform, mfu.CHIPS[gen], devices)
