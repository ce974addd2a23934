"""Evaluation: one evaluator protocol, one way to embed, the metrics.

Modules (each importable on its own; this package imports none of them, so
``prolip_jax.interop.load`` can use ``metrics`` and ``prompts`` without
pulling in the rest). Evaluation imports neither the training loop nor
the model loader: training builds its evaluators from the objective
(``training/loop_evals.py``), ``prolip_jax/evaluate.py`` (the command) from
a loaded model.

* ``evaluator``: the protocol (``Evaluator(encoders, name, **cfg).run(params)
  -> Result``), the checks of ``config.evals`` entries and the registry:
  each kind is one module of ``kinds/`` (zero_shot, retrieval, uncertainty,
  heldout, uncertainty_report, bprw, traversal, filtering).
* ``encoders``: the one way to embed: a model's encoders on every device
  and host, the parameters passed at each call.
* ``sets``: the data an entry names (``tfds:``, ``folder:``, ``jsonl:``,
  ``array_record:``, the bundled ``digits`` / ``emoji``), each a source of
  ``prolip_jax/data/sources/`` (the registry training reads too) asked for
  its view (the bundled sets are held in memory: ``EvalData``);
  ``in_memory``: the base of the kinds that score those.
* ``metrics``: pure scores over embeddings (CSD / cosine zero-shot, top-k,
  retrieval recall); ``prompts``: the one prompt ensemble;
  ``uncertainty``: sigma^2 statistics, partial views and the figures of
  paper 4.3.
* ``runner``: what ``python -m prolip_jax.evaluate`` runs (``cli``: its
  flags); ``report``: every printed report (one set of units; each kind's labels
  are declared beside it, ``Evaluator.LABELS``).
"""
