"""Compile time of the towers with and without ``model.scan`` (CPU, jit).

  PYTHONPATH=$PWD python benchmarks/compile_time.py \
      --models=B/16,SO400M/14 --scan=false,true --what=train_step

For each model and scan setting, lowers and compiles (for this process's
default backend, normally the CPU) either the forward+backward of both
towers (``--what=forward_backward``: a scalar of the image, masked-image and
text outputs, differentiated w.r.t. the parameters) or the full train step
of ``configs/prolip_b16.py`` with the model swapped in (``--what=train_step``:
loss, masked copies, AdamW: ``train.jit_train_step`` over the state of
``train.run_state_initializer``, as a run compiles it). Inputs are
abstract (``jax.ShapeDtypeStruct``): nothing is allocated or run. Prints a
Markdown table (trace+lower seconds, compile seconds, HLO size) and one JSON
line per row.

``--models`` names rows of ``prolip_jax/config/sizes.py``, laid over the
B/16 config's model (``presets.model_size``): SO400M/14 is SigLIP's
shape-optimised ViT (width 1152, 27 layers, 16 heads, MLP 4304,
tanh-approximated GELU) with a text tower of the same shape and a 16-token
context, as ``configs/prolip_so400m14.py`` trains it.
"""

import json
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

from prolip_jax import models
from prolip_jax import objectives
from prolip_jax import sharding as shd
from prolip_jax.aot import compiler as aot
from prolip_jax.config import presets
from prolip_jax.models import attention_impl_for
from prolip_jax.models import masking
from prolip_jax.models import ModelConfig
from prolip_jax.models import ProLIP
from prolip_jax.training import optimizer
from prolip_jax.training import train

flags.DEFINE_list('models', ['B/16', 'SO400M/14'], 'model shapes to compile')
flags.DEFINE_list('scan', ['false', 'true'], 'model.scan values')
flags.DEFINE_enum('what', 'forward_backward', ['forward_backward',
                                                'train_step'],
                  'what to compile')
flags.DEFINE_integer('batch', 8, 'global batch of the compiled program')
flags.DEFINE_bool('remat', True, 'model.remat (on in the B/16 config until '
                  '2026-11-27, so on here: the figures stay comparable)')
flags.DEFINE_string('remat_policy', 'nothing_saveable', 'model.remat_policy')
flags.DEFINE_string('dtype', 'bfloat16', 'model.compute_dtype')


def train_step_program(config, model, mesh, mask_id: int):
  """``(jitted step, (state, batch, rng))`` of ``config``'s objective, the
  arguments abstract: the step a run compiles (``train.jit_train_step``)
  over the state it trains (``train.run_state_initializer``: UniCLIP's heads,
  OTTER's teacher) and a batch as the pipeline makes it."""
  objective = objectives.get(config.objective)
  tx, schedule = optimizer.make_optimizer(config.optim, config.total_steps)
  init_state, state_shardings = train.run_state_initializer(
      config, model, tx, mesh, objective)
  state = jax.eval_shape(init_state, jax.random.key(0))
  fn = train.jit_train_step(model, config, tx, schedule, mesh, mask_id,
                            state_shardings, objective)
  batch = aot.abstract_batch(config, model.config, config.batch_size,
                             shd.batch_sharding(mesh), objective)
  return fn, (state, batch, jax.eval_shape(lambda: jax.random.key(0)))


def compile_once(name: str, scan: bool) -> dict:
  """Lowers and compiles one program; returns its timings."""
  config = presets.load_config_file('configs/prolip_b16.py')
  config.model.update(presets.model_size(name))
  config.model.update(scan=scan, remat=flags.FLAGS.remat,
                      remat_policy=flags.FLAGS.remat_policy,
                      compute_dtype=flags.FLAGS.dtype)
  model_cfg = ModelConfig.from_config(config.model)
  mesh = shd.make_mesh(config.mesh)
  model = ProLIP(model_cfg, attention=attention_impl_for(
      mesh.devices.flat, model_cfg.attention_impl))
  b = flags.FLAGS.batch
  size, ctx = model_cfg.vision.image_size, model_cfg.text.context_length
  if flags.FLAGS.what == 'forward_backward':
    images = jax.ShapeDtypeStruct((b, size, size, 3), jnp.float32)
    tokens = jax.ShapeDtypeStruct((b, ctx), jnp.int32)
    n_keep = masking.num_kept_patches(model_cfg.num_patches, 0.25)
    keep = jax.ShapeDtypeStruct((b, n_keep), jnp.int32)
    params = jax.eval_shape(
        lambda: models.init_params(model, jax.random.key(0)))

    def loss(p, images, tokens, keep):
      apply = lambda *a, m: model.apply({'params': p}, *a, method=m)
      outs = (apply(images, m='encode_image'),
              apply(images, keep, m='encode_image'),
              apply(tokens, m='encode_text'))
      return sum(jnp.sum(x) for x in jax.tree.leaves(outs))

    fn, args = jax.jit(jax.grad(loss)), (params, images, tokens, keep)
  else:
    config.batch_size = b
    fn, args = train_step_program(config, model, mesh,
                                  config.tokenizer.mask_id)
  t0 = time.perf_counter()
  lowered = fn.lower(*args)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  return {'model': name, 'scan': scan, 'what': flags.FLAGS.what,
          'remat': model_cfg.remat, 'remat_policy': model_cfg.remat_policy,
          'batch': b, 'lower_s': round(t1 - t0, 2),
          'compile_s': round(t2 - t1, 2),
          'hlo_chars': len(compiled.as_text()),
          'backend': jax.default_backend(), 'jax': jax.__version__}


def main(argv):
  del argv
  rows = []
  print('| model | scan | trace+lower (s) | compile (s) | total (s) | '
        'optimised HLO (chars) |')
  print('|---|---|---|---|---|---|')
  for name in flags.FLAGS.models:
    for scan in flags.FLAGS.scan:
      r = compile_once(name, scan.lower() in ('1', 'true', 'yes'))
      rows.append(r)
      print(f"| {r['model']} | {r['scan']} | {r['lower_s']:.1f} | "
            f"{r['compile_s']:.1f} | {r['lower_s'] + r['compile_s']:.1f} | "
            f"{r['hlo_chars']:,} |", flush=True)
  for r in rows:
    print(json.dumps(r))


if __name__ == '__main__':
  app.run(main)
