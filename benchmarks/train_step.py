"""Training throughput and MFU of the real train step on synthetic batches.

  python benchmarks/train_step.py --config configs/prolip_b16.py \
      --config.batch_size=256 --steps 20
  python benchmarks/train_step.py --config configs/prolip_b16.py \
      --sweep_batch=128,256,512,1024 --sweep_remat=true,false   # GPU sweep
  python benchmarks/train_step.py --config configs/prolip_b16.py \
      --config.batch_size=512 --profile_dir /tmp/trace   # where the time goes

Builds the same jitted, sharded ``train_step`` as ``prolip_jax.main`` (all
devices, the config's mesh), feeds it device-resident random batches (so the
input pipeline is not measured: see ``benchmarks/input_pipeline.py``), and
prints samples/s, the model FLOPs per step (XLA's cost analysis of the
compiled step, and the analytic count of ``docs/performance.md``) and the
MFU against the device's dense bf16 peak (``--peak_tflops`` overrides).
"""

import os
import sys
import time

from absl import app
from absl import flags
import jax
from ml_collections import config_flags
import numpy as np

import kernel_profile  # benchmarks/, beside this file
from prolip_jax import objectives
from prolip_jax import sharding as shd
from prolip_jax.aot import compiler as aot
from prolip_jax.models import attention_impl_for
from prolip_jax.models import ModelConfig
from prolip_jax.models import ProLIP
from prolip_jax.training import mfu as mfu_lib
from prolip_jax.training import optimizer
from prolip_jax.training import train

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
config_flags.DEFINE_config_file(
    'config', os.path.join(_REPO, 'configs', 'prolip_b16.py'), 'Run config.')
flags.DEFINE_integer('steps', 10, 'Timed steps.')
flags.DEFINE_integer('warmup', 2, 'Untimed steps after compilation.')
flags.DEFINE_float('peak_tflops', 0.0, 'Per-device dense peak; 0: by kind.')
flags.DEFINE_list('sweep_batch', [], 'Global batch sizes to sweep (with '
                  '--sweep_remat); empty: the config\'s batch only.')
flags.DEFINE_list('sweep_remat', [], 'model.remat values to sweep '
                  '(true,false); empty: the config\'s.')
flags.DEFINE_string('profile_dir', None, 'Also trace 3 steps there and print '
                    'where their device time went (kernel_profile.py).')

def device_peak_tflops(device) -> float:
  """Dense bf16 peak TFLOP/s of ``device`` from the one table of chips
  (``mfu_lib.CHIPS``); 0 for a kind without a known peak."""
  chip = mfu_lib.chip_of_device_kind(getattr(device, 'device_kind', ''))
  return chip.peak_bf16_flops / 1e12 if chip else 0.0


def _random_batch(mesh, model_cfg, b: int) -> dict:
  """A device-resident batch of ``b`` random pairs: images, right-padded
  captions of random lengths, no augmentation record."""
  size, ctx = model_cfg.vision.image_size, model_cfg.text.context_length
  rng = np.random.default_rng(0)
  lengths = rng.integers(ctx // 4, ctx, b)
  tokens = rng.integers(4, model_cfg.text.vocab_size, (b, ctx))
  tokens[np.arange(ctx)[None] >= lengths[:, None]] = model_cfg.text.pad_id
  return shd.host_to_global(mesh, {
      'image': rng.integers(0, 256, (b, size, size, 3), dtype=np.uint8),
      'tokens': tokens.astype(np.int32),
      'aug': np.zeros((b, 11), np.float32)})


def _traced_kernels(compiled, state, batch, step_rng, profile_dir: str,
                    steps: int) -> dict:
  """``kernel_profile.summarize`` of ``steps`` more steps traced into
  ``profile_dir``."""
  try:
    with jax.profiler.trace(profile_dir):
      for _ in range(steps):
        state, metrics = compiled(state, batch, step_rng)
      jax.block_until_ready(metrics)
    return kernel_profile.summarize(profile_dir, steps)
  except Exception as e:  # pylint: disable=broad-except
    # A profiler that cannot start (no CUPTI) loses the table, not the
    # timing measured before it.
    return {'note': f'no trace: {type(e).__name__}: {e}'[:500]}


def measure(config, verbose: bool = True, steps: int | None = None,
            warmup: int | None = None, profile_dir: str | None = None,
            profile_steps: int = 3) -> dict:
  """Compiles and times the train step of ``config``; returns the figures.

  ``steps`` / ``warmup``: timed and untimed steps (default: the flags).
  Besides the timing, the result holds XLA's memory estimate of the
  compiled step (``xla_memory_bytes``, what ``prolip_jax.aot`` reports),
  the device's real peak (``peak_bytes``, from ``Device.memory_stats``;
  None where the backend keeps none, as on the CPU), XLA's cost-model MFU
  (``xla_estimated_mfu``, the figure ``aot`` prints) and the number of cuDNN
  fused-attention calls in the compiled step; with ``profile_dir``, where
  ``profile_steps`` more steps' device time went (``kernels``).
  """
  steps = flags.FLAGS.steps if steps is None else steps
  warmup = flags.FLAGS.warmup if warmup is None else warmup
  mesh = shd.make_mesh(config.mesh)
  model_cfg = ModelConfig.from_config(config.model)
  model = ProLIP(model_cfg, attention=attention_impl_for(
      mesh.devices.flat, model_cfg.attention_impl))
  tx, schedule = optimizer.make_optimizer(config.optim, config.total_steps)
  init_state, state_shardings = train.run_state_initializer(config, model, tx,
                                                            mesh)
  state = init_state(jax.random.key(0))
  mask_id = 3 if config.tokenizer.mask_id < 0 else config.tokenizer.mask_id
  step_fn = train.jit_train_step(model, config, tx, schedule, mesh, mask_id,
                                 state_shardings)

  b = config.batch_size
  batch = _random_batch(mesh, model_cfg, b)
  step_rng = jax.random.key(1)

  t0 = time.time()
  compiled = step_fn.lower(state, batch, step_rng).compile()
  compile_s = time.time() - t0
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  xla_flops = float(cost.get('flops', 0.0)) if cost else 0.0
  # cost_analysis is per device program; the step is SPMD over all devices.
  xla_flops_step = xla_flops * jax.device_count()
  # The analytic count of prolip_jax.aot and the training loop's MFU.
  analytic_step = b * mfu_lib.run_flops_per_pair(
      config, model_cfg.to_dict(), objectives.get(config.objective))['train']

  memory = aot._memory(compiled)  # pylint: disable=protected-access
  cudnn_calls = compiled.as_text().count('__cudnn$fmha')
  for _ in range(warmup):
    state, metrics = compiled(state, batch, step_rng)
  jax.block_until_ready(metrics)
  t0 = time.time()
  for _ in range(steps):
    state, metrics = compiled(state, batch, step_rng)
  jax.block_until_ready(metrics)
  step_s = (time.time() - t0) / steps
  kernels = (_traced_kernels(compiled, state, batch, step_rng, profile_dir,
                             profile_steps) if profile_dir else None)

  dev = jax.devices()[0]
  peak = flags.FLAGS.peak_tflops or device_peak_tflops(dev)
  n = jax.device_count()
  achieved = analytic_step / step_s / n / 1e12
  mfu = 100 * achieved / peak if peak else float('nan')
  if verbose:
    print(f'jax {jax.__version__}, {n} x {dev.device_kind} ({dev.platform}); '
          f'objective {config.objective}, compute {model_cfg.compute_dtype}, '
          f'remat {model_cfg.remat}, mesh {dict(mesh.shape)}')
    print(f'model: vision {model_cfg.vision.width}x{model_cfg.vision.layers} '
          f'patch {model_cfg.vision.patch_size} @ '
          f'{model_cfg.vision.image_size}px, text {model_cfg.text.width}x'
          f'{model_cfg.text.layers} ctx {model_cfg.text.context_length}; '
          f'global batch {b}')
    print(f'compile {compile_s:.1f} s; step {step_s * 1e3:.1f} ms; '
          f'{b / step_s:.1f} samples/s ({b / step_s / n:.1f} per device)')
    print(f'FLOPs/step: XLA {xla_flops_step / 1e12:.3f} T, analytic '
          f'{analytic_step / 1e12:.3f} T ({analytic_step / b / 1e9:.1f} '
          'G/pair)')
    if peak:
      print(f'model TFLOP/s per device {achieved:.1f} of peak {peak:.0f}: '
            f'MFU {mfu:.1f}% (analytic FLOPs)')
    else:
      print(f'model TFLOP/s per device {achieved:.3f}; no peak known for '
            f'{dev.device_kind!r} (pass --peak_tflops for MFU)')
    print(f"final loss {float(metrics['loss']):.4f}")
    if kernels:
      print(kernel_profile.format_summary(kernels))
  stats = dev.memory_stats() or {}
  optimal_s = float((cost or {}).get('optimal_seconds', 0.0))
  estimated_mfu = (100 * analytic_step / n / optimal_s / (peak * 1e12)
                   if optimal_s > 0 and peak and not model_cfg.scan
                   else None)  # a scanned stack's cost counts one layer
  return {'batch': b, 'remat': model_cfg.remat,
          'remat_policy': model_cfg.remat_policy, 'scan': model_cfg.scan,
          'compile_s': compile_s, 'step_ms': step_s * 1e3,
          'samples_per_s': b / step_s, 'tflops': achieved, 'mfu': mfu,
          'xla_memory_bytes': memory['total'] if memory else None,
          'peak_bytes': stats.get('peak_bytes_in_use'),
          'bytes_limit': stats.get('bytes_limit'),
          'xla_estimated_mfu': estimated_mfu, 'cudnn_attention_calls':
          cudnn_calls, 'final_loss': float(metrics['loss']),
          'kernels': kernels}


def main(argv):
  del argv
  config = flags.FLAGS.config
  batches = [int(x) for x in flags.FLAGS.sweep_batch] or [config.batch_size]
  remats = [x.lower() in ('1', 'true', 'yes')
            for x in flags.FLAGS.sweep_remat] or [config.model.remat]
  if len(batches) == len(remats) == 1:
    measure(config, profile_dir=flags.FLAGS.profile_dir)
    return
  print('| global batch | remat | step (ms) | samples/s | model TFLOP/s/dev '
        '| MFU |')
  print('|---|---|---|---|---|---|')
  for remat in remats:
    for batch_size in batches:
      cfg = config.copy_and_resolve_references()
      cfg.batch_size = batch_size
      cfg.model.remat = remat
      try:
        r = measure(cfg, verbose=False)
      except Exception as e:  # pylint: disable=broad-except
        if 'RESOURCE_EXHAUSTED' not in str(e) and 'memory' not in str(e):
          raise
        print(f'| {batch_size} | {remat} | out of memory | | | |', flush=True)
        continue
      print(f"| {batch_size} | {remat} | {r['step_ms']:.1f} | "
            f"{r['samples_per_s']:.1f} | {r['tflops']:.2f} | "
            + (f"{r['mfu']:.1f}% |" if r['mfu'] == r['mfu'] else 'n/a |'),
            flush=True)


if __name__ == '__main__':
  sys.exit(app.run(main))
