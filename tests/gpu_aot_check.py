"""Compiles a config's train step for one H100, deviceless (no GPU needed).

Run by tests/test_attention.py with the python of a jax[cuda12] venv:
``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 XLA_FLAGS=--xla_gpu_enable_triton_gemm=false
python tests/gpu_aot_check.py --out result.json``. The step is the one
``prolip_jax.training.train`` builds (model with ``attention_impl_for`` of the
target's devices, optimizer, shardings, donation), lowered from abstract
state and batch for an H100 described by XLA's target config (the copy in
prolip_jax/aot/specs/),
and compiled. Writes the attention implementation, the counts of cuDNN
fused-attention kernels (forward, backward) in the compiled HLO, per-device
memory and compile time as JSON.
"""

import argparse
import json
import os
import re
import time

import jax
from jax.experimental import topologies
import jax.numpy as jnp

from prolip_jax import objectives
from prolip_jax import sharding as shd
from prolip_jax.config import presets
from prolip_jax.models import attention_impl_for
from prolip_jax.models import ModelConfig
from prolip_jax.models import ProLIP
from prolip_jax.training import optimizer
from prolip_jax.training import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SPEC = os.environ.get(
    'PROLIP_H100_SPEC', os.path.join(ROOT, 'prolip_jax', 'aot', 'specs',
                                     'h100_sxm.txtpb'))


def h100_devices(spec_path: str):
  """One H100 from XLA's GPU target config (``#`` comment lines dropped)."""
  with open(spec_path) as f:
    spec = ''.join(l for l in f if not l.lstrip().startswith('#'))
  topo = topologies.get_topology_desc(platform='cuda', target_config=spec,
                                      topology='1x1x1')
  return topo.devices


def abstract(tree, shardings):
  return jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      tree, shardings)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument('--config', default=os.path.join(ROOT, 'configs',
                                                   'prolip_b16.py'))
  ap.add_argument('--per_device_batch', type=int, default=16)
  ap.add_argument('--spec', default=DEFAULT_SPEC)
  ap.add_argument('--scan', choices=['config', 'true', 'false'],
                  default='config', help='model.scan (default: the config)')
  ap.add_argument('--remat', choices=['config', 'true', 'false'],
                  default='config', help='model.remat (default: the config)')
  ap.add_argument('--out', required=True)
  args = ap.parse_args()

  config = presets.load_config_file(args.config)
  if args.scan != 'config':
    config.model.scan = args.scan == 'true'
  if args.remat != 'config':
    config.model.remat = args.remat == 'true'
  devices = h100_devices(args.spec)
  mesh = shd.make_mesh(config.mesh, devices=devices)
  config.batch_size = args.per_device_batch * len(devices)
  model_cfg = ModelConfig.from_config(config.model)
  impl = attention_impl_for(mesh.devices.flat, model_cfg.attention_impl)
  model = ProLIP(model_cfg, attention=impl)
  objective = objectives.get(config.objective)
  tx, schedule = optimizer.make_optimizer(config.optim, config.total_steps)
  init_state, state_shardings = train.run_state_initializer(
      config, model, tx, mesh, objective)
  state = abstract(jax.eval_shape(init_state, jax.random.key(0)),
                   state_shardings)
  mask_id = max(config.tokenizer.mask_id, 3)
  step = train.jit_train_step(model, config, tx, schedule, mesh, mask_id,
                              state_shardings, objective)
  b, size = config.batch_size, model_cfg.vision.image_size
  batch_sharding = shd.batch_sharding(mesh)
  batch = {
      'image': jax.ShapeDtypeStruct((b, size, size, 3), jnp.uint8,
                                    sharding=batch_sharding),
      'tokens': jax.ShapeDtypeStruct((b, model_cfg.text.context_length),
                                     jnp.int32, sharding=batch_sharding),
      'aug': jax.ShapeDtypeStruct((b, 11), jnp.float32,
                                  sharding=batch_sharding)}
  key = jax.eval_shape(lambda: jax.random.key(1))
  rng = jax.ShapeDtypeStruct(key.shape, key.dtype,
                             sharding=shd.replicated(mesh))
  t0 = time.time()
  compiled = step.lower(state, batch, rng).compile()
  compile_s = time.time() - t0
  hlo = compiled.as_text()
  targets = re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', hlo)
  mem = compiled.memory_analysis()
  result = {
      'device': devices[0].device_kind, 'attention': impl,
      'scan': model_cfg.scan, 'remat': model_cfg.remat,
      'remat_policy': model_cfg.remat_policy,
      'per_device_batch': args.per_device_batch, 'compiled': True,
      'compile_s': round(compile_s, 1),
      'cudnn_fwd': sum(not t.endswith('Backward') for t in targets),
      'cudnn_bwd': sum(t.endswith('Backward') for t in targets),
      'argument_gib': mem.argument_size_in_bytes / 2**30,
      'temp_gib': mem.temp_size_in_bytes / 2**30,
  }
  print(json.dumps(result))
  with open(args.out, 'w') as f:
    json.dump(result, f)


if __name__ == '__main__':
  main()
