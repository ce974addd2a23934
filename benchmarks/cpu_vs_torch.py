"""CPU train step, JAX vs PyTorch: same model, same loss, same batch.

  python benchmarks/cpu_vs_torch.py [--arch issue,tiny] [--rounds 5]
      [--steps 5] [--threads 2] [--default_malloc]

Times, alternately in one process so both see the same machine load:

* JAX: the project's real jitted train step (``train.jit_train_step``: the
  ProLIP objective with its masked copies, AdamW, the scale clamp), as
  ``prolip_jax.main`` runs it on one CPU device;
* PyTorch: ``prolip_jax.interop.torch_reference``'s dual encoder with the same
  weights, a transcription of the ProLIP loss (PPCL, the three inclusion
  terms, VIB; eq. 6 with the config's weights) written for this benchmark
  only, masked copies of the same rows (image copies keeping the same number
  of patch tokens, caption copies with masked tokens) and torch's AdamW.

Architectures: ``issue`` = ViT 64 px / patch 8 / width 128 / 4 layers, text
16 tokens / width 128 / 4 layers / vocabulary 1,000, embedding 128, batch 64,
12.5% masked copies keeping 75% of the patches; ``tiny`` = the embedded
default (``configs/prolip_tiny.py``). It first checks that both steps compute
the same loss terms on the first batch (the unmasked terms: masks are drawn
independently), then prints per-step medians and the ratio.

Like ``prolip_jax.main`` on a CPU, the process first sets glibc's malloc to
keep freed memory (``prolip_jax.host_memory``: XLA's 440 MiB step buffer is
reused instead of mapped afresh every step); both steps run under it.
``--default_malloc`` leaves malloc as it is, to measure the step without it.
It also prints page faults per step (ru_minflt) of each.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np


def arch_config(name: str):
  from prolip_jax import demos
  c = demos.tiny_demo_config('prolip')
  c.mesh.num_devices = 1
  if name == 'issue':
    c.model.vision.image_size, c.model.vision.patch_size = 64, 8
    c.model.vision.width, c.model.vision.layers = 128, 4
    c.model.text.context_length, c.model.text.width = 16, 128
    c.model.text.layers, c.model.text.vocab_size = 4, 1000
    c.model.embed_dim = 128
    c.batch_size = 64
    c.masking.fraction = 0.125
    c.masking.image_keep_ratio = 0.75
  elif name != 'tiny':
    raise SystemExit(f'error: unknown --arch {name!r} (issue, tiny)')
  return c


def make_batch(config, rng):
  m = config.model
  b, s, ctx = config.batch_size, m.vision.image_size, m.text.context_length
  lengths = rng.integers(3, ctx, b)
  tokens = rng.integers(4, m.text.vocab_size, (b, ctx))
  tokens[np.arange(ctx)[None] >= lengths[:, None]] = m.text.pad_id
  return {'image': rng.integers(0, 256, (b, s, s, 3), dtype=np.uint8),
          'tokens': tokens.astype(np.int32),
          'aug': np.zeros((b, 11), np.float32)}


def jax_step_fn(config, mask_id: int):
  """``(step() -> metrics, params)``: the real jitted step on one device."""
  import jax
  from prolip_jax import sharding as shd
  from prolip_jax.training import optimizer
  from prolip_jax.training import train
  from prolip_jax.models import ModelConfig, ProLIP
  mesh = shd.make_mesh(config.mesh)
  model_cfg = ModelConfig.from_config(config.model)
  model = ProLIP(model_cfg)
  tx, schedule = optimizer.make_optimizer(config.optim, config.total_steps)
  init_state, shardings = train.run_state_initializer(config, model, tx, mesh)
  state = init_state(jax.random.key(0))
  params = jax.device_get(state.params)
  step = train.jit_train_step(model, config, tx, schedule, mesh, mask_id,
                              shardings)
  holder = {'state': state}

  def run(batch):
    batch = shd.host_to_global(mesh, batch)
    holder['state'], metrics = step(holder['state'], batch, jax.random.key(1))
    return jax.block_until_ready(metrics)

  return run, params, model_cfg


def torch_step_fn(config, params, model_cfg, mask_id: int):
  """The same step in PyTorch: reference model, ProLIP loss, AdamW."""
  import torch
  import torch.nn.functional as F
  from prolip_jax.interop import convert
  from prolip_jax.interop import torch_reference
  from prolip_jax.objectives import prolip as prolip_objective
  model = torch_reference.build(model_cfg)
  torch_reference.load_state_dict(
      model, convert.params_to_state_dict(params, model_cfg))
  model.train()
  loss_cfg, masking = config.loss, config.masking
  stride = prolip_objective.masking_stride(masking.fraction)
  decay = [p for p in model.parameters() if p.ndim >= 2]
  no_decay = [p for p in model.parameters() if p.ndim < 2]
  opt = torch.optim.AdamW(
      [{'params': decay, 'weight_decay': config.optim.weight_decay},
       {'params': no_decay, 'weight_decay': 0.0}],
      lr=config.optim.lr, betas=(config.optim.b1, config.optim.b2),
      eps=config.optim.eps)
  mean = torch.tensor(config.data.mean).view(1, 3, 1, 1)
  std = torch.tensor(config.data.std).view(1, 3, 1, 1)
  vt = model.visual
  n_patches = (model_cfg.vision.image_size // model_cfg.vision.patch_size)**2
  keep = max(1, int(round(n_patches * masking.image_keep_ratio)))
  gen = torch.Generator().manual_seed(0)

  def masked_image_forward(images):
    x = vt.conv1(images).flatten(2).transpose(1, 2)
    x = x + vt.positional_embedding[2:]
    idx = torch.rand(x.shape[0], n_patches, generator=gen).argsort(1)[:, :keep]
    x = torch.gather(x, 1, idx[..., None].expand(-1, -1, x.shape[-1]))
    special = torch.stack([vt.class_embedding, vt.unc_embedding])
    special = (special + vt.positional_embedding[:2]).expand(x.shape[0], -1,
                                                             -1)
    x = vt.ln_post(vt.transformer(vt.ln_pre(torch.cat([special, x], 1))))
    return (F.normalize(x[:, 0] @ vt.proj, dim=-1),
            vt.uncertainty_proj(x[:, 1]))

  def log_inclusion(m1, l1, m2, l2, eps):
    log_a = eps + torch.logaddexp(-l1, -l2 - np.log(2.0))
    quad = (m1 - m2)**2 * torch.exp(eps - torch.logaddexp(l1,
                                                          l2 + np.log(2.0)))
    return -2.0 * l1 - l2 - 0.5 * log_a - quad

  def inclusion(m1, l1, m2, l2):
    h = (log_inclusion(m1, l1, m2, l2, loss_cfg.eps)
         - log_inclusion(m2, l2, m1, l1, loss_cfg.eps))
    return (-F.logsigmoid(loss_cfg.c * h)).mean()

  def vib(mu, lv):
    return (-0.5 * (1.0 + lv - mu**2 - lv.exp())).mean()

  def loss_terms(batch):
    images = torch.from_numpy(batch['image']).permute(0, 3, 1, 2).float()
    images = (images / 255.0 - mean) / std
    tokens = torch.from_numpy(batch['tokens']).long()
    mu_i, lv_i = model.visual(images)
    mu_t, lv_t = model.text(tokens)
    a, b = model.logit_scale.exp(), model.logit_bias
    sim = (mu_i @ mu_t.T - 0.5 * lv_i.exp().sum(-1)[:, None]
           - 0.5 * lv_t.exp().sum(-1)[None, :])
    logits = a * sim + b
    labels = 2 * torch.eye(len(tokens)) - 1
    terms = {'ppcl': -F.logsigmoid(labels * logits).sum() / len(tokens),
             'inclusion_img_txt': inclusion(mu_i, lv_i, mu_t, lv_t),
             'vib_img': vib(mu_i, lv_i), 'vib_txt': vib(mu_t, lv_t)}
    if stride:
      rows = torch.arange(0, len(tokens), stride)
      mu_im, lv_im = masked_image_forward(images[rows])
      masked = tokens[rows].clone()
      hide = (torch.rand(masked.shape, generator=gen) < masking.text_mask_prob
              ) & (masked != model_cfg.text.pad_id)
      masked[hide] = mask_id
      mu_tm, lv_tm = model.text(masked)
      terms['inclusion_masked_img'] = inclusion(mu_i[rows], lv_i[rows],
                                                mu_im, lv_im)
      terms['inclusion_masked_txt'] = inclusion(mu_t[rows], lv_t[rows],
                                                mu_tm, lv_tm)
    return terms

  weights = {'ppcl': 1.0, 'inclusion_img_txt': loss_cfg.alpha1,
             'inclusion_masked_img': loss_cfg.alpha2,
             'inclusion_masked_txt': loss_cfg.alpha2,
             'vib_img': loss_cfg.beta, 'vib_txt': loss_cfg.beta}
  max_log_scale = float(np.log(config.optim.max_logit_scale))

  def run(batch):
    opt.zero_grad(set_to_none=True)
    terms = loss_terms(batch)
    loss = sum(weights[k] * v for k, v in terms.items())
    loss.backward()
    opt.step()
    with torch.no_grad():
      model.logit_scale.clamp_(0.0, max_log_scale)
    return {k: float(v.detach()) for k, v in terms.items()}

  return run


def compare(name: str, rounds: int, steps: int):
  config = arch_config(name)
  mask_id = 3
  rng = np.random.default_rng(0)
  batches = [make_batch(config, rng) for _ in range(4)]
  jax_run, params, model_cfg = jax_step_fn(config, mask_id)
  torch_run = torch_step_fn(config, params, model_cfg, mask_id)
  # Same loss on the first batch (the terms that involve no random mask).
  j = jax_run(batches[0])
  t = torch_run(batches[0])
  shared = ('ppcl', 'inclusion_img_txt', 'vib_img', 'vib_txt')
  worst = max(abs(float(j[k]) - t[k]) / max(abs(t[k]), 1e-12) for k in shared)
  print(f'\n[{name}] first-step loss terms, JAX vs PyTorch: '
        + ', '.join(f'{k} {float(j[k]):.6g} / {t[k]:.6g}' for k in shared)
        + f' (max relative difference {worst:.1e})')
  jax_run(batches[1])  # both warm: compiled / allocator primed
  torch_run(batches[1])
  times = {'jax': [], 'torch': []}
  faults = {'jax': 0, 'torch': 0}
  for r in range(rounds):
    for label, fn in (('jax', jax_run), ('torch', torch_run)):
      f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      t0 = time.perf_counter()
      for s in range(steps):
        fn(batches[(r + s) % len(batches)])
      times[label].append((time.perf_counter() - t0) / steps)
      faults[label] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
  jm = statistics.median(times['jax']) * 1e3
  tm = statistics.median(times['torch']) * 1e3
  b = config.batch_size
  print(f'[{name}] batch {b}: JAX {jm:.1f} ms/step ({b / jm * 1e3:.0f} '
        f'pairs/s), PyTorch {tm:.1f} ms/step ({b / tm * 1e3:.0f} pairs/s); '
        f'JAX speed / PyTorch speed = {tm / jm:.2f}')
  print(f'[{name}] rounds (ms/step), JAX: '
        + ' '.join(f'{t * 1e3:.0f}' for t in times['jax']) + '; PyTorch: '
        + ' '.join(f'{t * 1e3:.0f}' for t in times['torch'])
        + '; page faults per step, JAX '
        f"{faults['jax'] / rounds / steps:.0f}, PyTorch "
        f"{faults['torch'] / rounds / steps:.0f}")
  return tm / jm


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--arch', default='issue,tiny')
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--threads', type=int, default=os.cpu_count())
  parser.add_argument('--default_malloc', action='store_true',
                      help="leave glibc's malloc as it is (see the docstring)")
  args = parser.parse_args(argv)
  if not args.default_malloc:  # before JAX starts its threads, as main does
    from prolip_jax import host_memory
    if not host_memory.keep_freed_memory_on_cpu():
      print('note: malloc left as it is (not glibc, or not a CPU-only run)')
  import jax
  import torch
  torch.set_num_threads(args.threads)
  print(f'jax {jax.__version__} on {jax.devices()[0].device_kind}, torch '
        f'{torch.__version__} with {torch.get_num_threads()} threads, '
        f'{os.cpu_count()} cores visible')
  return {name: compare(name, args.rounds, args.steps)
          for name in args.arch.split(',')}


if __name__ == '__main__':
  main()
