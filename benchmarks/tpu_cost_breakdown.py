"""Where XLA's step-time estimate for a TPU goes: the B/16 step by part.

  python benchmarks/tpu_cost_breakdown.py                      # v5p, 512 pairs
  python benchmarks/tpu_cost_breakdown.py --attention none     # what-if
  python benchmarks/tpu_cost_breakdown.py --parts step --attention bf16_logits

Compiles, ahead of time for ``--topology`` (no TPU needed; the ``tpu``
extra's libtpu), pieces of the train step of ``--config`` at ``--pairs``
pairs per chip and prints, for each, XLA's cost model: FLOPs, bytes of HBM
traffic, the estimated time (``optimal_seconds``, what ``prolip_jax.aot``
turns into its MFU estimate) and the time the FLOPs alone would take at the
chip's peak. Estimates, not measurements. XLA's TPU estimate leaves the
collectives out, so one chip's parts stand for any slice's.

Parts (``--parts``):

``towers``
  forward and backward (gradients of the parameters) of the image tower on
  the batch, the text tower on the batch, and each on ProLIP's masked copies
  (every ``1/masking.fraction``-th pair), as the step runs them.
``optimizer``
  the config's optimizer update over the model's parameters.
``step``
  the whole train step (``prolip_jax.aot``'s program), with its MFU estimate.
``errors``
  no cost: on the CPU, the relative error of the attention's output and of
  the gradients of q, k and v in bf16, as the model computes it and with
  ``bf16_logits``, against float32 at 'highest' precision, at the image
  tower's shapes (16 images) with logits of standard deviation 1, 9 and 36.

``--attention`` swaps the attention inside the towers, in this process only,
to see what it costs in place (its cost depends on what XLA fuses around
it): ``model`` (as the model runs it), ``none`` (attention replaced by
``q * k + v``: what the rest of the block costs), ``bf16_logits`` (the q k^T
product rounded to bf16 before the float32 softmax, as in MaxText's default
and in PyTorch's non-fused attention under autocast: the model's
``model.attention_logits_dtype='bfloat16'`` option, off in the shipped
configs; docs/scaling.md has the error it adds).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bf16_logits_attention(q, k, v, kv_lengths=None, causal=False,
                           implementation='xla', logits_dtype='float32'):
  """The model's attention on XLA with ``model.attention_logits_dtype=
  'bfloat16'`` (``--attention bf16_logits``): the q k^T product rounded to
  bf16 before the float32 softmax."""
  from prolip_jax.models import attention  # pylint: disable=g-import-not-at-top
  del implementation, logits_dtype  # XLA: the what-if is about XLA's fusion
  return attention.dot_product_attention(q, k, v, kv_lengths, causal, 'xla',
                                         'bfloat16')


def _swap_attention(which: str):
  """Replaces the towers' attention in this process (``--attention``)."""
  from prolip_jax.models import transformer  # pylint: disable=g-import-not-at-top
  if which == 'none':
    # q * k + v keeps the q and k projections alive (v alone would let XLA
    # drop them, q + k + v merge them into one): what goes is the attention
    # between them.
    transformer.dot_product_attention = lambda q, k, v, *a, **kw: q * k + v
  elif which == 'bf16_logits':
    transformer.dot_product_attention = _bf16_logits_attention


def _parse(value: str):
  """A ``--set`` value: a Python literal, else the string itself."""
  import ast  # pylint: disable=g-import-not-at-top
  try:
    return ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return value


def _num(x: float) -> str:
  """One decimal from 10 up (thousands separated), 4 significant below."""
  return f'{x:,.1f}' if x >= 10 else f'{x:.4g}'


class _Chip:
  """One chip of the target: abstract arguments placed on it, and the cost
  line of a function compiled for it."""

  def __init__(self, target):
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    self.target = target
    self.devices = target.devices[:1]
    mesh = jax.sharding.Mesh(np.array(self.devices), ('data',))
    self.sharding = jax.sharding.NamedSharding(mesh,
                                               jax.sharding.PartitionSpec())
    self.peak = target.chip.peak_bf16_flops

  def arg(self, shape, dtype):
    import jax  # pylint: disable=g-import-not-at-top
    return jax.ShapeDtypeStruct(shape, dtype, sharding=self.sharding)

  def report(self, name, fn, *args, donate=()):
    import jax  # pylint: disable=g-import-not-at-top
    from prolip_jax.aot import compiler  # pylint: disable=g-import-not-at-top
    t0 = time.time()
    compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
    cost = compiler._cost(compiled)  # pylint: disable=protected-access
    flops = cost.get('flops', 0.0)
    print(f'| {name} | {_num(flops / 1e9)} | '
          f"{_num(cost.get('bytes accessed', 0.0) / 1e9)} | "
          f"{_num(cost.get('optimal_seconds', 0.0) * 1e3)} | "
          f'{_num(flops / self.peak * 1e3)} | {time.time() - t0:.0f} |',
          flush=True)


def _towers(chip, config, model, params, pairs):
  """The ``towers`` part's rows."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from prolip_jax.models import masking  # pylint: disable=g-import-not-at-top
  cfg = model.config
  size, ctx = cfg.vision.image_size, cfg.text.context_length

  def tower_grad(method):
    def loss(p, *inputs):
      outs = model.apply({'params': p}, *inputs, method=method)
      return sum(jnp.sum(o.astype(jnp.float32) ** 2) for o in outs
                 if o is not None)
    return jax.grad(loss)

  chip.report('image tower, forward + backward', tower_grad('encode_image'),
              params, chip.arg((pairs, size, size, 3), jnp.float32))
  chip.report('text tower, forward + backward', tower_grad('encode_text'),
              params, chip.arg((pairs, ctx), jnp.int32))
  if config.objective != 'prolip' or config.masking.fraction <= 0:
    return
  copies = pairs // int(round(1 / config.masking.fraction))
  kept = masking.num_kept_patches(cfg.num_patches,
                                  config.masking.image_keep_ratio)
  chip.report(f'image tower, {copies} masked copies ({kept} patches)',
              tower_grad('encode_image'), params,
              chip.arg((copies, size, size, 3), jnp.float32),
              chip.arg((copies, kept), jnp.int32))
  chip.report(f'text tower, {copies} masked copies',
              tower_grad('encode_text'), params,
              chip.arg((copies, ctx), jnp.int32))


def _optimizer(chip, config, params):
  """The ``optimizer`` part's row."""
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from prolip_jax.training import optimizer  # pylint: disable=g-import-not-at-top
  tx, _ = optimizer.make_optimizer(config.optim, config.total_steps)
  state = jax.tree.map(lambda x: chip.arg(x.shape, x.dtype),
                       jax.eval_shape(tx.init, params))

  def update(p, s, g):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s
  # Parameters and state donated, as the train step donates them.
  chip.report('optimizer update', update, params, state, params,
              donate=(0, 1))


def _step(chip, config, pairs):
  """The ``step`` part's row and MFU estimate (the whole slice)."""
  from prolip_jax.aot import compiler  # pylint: disable=g-import-not-at-top
  result = compiler.compile_step(config, chip.target, pairs)
  estimate = result.get('estimate') or {}
  flops = result.get('flops', {}).get('xla_per_device', 0.0)
  print(f"| train step ({result['num_devices']} chips) | {_num(flops / 1e9)} "
        f"| | {_num(estimate.get('step_seconds', 0.0) * 1e3)} | "
        f"{_num(flops / chip.peak * 1e3)} | {result['compile_seconds']:.0f} |")
  if estimate:
    print(f"\nstep: estimated MFU {100 * estimate['mfu']:.1f}% "
          f"({estimate['pairs_per_second_per_chip']:.0f} pairs/s per chip)")


def _errors(model):
  """The ``errors`` part's rows (on the host's CPU, whatever the target)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  cfg = model.config
  tokens = cfg.num_patches + (2 if cfg.use_unc else 1)
  shape = (16, tokens, cfg.vision.heads, cfg.vision.width // cfg.vision.heads)
  from prolip_jax.models import attention  # pylint: disable=g-import-not-at-top
  xla = attention.dot_product_attention  # the model's, on XLA
  forms = [('the model (float32 logits)', xla),
           ('bf16_logits', _bf16_logits_attention)]
  print('\n| attention at ' + str(shape) + ' in bf16 | logit std | out | dq '
        '| dk | dv |\n|---|---|---|---|---|---|')
  cpu = jax.devices('cpu')[0]
  q1, k1, v, g = (jax.device_put(jax.random.normal(kk, shape), cpu)
                  for kk in jax.random.split(jax.random.key(0), 4))
  for amplitude in (1.0, 3.0, 6.0):
    q, k = amplitude * q1, amplitude * k1
    std = float(jnp.std(jnp.einsum('btnh,bsnh->bnts', q, k))
                * shape[-1] ** -0.5)

    def grads(fn, dtype):
      f = lambda q, k, v: fn(*(x.astype(dtype) for x in (q, k, v))).astype(
          jnp.float32)
      with jax.default_matmul_precision('highest'):
        out, vjp = jax.vjp(f, q, k, v)
        return [np.asarray(x, np.float64) for x in (out,) + vjp(g)]
    reference = grads(xla, jnp.float32)
    for name, fn in forms:
      errors = [np.linalg.norm(x - r) / np.linalg.norm(r)
                for x, r in zip(grads(fn, jnp.bfloat16), reference)]
      print(f'| {name} | {std:.0f} | '
            + ' | '.join(f'{e:.1e}' for e in errors) + ' |', flush=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--config', default=os.path.join(
      _REPO, 'configs', 'prolip_b16.py'))
  parser.add_argument('--topology', default='v5p:2x2x1',
                      help='a TPU topology of prolip_jax.aot (one chip of '
                      'it; the step: the whole slice)')
  parser.add_argument('--pairs', type=int, default=512,
                      help='pairs per chip')
  parser.add_argument('--parts', default='towers,optimizer',
                      help='comma-separated: towers, optimizer, step, errors')
  parser.add_argument('--attention', default='model',
                      choices=('model', 'none', 'bf16_logits'),
                      help="what the towers' attention is (module docstring)")
  parser.add_argument('--set', action='append', default=[],
                      metavar='KEY=VALUE', help='a config override, e.g. '
                      'model.compute_dtype=bfloat16 (repeatable)')
  args = parser.parse_args(argv)
  _swap_attention(args.attention)

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from prolip_jax.aot import compiler  # pylint: disable=g-import-not-at-top
  from prolip_jax.aot.targets import resolve  # pylint: disable=g-import-not-at-top
  from prolip_jax.config import presets  # pylint: disable=g-import-not-at-top

  config = presets.load_config_file(args.config)
  for item in args.set:
    key, value = item.split('=', 1)
    config.update_from_flattened_dict({key: _parse(value)})
  target = resolve(args.topology)
  if target.platform != 'tpu':
    print('error: --topology must be a TPU topology', file=sys.stderr)
    return 2
  chip = _Chip(target)
  model, _ = compiler._model(config, chip.devices)  # pylint: disable=protected-access
  cfg = model.config
  size, ctx = cfg.vision.image_size, cfg.text.context_length
  params = jax.eval_shape(model.init, jax.random.key(0),
                          jnp.zeros((1, size, size, 3)),
                          jnp.zeros((1, ctx), jnp.int32))['params']
  params = jax.tree.map(lambda x: chip.arg(x.shape, x.dtype), params)

  print(f'{os.path.basename(args.config)}: {target.chip.name} '
        f'({args.topology}), {args.pairs} pairs per chip, remat {cfg.remat}, '
        f'compute {cfg.compute_dtype}, attention: {args.attention}; XLA cost '
        'model (estimates, not measurements)')
  parts = args.parts.split(',')
  if set(parts) & {'towers', 'optimizer', 'step'}:
    print('| part | GFLOP | HBM traffic (GB) | est. time (ms) | FLOPs at peak '
          '(ms) | compile (s) |')
    print('|---|---|---|---|---|---|')
  if 'towers' in parts:
    _towers(chip, config, model, params, args.pairs)
  if 'optimizer' in parts:
    _optimizer(chip, config, params)
  if 'step' in parts:
    _step(chip, config, args.pairs)
  if 'errors' in parts:
    _errors(model)
  return 0


if __name__ == '__main__':
  sys.exit(main())
