"""``uncertainty_report``: the uncertainty figures of paper 4.3 on a bundled
set: sigma^2 of images vs texts (Fig. 5), sigma_t^2 vs caption length
(Fig. 6), by hierarchy level (Fig. 7, C.6), inclusion of originals in
partial views (Fig. 8), extremes (Fig. 4), and image sigma^2 under a change
of drawing style (``style_views``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from prolip_jax import errors
from prolip_jax.evaluation import evaluator
from prolip_jax.evaluation import report
from prolip_jax.evaluation import uncertainty as U
from prolip_jax.evaluation.in_memory import InMemoryEvaluator
from prolip_jax.evaluation.kinds import uncertainty as uncertainty_kind
from prolip_jax.evaluation.sets import EvalData


def parse_view(spec: str) -> tuple[str, float, str]:
  """'drop:0.25' (keep 25% of patch tokens) or 'occlude:0.25' (zero the
  central 25% of the area) -> (kind, value, display name)."""
  kind, v = U.kind_and_value(spec)
  if kind == 'drop' and 0 < v <= 1:
    return kind, v, f'{1 - v:.0%} patches dropped'
  if kind == 'occlude' and 0 <= v <= 1:
    return kind, v, f'{v:.0%} centre occluded'
  raise errors.ConfigError(
      f"image view must be 'drop:KEEP' or 'occlude:FRACTION', got {spec!r}")


class Evaluator(InMemoryEvaluator):
  """The uncertainty report of paper 4.3 (Figs. 4-8, C.6).

  ``levels``: caption positions of the hierarchy (most general first);
  ``image_views``: partial views for H(orig ⊂ view) ('drop:KEEP',
  'occlude:F'); ``style_views``: restyled images ('blur:1', 'thicken:3',
  'hue:...'); ``text_mask_prob``: masked captions as views;
  ``inclusion_eps``: eq. 3's stability term; ``num_inclusion_images``: 0
  for all; ``num_examples``: extremes listed.
  """

  OPTIONS = {'levels': (), 'image_views': (), 'style_views': (),
             'text_mask_prob': 0.0, 'inclusion_eps': 0.0,
             'num_inclusion_images': 0, 'num_examples': 8}
  LABELS = (
      report.Label(r'sigma2_per_dim_img_mean',
                   'mean sigma^2 per dimension, images', report.number),
      report.Label(r'sigma2_per_dim_txt_mean',
                   'mean sigma^2 per dimension, captions', report.number),
      report.Label(r'sigma2_trace_img_mean',
                   'mean sigma^2 = tr(Sigma) (trace), images', report.number),
      report.Label(r'sigma2_trace_txt_mean',
                   'mean sigma^2 = tr(Sigma) (trace), captions',
                   report.number),
      report.Label(r'spearman_level_sigma2', 'Spearman(level, sigma^2)',
                   report.signed),
      report.Label(r'level_adjacent_decreasing',
                   'sigma^2 decreasing, adjacent levels', report.pct),
      report.Label(r'level_chain_decreasing',
                   'sigma^2 decreasing along every level', report.pct),
      report.Label(r'level_min_general_above_specific',
                   'min over level pairs P(general > specific)', report.pct),
      report.Label(r'inclusion_positive/text_hierarchy_chain',
                   'H > 0 along the whole text hierarchy', report.pct),
      report.Label(r'inclusion_positive/(.+)', 'H(orig in view) > 0, {0}',
                   report.pct),
      report.Label(r'style_not_more_certain/([a-z]+)_(.+)',
                   'restyled image sigma^2 >= original, {0} {1}', report.pct),
      # The uncertainty kind's figures, named as it names them.
      *uncertainty_kind.Evaluator.LABELS)

  def evaluate_set(self, params: Any, data: EvalData) -> evaluator.Result:
    self.require_probabilistic('the uncertainty report')
    cfg = self.cfg
    views = [parse_view(spec) for spec in cfg.image_views]
    for spec in cfg.style_views:  # a bad spec fails here, before embedding
      U.parse_style(spec)
    metrics, details, figs = {}, {}, []
    img = self.image_embeddings(params)
    # Every distinct caption, first-appearance order.
    texts = list(dict.fromkeys(c for caps in data.captions for c in caps))
    txt = self.texts(params, texts, 'captions')
    self._images_vs_texts(data, img, texts, txt, metrics, details, figs)
    names = self._levels(data, texts, txt, metrics, details, figs)
    tests = self._view_tests(params, data, img, views, metrics, details)
    tests.update(self._text_tests(params, data, texts, txt, names, metrics))
    eps = float(cfg.inclusion_eps)
    inc_details = {}
    for name, t in tests.items():
      key = name.replace(', ', '_').replace(' ', '_').replace('%', 'pct')
      metrics[f'inclusion_positive/{key}'] = t['positive_fraction']
      inc_details[name] = {k: v for k, v in t.items() if k != 'h'}
      inc_details[name]['h'] = U.summary_stats(t['h'])
    details['inclusion'] = inc_details
    if tests:
      figs.append(self.figure(U.fig_inclusion_hist(tests, eps),
                              'inclusion_hist.png', len(tests)))
    figs.append(self._extremes(data, img, texts, txt, details))
    return evaluator.Result(metrics, details, [f for f in figs if f])

  def _images_vs_texts(self, data, img, texts, txt, metrics, details, figs):
    """sigma^2 of images vs captions (Fig. 5) and vs caption length
    (Fig. 6)."""
    s_img, s_txt = U.sigma2(img[1]), U.sigma2(txt[1])
    s_of = dict(zip(texts, s_txt))
    # sigma^2 two ways: per dimension, the mean of exp(logvar) (what
    # training's summary prints), and the trace tr(Sigma) of paper 4.3
    # (what the figures and every other sigma^2 here use); trace = dim *
    # per-dim.
    metrics['sigma2_per_dim_img_mean'] = float(s_img.mean()
                                               / img[1].shape[-1])
    metrics['sigma2_per_dim_txt_mean'] = float(s_txt.mean()
                                               / txt[1].shape[-1])
    metrics['sigma2_trace_img_mean'] = float(s_img.mean())
    metrics['sigma2_trace_txt_mean'] = float(s_txt.mean())
    pair_t = np.array([s_of[c] for caps in data.captions for c in caps])
    pair_v = np.repeat(s_img, [len(c) for c in data.captions])
    metrics['txt_more_uncertain_than_img'] = float((pair_t > pair_v).mean())
    details['sigma2_img'] = U.summary_stats(s_img)
    details['sigma2_txt'] = U.summary_stats(s_txt)
    figs.append(self.figure(U.fig_sigma2_hist(s_img, s_txt),
                            'sigma2_hist.png', 1))
    # sigma_t^2 vs caption length (tokens, EOS included).
    tok = self.encoders.tokenizer
    lengths = U.num_tokens(tok(texts), tok.pad_id)
    rho = U.spearman(lengths, s_txt)
    metrics['spearman_length_sigma2'] = rho
    figs.append(self.figure(U.fig_sigma2_vs_length(lengths, s_txt, rho),
                            'sigma2_vs_length.png', 1))

  def _levels(self, data, texts, txt, metrics, details, figs
              ) -> list[str]:
    """sigma^2 by hierarchy level (C.6); returns the levels' names."""
    levels = tuple(self.cfg.levels)
    if not levels:
      return []
    s_of = dict(zip(texts, U.sigma2(txt[1])))
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
    figs.append(self.figure(
        U.fig_sigma2_by_level(sl, names, np.array(order['pairwise'])),
        'sigma2_by_level.png', 3))
    return names

  def _view_tests(self, params, data, img, views, metrics, details
                  ) -> dict[str, dict]:
    """Inclusion of originals in partial views (Fig. 8), and whether a
    restyled image looks more certain than the original."""
    eps = float(self.cfg.inclusion_eps)
    n_img = int(self.cfg.num_inclusion_images) or len(data.images)
    sub = np.arange(min(n_img, len(data.images)))
    orig = (img[0][sub], img[1][sub])
    orig_s2 = U.sigma2(img[1])[sub]
    tests = {}
    for kind, v, name in views:
      if kind == 'drop':
        view = self.images(params, data.images[sub], keep_ratio=v,
                           desc=f'images, {name}')
      else:
        view = self.images(params, U.occlude_center(data.images[sub], v),
                           desc=f'images, {name}')
      tests[f'image, {name}'] = U.inclusion_test(orig, view, eps)
    # A change of drawing style (blur, line weight, hue) keeps what is
    # drawn: the restyled image should not look *more* certain.
    style_details = {}
    for spec in self.cfg.style_views:
      styled = U.sigma2(self.images(params, U.restyle(data.images[sub], spec),
                                    desc=f'images, {spec}')[1])
      not_more_certain = float((styled >= orig_s2).mean())
      key = spec.replace(':', '_')  # 'blur_1.5': a valid TensorBoard tag
      metrics[f'style_not_more_certain/{key}'] = not_more_certain
      style_details[spec] = {
          'not_more_certain': not_more_certain,
          'median_log_ratio': float(np.median(np.log(styled / orig_s2)))}
    if style_details:
      details['style'] = style_details
    return tests

  def _text_tests(self, params, data, texts, txt, names, metrics
                  ) -> dict[str, dict]:
    """The text hierarchy as inclusion (4.4: each caption inside the more
    general caption one level up) and captions inside masked copies."""
    eps = float(self.cfg.inclusion_eps)
    levels = tuple(self.cfg.levels)
    tests = {}
    if levels:
      row = {c: i for i, c in enumerate(texts)}
      chain = []
      for a, b in zip(levels[:-1], levels[1:]):
        gen = np.array([row[caps[a]] for caps in data.captions])
        spec = np.array([row[caps[b]] for caps in data.captions])
        t = U.inclusion_test((txt[0][spec], txt[1][spec]),
                             (txt[0][gen], txt[1][gen]), eps)
        tests[f'text, {names[levels.index(b)]} in '
              f'{names[levels.index(a)]}'] = t
        chain.append(t['h'] > 0)
      metrics['inclusion_positive/text_hierarchy_chain'] = float(
          np.logical_and.reduce(chain).mean())
    prob = float(self.cfg.text_mask_prob)
    if prob > 0:
      tok = self.encoders.tokenizer
      masked = U.mask_tokens(tok(texts), prob, tok.mask_id, tok.pad_id,
                             seed=self.seed,
                             eos_id=getattr(tok, 'eos_id', None))
      view = self.tokens(params, masked, 'masked captions')
      tests[f'text, {prob:.0%} tokens masked'] = U.inclusion_test(txt, view,
                                                                   eps)
    return tests

  def _extremes(self, data, img, texts, txt, details) -> str:
    """The most and least uncertain samples (Fig. 4) and, with labels,
    sigma_v^2 by class (C.8); returns the figure's path."""
    k = int(self.cfg.num_examples)
    s_img, s_txt = U.sigma2(img[1]), U.sigma2(txt[1])
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
    if data.labels is not None:
      details['sigma2_img_by_class'] = {
          n: float(s_img[data.labels == c].mean())
          for c, n in enumerate(data.class_names)
          if (data.labels == c).any()}
    return self.figure(U.fig_extreme_images(data.images, s_img, most_i,
                                            least_i),
                       'uncertain_images.png',
                       2 * max(len(most_i), len(least_i)))
