"""``uncertainty``: sigma^2 of a captioned set's images and captions."""

from __future__ import annotations

from typing import Any

from prolip_jax.evaluation import evaluator
from prolip_jax.evaluation import report
from prolip_jax.evaluation import sets
from prolip_jax.evaluation import uncertainty as U


class Evaluator(evaluator.Evaluator):
  """sigma^2 per dimension of images and captions (named as training's
  held-out evaluation names them), the fraction of captions more uncertain
  than their image, and Spearman(caption length in tokens, sigma^2)."""

  OPTIONS = {'images_dir': '', 'caption_key': ''}
  # Named as training's held-out evaluation names them.
  LABELS = (
      report.Label(r'sigma2_img', 'mean sigma^2 per dimension, images',
                   report.number),
      report.Label(r'sigma2_captions', 'mean sigma^2 per dimension, captions',
                   report.number),
      report.Label(r'txt_more_uncertain_than_img',
                   'caption sigma^2 > its image sigma^2', report.pct),
      report.Label(r'spearman_length_sigma2',
                   'Spearman(caption length, sigma^2)', report.signed))

  def evaluate(self, params: Any) -> evaluator.Result:
    if not self.encoders.probabilistic:
      raise evaluator.SkipEvaluator('the model has no [UNC] (sigma^2)')
    rs = self.opened(sets.retrieval_set)
    emb = self.embed_images(params, rs.images)
    tokenizer = self.encoders.tokenizer
    tokens = tokenizer(rs.captions)
    _, t_lv = self.encoders.embed_tokens(params, tokens, self.batch_size)
    s_img, s_txt = U.sigma2(emb.logvar), U.sigma2(t_lv)
    dim = emb.logvar.shape[-1]
    lengths = U.num_tokens(tokens, tokenizer.pad_id)
    metrics = {'sigma2_img': float(s_img.mean() / dim),
               'sigma2_captions': float(s_txt.mean() / dim),
               'txt_more_uncertain_than_img': float(
                   (s_txt > s_img[rs.image_of_text]).mean()),
               'spearman_length_sigma2': U.spearman(lengths, s_txt)}
    details = {'sigma2_img_trace': U.summary_stats(s_img),
               'sigma2_captions_trace': U.summary_stats(s_txt)}
    return evaluator.Result(metrics, details)
