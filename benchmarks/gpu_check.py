"""The GPU check: what to run first on an NVIDIA machine (docs/gpu.md).

  benchmarks/gpu_check.sh --out /tmp/gpu_check         # on the GPU machine
  python benchmarks/gpu_check.py --skip_device --out /tmp/check  # any CPU

Runs, each section in its own process under one overall time budget (a
section that fails or runs out of time is reported and the others still
run; sections that no longer fit are skipped, in this order of priority):

``env``
  Python, the JAX stack's versions, the device and its memory.
``attention``
  cuDNN's fused attention against XLA's at the B/16 shapes (the 198 image
  tokens; the 66 text tokens with right padding passed as key lengths):
  outputs and the gradients of q, k, v, in bfloat16 and float32, each
  against a float32 reference computed by XLA at 'highest' matmul precision
  on upcast inputs (relative error ``|x - ref| / |ref|``). cuDNN takes only
  16-bit inputs, so the float32 rows are XLA's (with the GPU's default matmul
  precision, TF32 on Hopper). Also counts the cuDNN kernels in the compiled
  function, so a silent fall-back to XLA shows.
``step:<variant>``
  The B/16 train step (``configs/prolip_b16.py``) at 512 pairs per GPU on
  device-resident random batches, per variant of layer scan and remat
  policy: compile time, step time, pairs/s, the measured MFU (analytic
  FLOPs over the chip's dense bf16 peak), XLA's own estimate of the step
  (the cost-model MFU and the memory that ``prolip_jax.aot`` reports) and
  the real peak memory of the device (``Device.memory_stats``).
  ``step:accum2`` is the same step in two micro-batches (``accum_steps``).
  ``step:no_remat`` also traces ``--profile_steps`` steps and adds up their
  device time by kernel (``benchmarks/kernel_profile.py``).
``demo``
  The default demo (``python -m prolip_jax.main``) trained on the GPU: its
  wall time, last loss and held-out figures.

Writes ``OUT/gpu_check.json`` (every figure), ``OUT/gpu_check.md`` (the
tables, printed last) and one log per section. ``--skip_device`` runs every
section on the CPU at toy sizes (the tiny model, 16 pairs, a 5-step demo)
so that CI keeps this script working; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_REPO, 'benchmarks'))
import kernel_profile  # pylint: disable=g-import-not-at-top,wrong-import-position

# name -> (config overrides, a rough upper bound of the section's seconds on
# an H100, used to skip what no longer fits the budget). Cheapest memory
# first: the device's peak is read per process, so the order does not
# matter for the figures, only for what is skipped when time runs out.
STEP_VARIANTS = {
    'no_remat': ({'model.remat': False, 'model.scan': False}, 110),
    'remat_dots': ({'model.remat': True, 'model.scan': False,
                    'model.remat_policy': 'dots_with_no_batch_dims_saveable'},
                   120),
    # Also keeps the attention matmuls (they have batch dimensions).
    'remat_dots_all': ({'model.remat': True, 'model.scan': False,
                        'model.remat_policy': 'dots_saveable'}, 120),
    'remat_all': ({'model.remat': True, 'model.scan': False,
                   'model.remat_policy': 'nothing_saveable'}, 120),
    'scan_no_remat': ({'model.remat': False, 'model.scan': True}, 90),
    # The same 512 pairs in two micro-batches (training/accumulation.py):
    # the price of accumulation is about one more forward pass.
    'accum2': ({'model.remat': False, 'model.scan': False, 'accum_steps': 2},
               130),
}
SECTIONS = (['env', 'attention', 'step:no_remat', 'demo', 'step:remat_dots',
             'step:remat_dots_all', 'step:remat_all', 'step:scan_no_remat',
             'step:accum2'])
# The variant whose steps are also traced (--profile_steps), for the table
# of where the device time goes (kernel_profile.py).
PROFILED_VARIANT = 'no_remat'
SECTION_SECONDS = {'env': 40, 'attention': 90, 'demo': 150}
PAIRS_PER_DEVICE = 512


def _now():
  return time.strftime('%H:%M:%S')


# ----------------------------------------------------------------- sections


def section_env(skip_device: bool) -> dict:
  """Versions and the device."""
  del skip_device
  import importlib.metadata as md  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  versions = {}
  for name in ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint',
               'grain', 'tensorstore', 'numpy', 'jax-cuda13-plugin',
               'jax-cuda12-plugin', 'nvidia-cudnn-cu13', 'nvidia-cudnn-cu12'):
    try:
      versions[name] = md.version(name)
    except md.PackageNotFoundError:
      pass
  dev = jax.devices()[0]
  stats = dev.memory_stats() or {}
  out = {'python': sys.version.split()[0], 'versions': versions,
         'backend': jax.default_backend(), 'device_count': jax.device_count(),
         'device_kind': dev.device_kind,
         'bytes_limit': stats.get('bytes_limit')}
  try:
    out['platform_version'] = str(dev.client.platform_version)
  except Exception:  # pylint: disable=broad-except
    pass
  try:
    smi = subprocess.run(['nvidia-smi', '--query-gpu=name,driver_version,'
                          'memory.total,clocks.max.sm', '--format=csv,noheader'],
                         capture_output=True, text=True, timeout=20)
    out['nvidia_smi'] = smi.stdout.strip()
  except (OSError, subprocess.TimeoutExpired):
    out['nvidia_smi'] = None
  return out


def _relative_error(x, ref) -> float:
  import numpy as np  # pylint: disable=g-import-not-at-top
  x = np.asarray(x, np.float64)
  ref = np.asarray(ref, np.float64)
  if not np.all(np.isfinite(x)):
    return float('inf')
  return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def section_attention(skip_device: bool) -> dict:
  """cuDNN against XLA attention: outputs and gradients (see the module
  docstring)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from prolip_jax.models import attention  # pylint: disable=g-import-not-at-top

  impl = attention.attention_impl_for(jax.devices(), 'auto')
  batch = 4 if skip_device else 64
  # (name, tokens, heads, head_dim, padded): the B/16 towers' calls.
  cases = [('image', 198, 12, 64, False), ('text', 66, 8, 64, True)]
  rows = []
  for case, (name, tokens, heads, head_dim, padded) in enumerate(cases):
    keys = jax.random.split(jax.random.key(100 + case), 5)
    shape = (batch, tokens, heads, head_dim)
    q, k, v, g = (jax.random.normal(kk, shape, jnp.float32) for kk in keys[:4])
    lengths = (jax.random.randint(keys[4], (batch,), tokens // 4, tokens + 1)
               if padded else None)

    def loss_and_grads(implementation, dtype, precision=None):
      def f(q, k, v):
        out = attention.dot_product_attention(
            q.astype(dtype), k.astype(dtype), v.astype(dtype), lengths,
            implementation=implementation)
        return out.astype(jnp.float32)

      def run(q, k, v, g):
        with jax.default_matmul_precision(precision or 'default'):
          out, vjp = jax.vjp(f, q, k, v)
          return (out,) + vjp(g)
      fn = jax.jit(run)
      text = fn.lower(q, k, v, g).compile().as_text()
      return fn(q, k, v, g), text.count('__cudnn$fmha')

    reference, _ = loss_and_grads('xla', jnp.float32, 'highest')
    reference = [np.asarray(x) for x in reference]
    for dtype in (jnp.bfloat16, jnp.float32):
      for implementation in ('cudnn', 'xla'):
        row = {'case': name, 'tokens': tokens, 'heads': heads,
               'head_dim': head_dim, 'batch': batch, 'padded': padded,
               'dtype': jnp.dtype(dtype).name, 'implementation': implementation}
        if implementation == 'cudnn' and impl != 'cudnn':
          row['skipped'] = 'no NVIDIA GPU'
          rows.append(row)
          continue
        refusal = attention.cudnn_refusal(tokens, tokens, head_dim, dtype)
        if implementation == 'cudnn' and refusal:
          row['skipped'] = f'cuDNN refuses: {refusal} (runs on XLA)'
          rows.append(row)
          continue
        outs, kernels = loss_and_grads(implementation, dtype)
        errors = [_relative_error(x, r) for x, r in zip(outs, reference)]
        row.update(zip(('out', 'dq', 'dk', 'dv'), errors))
        row['cudnn_kernels'] = kernels
        # METHOD-style bounds: bf16 operands land between 1e-3 and 1e-2;
        # float32 with TF32 matmuls near 3e-4; NaN never passes. cuDNN must
        # also really run (its kernels in the compiled function).
        bound = 2e-2 if dtype == jnp.bfloat16 else 2e-3
        row['ok'] = bool(max(errors) < bound and (
            implementation == 'xla' or kernels > 0))
        rows.append(row)
  return {'implementation_auto': impl, 'rows': rows,
          'ok': all(r.get('ok', True) for r in rows)}


def _b16_config(overrides: dict, skip_device: bool):
  import importlib.util  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  name = 'prolip_tiny.py' if skip_device else 'prolip_b16.py'
  spec = importlib.util.spec_from_file_location(
      'gpu_check_config', os.path.join(_REPO, 'configs', name))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  pairs = 16 if skip_device else PAIRS_PER_DEVICE
  config.batch_size = pairs * jax.device_count()
  config.update_from_flattened_dict(overrides)
  return config


def section_step(skip_device: bool, variant: str, out_dir: str,
                 profile_steps: int = 0) -> dict:
  """The B/16 train step of one variant (see the module docstring); the
  ``PROFILED_VARIANT`` also traces ``profile_steps`` steps into
  ``OUT/trace`` and adds where their device time went (``kernels``)."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  import train_step  # pylint: disable=g-import-not-at-top
  flags.FLAGS(['gpu_check'])  # train_step's flags at their defaults
  overrides, _ = STEP_VARIANTS[variant]
  config = _b16_config(overrides, skip_device)
  profile = variant == PROFILED_VARIANT and profile_steps > 0
  result = train_step.measure(
      config, verbose=False, steps=2 if skip_device else 10,
      warmup=1 if skip_device else 2,
      profile_dir=os.path.join(out_dir, 'trace') if profile else None,
      profile_steps=profile_steps)
  result['variant'] = variant
  result['overrides'] = overrides
  return result


def section_demo(skip_device: bool, out_dir: str) -> dict:
  """The default demo on the device: ``python -m prolip_jax.main``."""
  workdir = os.path.join(out_dir, 'demo_workdir')
  cmd = [sys.executable, '-m', 'prolip_jax.main', '--workdir', workdir]
  if skip_device:
    cmd += ['--config.total_steps=5']
  t0 = time.time()
  proc = subprocess.run(cmd, cwd=_REPO, capture_output=True, text=True,
                        check=False)
  wall = time.time() - t0
  rows = []
  path = os.path.join(workdir, 'metrics.jsonl')
  if os.path.exists(path):
    with open(path) as f:
      rows = [json.loads(line) for line in f if line.strip()]
  train = [r for r in rows if 'loss' in r]
  held_out = [r for r in rows if 'eval/zeroshot_csd_top1' in r]
  tail = (proc.stdout + proc.stderr).strip().splitlines()[-12:]
  return {'exit': proc.returncode, 'wall_s': wall,
          'steps': train[-1].get('step') if train else None,
          'last_loss': train[-1].get('loss') if train else None,
          'heldout_top1_csd': (100 * held_out[-1]['eval/zeroshot_csd_top1']
                               if held_out else None),
          'samples_per_s': train[-1].get('samples_per_sec') if train else None,
          'tail': tail, 'ok': proc.returncode == 0}


def run_section(name: str, skip_device: bool, out_dir: str,
                profile_steps: int = 0) -> dict:
  if name == 'env':
    return section_env(skip_device)
  if name == 'attention':
    return section_attention(skip_device)
  if name == 'demo':
    return section_demo(skip_device, out_dir)
  if name.startswith('step:'):
    return section_step(skip_device, name.split(':', 1)[1], out_dir,
                        profile_steps)
  raise ValueError(f'unknown section {name!r}')


# ------------------------------------------------------------------- driver


def _section_seconds(name: str) -> int:
  if name.startswith('step:'):
    return STEP_VARIANTS[name.split(':', 1)[1]][1]
  return SECTION_SECONDS[name]


def _gib(x) -> str:
  return '—' if x is None else f'{x / 2**30:.1f}'


def _num(x, fmt='.3g') -> str:
  if x is None:
    return '—'
  return format(x, fmt)


def format_tables(results: dict) -> str:
  """The check's Markdown tables from ``results`` (section -> result)."""
  lines = []
  env = results.get('env', {})
  if env.get('ok'):
    v = env['versions']
    lines += [f"**{env.get('device_count')} × {env.get('device_kind')}** "
              f"({env.get('backend')}; {env.get('nvidia_smi') or 'no nvidia-smi'}), "
              f"Python {env.get('python')}, jax {v.get('jax')}, flax "
              f"{v.get('flax')}, optax {v.get('optax')}, orbax "
              f"{v.get('orbax-checkpoint')}, device memory limit "
              f"{_gib(env.get('bytes_limit'))} GiB", '']
  att = results.get('attention', {})
  if att.get('rows'):
    lines += ['| attention | dtype | kernel | out | dq | dk | dv | cuDNN '
              'kernels | ok |', '|---|---|---|---|---|---|---|---|---|']
    for r in att['rows']:
      label = f"{r['case']} ({r['tokens']} tokens{', padded' if r['padded'] else ''})"
      if 'skipped' in r:
        lines.append(f"| {label} | {r['dtype']} | {r['implementation']} | "
                     f"{r['skipped']} | | | | | |")
        continue
      lines.append(f"| {label} | {r['dtype']} | {r['implementation']} | "
                   + ' | '.join(f'{r[k]:.1e}' for k in ('out', 'dq', 'dk', 'dv'))
                   + f" | {r['cudnn_kernels']} | {'yes' if r['ok'] else 'NO'} |")
    lines += ['', 'Relative errors against XLA in float32 at highest matmul '
              'precision on the same inputs.', '']
  steps = [(n, results[n]) for n in SECTIONS
           if n.startswith('step:') and n in results]
  if steps:
    lines += ['| B/16 step | remat policy | scan | pairs | compile (s) | step '
              '(ms) | pairs/s | MFU | XLA est. MFU | XLA memory (GiB) | real '
              'peak (GiB) | cuDNN calls |',
              '|---|---|---|---|---|---|---|---|---|---|---|---|']
    for name, r in steps:
      if not r.get('ok'):
        lines.append(f"| {name[5:]} | {r.get('error', 'failed')[:120]} "
                     '| | | | | | | | | | |')
        continue
      policy = r['remat_policy'] if r['remat'] else 'no remat'
      mfu = r['mfu']
      lines.append(
          f"| {name[5:]} | {policy} | {r['scan']} | {r['batch']} | "
          f"{r['compile_s']:.0f} | {r['step_ms']:.1f} | "
          f"{r['samples_per_s']:.0f} | "
          + (f'{mfu:.1f}%' if mfu == mfu else 'n/a') + ' | '
          + (f"{r['xla_estimated_mfu']:.1f}%" if r.get('xla_estimated_mfu')
             else '—')
          + f" | {_gib(r['xla_memory_bytes'])} | {_gib(r['peak_bytes'])} | "
          f"{r['cudnn_attention_calls']} |")
    lines.append('')
    kernels = [(n, r['kernels']) for n, r in steps if r.get('kernels')]
    for name, summary in kernels:
      lines += [f'{name}, traced:', '',
                kernel_profile.format_summary(summary), '']
  demo = results.get('demo')
  if demo:
    if demo.get('ok'):
      lines.append(f"Default demo: {demo['steps']} steps in "
                   f"{demo['wall_s']:.0f} s wall (tokenizer, compiles and "
                   f"evaluations included), last loss "
                   f"{_num(demo['last_loss'], '.4f')}, held-out zero-shot "
                   f"top-1 (CSD) {_num(demo['heldout_top1_csd'], '.1f')}%")
    else:
      lines.append(f"Default demo: failed ({demo.get('error') or demo.get('exit')})")
  failed = [n for n, r in results.items() if not r.get('ok')]
  skipped = [n for n in SECTIONS if n not in results]
  lines.append('')
  lines.append('Sections failed: ' + (', '.join(failed) or 'none')
               + '; skipped for time: ' + (', '.join(skipped) or 'none'))
  return '\n'.join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split('\n\n', 1)[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--out', required=True, help='folder for the results')
  parser.add_argument('--budget_s', type=float, default=460,
                      help='overall seconds; sections that no longer fit are '
                      'skipped (default 460: the check fits 8 minutes)')
  parser.add_argument('--skip_device', action='store_true',
                      help='run every section on the CPU at toy sizes (CI)')
  parser.add_argument('--sections', default=','.join(SECTIONS),
                      help='comma-separated subset, in priority order')
  parser.add_argument('--profile_steps', type=int, default=3,
                      help=f'steps of step:{PROFILED_VARIANT} to trace for '
                      'the table of device time by kernel (0: none)')
  parser.add_argument('--section', help=argparse.SUPPRESS)  # child process
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)

  if args.section:  # one section, in this process
    if args.skip_device:
      os.environ['JAX_PLATFORMS'] = 'cpu'
    try:
      result = run_section(args.section, args.skip_device, args.out,
                           args.profile_steps)
      result.setdefault('ok', True)
    except Exception as e:  # pylint: disable=broad-except
      import traceback  # pylint: disable=g-import-not-at-top
      traceback.print_exc()
      result = {'ok': False, 'error': f'{type(e).__name__}: {e}'[:2000]}
    path = os.path.join(args.out, args.section.replace(':', '_') + '.json')
    with open(path, 'w') as f:
      json.dump(result, f, indent=1, default=str)
    return 0

  sections = [s for s in args.sections.split(',') if s]
  unknown = [s for s in sections if s not in SECTIONS]
  if unknown:
    print(f'error: unknown sections {unknown}; choose from {SECTIONS}',
          file=sys.stderr)
    return 2
  env = dict(os.environ)
  env['PYTHONPATH'] = _REPO + os.pathsep + env.get('PYTHONPATH', '')
  env.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', '.95')
  if args.skip_device:
    env['JAX_PLATFORMS'] = 'cpu'
  deadline = time.time() + args.budget_s
  results = {}
  for name in sections:
    left = deadline - time.time()
    need = 60 if args.skip_device else _section_seconds(name)
    if left < need:
      print(f'[{_now()}] {name}: skipped, {left:.0f} s left of the budget '
            f'(needs up to {need} s)', flush=True)
      continue
    print(f'[{_now()}] {name} ...', flush=True)
    log_path = os.path.join(args.out, name.replace(':', '_') + '.log')
    json_path = os.path.join(args.out, name.replace(':', '_') + '.json')
    t0 = time.time()
    with open(log_path, 'w') as log:
      try:
        subprocess.run([sys.executable, os.path.abspath(__file__), '--out',
                        args.out, '--section', name, '--profile_steps',
                        str(args.profile_steps)]
                       + (['--skip_device'] if args.skip_device else []),
                       stdout=log, stderr=subprocess.STDOUT, env=env,
                       timeout=left, check=False, cwd=_REPO)
      except subprocess.TimeoutExpired:
        pass
    if os.path.exists(json_path):
      with open(json_path) as f:
        results[name] = json.load(f)
    else:
      results[name] = {'ok': False, 'error': f'no result after '
                       f'{time.time() - t0:.0f} s (timed out or crashed; see '
                       f'{os.path.basename(log_path)})'}
    r = results[name]
    print(f"[{_now()}] {name}: {'ok' if r.get('ok') else 'FAILED'} in "
          f'{time.time() - t0:.0f} s'
          + ('' if r.get('ok') else f" — {r.get('error', '')[:300]}"),
          flush=True)
  with open(os.path.join(args.out, 'gpu_check.json'), 'w') as f:
    json.dump({'skip_device': args.skip_device, 'results': results}, f,
              indent=1, default=str)
  tables = format_tables(results)
  with open(os.path.join(args.out, 'gpu_check.md'), 'w') as f:
    f.write(tables + '\n')
  print()
  print(tables)
  return 0 if all(r.get('ok') for r in results.values()) else 1


if __name__ == '__main__':
  sys.exit(main())
