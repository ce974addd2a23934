"""The uncertainty report of paper 4.3: sigma^2 of images vs texts (Fig. 5),
sigma_t^2 vs caption length (Fig. 6), by hierarchy level (Fig. 7, C.6),
inclusion of originals in partial views (Fig. 8), extremes (Fig. 4), and
image sigma^2 under a change of drawing style (``style_views``)."""

from __future__ import annotations

import numpy as np

from prolip_jax import errors
from prolip_jax import uncertainty as U
from prolip_jax.evaluation.context import Context
from prolip_jax.evaluation.context import SkipSuite


def _parse_view(spec: str) -> tuple[str, float, str]:
  """'drop:0.25' (keep 25% of patch tokens) or 'occlude:0.25' (zero the
  central 25% of the area) -> (kind, value, display name)."""
  kind, v = U.kind_and_value(spec)
  if kind == 'drop' and 0 < v <= 1:
    return kind, v, f'{1 - v:.0%} patches dropped'
  if kind == 'occlude' and 0 <= v <= 1:
    return kind, v, f'{v:.0%} centre occluded'
  raise errors.ConfigError(
      f"image view must be 'drop:KEEP' or 'occlude:FRACTION', got {spec!r}")


def suite_uncertainty(ctx: Context, cfg) -> tuple[dict, dict, list]:
  """The uncertainty report of paper 4.3 (Figs. 4-8, C.6)."""
  if not ctx.embedder.probabilistic:
    raise SkipSuite('the uncertainty report needs a probabilistic model')
  data, emb, tok = ctx.data, ctx.embedder, ctx.model.tokenizer
  views = [_parse_view(spec) for spec in cfg.get('image_views', ())]
  styles = tuple(cfg.get('style_views', ()))
  for spec in styles:  # a bad spec fails here, before any embedding
    U.parse_style(spec)
  metrics, details, figs = {}, {}, []
  img = ctx.image_embeddings()
  s_img = U.sigma2(img[1])

  # Every distinct caption, first-appearance order.
  texts = list(dict.fromkeys(c for caps in data.captions for c in caps))
  txt = emb.texts(texts, desc='captions')
  s_txt = U.sigma2(txt[1])
  s_of = dict(zip(texts, s_txt))
  # sigma^2 two ways: per dimension, the mean of exp(logvar) (what
  # training's summary prints), and the trace tr(Sigma) of paper 4.3 (what
  # the figures and every other sigma^2 here use); trace = dim * per-dim.
  metrics['sigma2_per_dim_img_mean'] = float(s_img.mean() / img[1].shape[-1])
  metrics['sigma2_per_dim_txt_mean'] = float(s_txt.mean() / txt[1].shape[-1])
  metrics['sigma2_trace_img_mean'] = float(s_img.mean())
  metrics['sigma2_trace_txt_mean'] = float(s_txt.mean())
  pair_t = np.array([s_of[c] for caps in data.captions for c in caps])
  pair_v = np.repeat(s_img, [len(c) for c in data.captions])
  metrics['txt_more_uncertain_than_img'] = float((pair_t > pair_v).mean())
  details['sigma2_img'] = U.summary_stats(s_img)
  details['sigma2_txt'] = U.summary_stats(s_txt)
  figs.append(ctx.figure(U.fig_sigma2_hist(s_img, s_txt), 'sigma2_hist.png',
                         1))

  # sigma_t^2 vs caption length (tokens, EOS included).
  lengths = U.num_tokens(tok(texts), tok.pad_id)
  rho = U.spearman(lengths, s_txt)
  metrics['spearman_length_sigma2'] = rho
  figs.append(ctx.figure(U.fig_sigma2_vs_length(lengths, s_txt, rho),
                         'sigma2_vs_length.png', 1))

  # Hierarchy levels (C.6).
  levels = cfg.get('levels')
  if levels:
    levels = tuple(levels)
    sl = np.array([[s_of[caps[j]] for j in levels] for caps in data.captions])
    order = U.hierarchy_order(sl)
    metrics['level_adjacent_decreasing'] = order['adjacent_decreasing']
    metrics['level_chain_decreasing'] = order['chain_decreasing']
    metrics['level_min_general_above_specific'] = min(
        order['pairwise'][i][j] for i in range(len(levels))
        for j in range(i + 1, len(levels)))
    metrics['spearman_level_sigma2'] = order['spearman_level']
    names = [(data.level_names[j] if data.level_names else str(j))
             for j in levels]
    details['levels'] = {'indices': list(levels), 'names': names, **order}
    figs.append(ctx.figure(U.fig_sigma2_by_level(sl, names,
                                                 np.array(order['pairwise'])),
                           'sigma2_by_level.png', 3))

  # Inclusion of originals in partial views (Fig. 8).
  eps = float(cfg.get('inclusion_eps', 0.0))
  tests, inc_details = {}, {}
  n_img = int(cfg.get('num_inclusion_images', 0)) or len(data.images)
  sub = np.arange(min(n_img, len(data.images)))
  orig = (img[0][sub], img[1][sub])
  orig_s2 = s_img[sub]
  for kind, v, name in views:
    if kind == 'drop':
      view = emb.images(data.images[sub], keep_ratio=v, seed=ctx.seed,
                        desc=f'images, {name}')
    else:
      view = emb.images(U.occlude_center(data.images[sub], v),
                        desc=f'images, {name}')
    tests[f'image, {name}'] = U.inclusion_test(orig, view, eps)
  # A change of drawing style (blur, line weight, hue) keeps what is drawn:
  # the restyled image should not look *more* certain than the original.
  style_details = {}
  for spec in styles:
    styled = U.sigma2(emb.images(U.restyle(data.images[sub], spec),
                                 desc=f'images, {spec}')[1])
    not_more_certain = float((styled >= orig_s2).mean())
    key = spec.replace(':', '_')  # 'blur_1.5': a valid TensorBoard tag
    metrics[f'style_not_more_certain/{key}'] = not_more_certain
    style_details[spec] = {
        'not_more_certain': not_more_certain,
        'median_log_ratio': float(np.median(np.log(styled / orig_s2)))}
  if style_details:
    details['style'] = style_details
  if levels:
    # The text hierarchy as inclusion (4.4): each caption inside the more
    # general caption one level up, H(level j+1 ⊂ level j) > 0.
    row = {c: i for i, c in enumerate(texts)}
    chain = []
    for a, b in zip(levels[:-1], levels[1:]):
      gen = np.array([row[caps[a]] for caps in data.captions])
      spec = np.array([row[caps[b]] for caps in data.captions])
      t = U.inclusion_test((txt[0][spec], txt[1][spec]),
                           (txt[0][gen], txt[1][gen]), eps)
      tests[f'text, {names[levels.index(b)]} in {names[levels.index(a)]}'] = t
      chain.append(t['h'] > 0)
    metrics['inclusion_positive/text_hierarchy_chain'] = float(
        np.logical_and.reduce(chain).mean())
  prob = float(cfg.get('text_mask_prob', 0.0))
  if prob > 0:
    tokens = tok(texts)
    masked = U.mask_tokens(tokens, prob, tok.mask_id, tok.pad_id,
                           seed=ctx.seed, eos_id=getattr(tok, 'eos_id', None))
    view = emb.tokens(masked, desc='masked captions')
    tests[f'text, {prob:.0%} tokens masked'] = U.inclusion_test(txt, view,
                                                                 eps)
  for name, t in tests.items():
    key = name.replace(', ', '_').replace(' ', '_').replace('%', 'pct')
    metrics[f'inclusion_positive/{key}'] = t['positive_fraction']
    inc_details[name] = {k: v for k, v in t.items() if k != 'h'}
    inc_details[name]['h'] = U.summary_stats(t['h'])
  details['inclusion'] = inc_details
  if tests:
    figs.append(ctx.figure(U.fig_inclusion_hist(tests, eps),
                           'inclusion_hist.png', len(tests)))

  # Most / least uncertain samples (Fig. 4).
  k = int(cfg.get('num_examples', 8))
  most, least = U.extremes(s_txt, k)
  details['most_uncertain_captions'] = [[texts[i], float(s_txt[i])]
                                        for i in most]
  details['least_uncertain_captions'] = [[texts[i], float(s_txt[i])]
                                         for i in least]
  most_i, least_i = U.extremes(s_img, k)
  details['most_uncertain_images'] = [[data.keys[i], float(s_img[i])]
                                      for i in most_i]
  details['least_uncertain_images'] = [[data.keys[i], float(s_img[i])]
                                       for i in least_i]
  figs.append(ctx.figure(U.fig_extreme_images(data.images, s_img, most_i,
                                              least_i),
                         'uncertain_images.png',
                         2 * max(len(most_i), len(least_i))))
  if data.labels is not None:
    # C.8 "understanding image dataset": sigma_v^2 vs being misclassified.
    details['sigma2_img_by_class'] = {
        n: float(s_img[data.labels == c].mean())
        for c, n in enumerate(data.class_names) if (data.labels == c).any()}
  return metrics, details, figs

