"""``mixture``: a weighted mixture of the other sources (``data.sources``).

Training (``data.sources`` set; ``data.name`` is then not read):
``{label: dict(name=..., weight=..., <data.* source fields>)}``, each
entry one training source with its own fields (the ones it omits are
``data``'s) and a weight; mixed by ``data/mixture.py``. Each source of a
mixture keeps its own bad-record checking and counts.
"""

from __future__ import annotations

from prolip_jax import errors
from prolip_jax.data import mixture
from prolip_jax.data import sources
from prolip_jax.data.sources import base


def entry_fields() -> tuple[str, ...]:
  """The ``data.*`` fields a ``data.sources`` entry may set for itself
  (besides ``weight``): ``name`` and the keys every other training source
  declares."""
  fields = {'name'}
  for name in sources.names('train'):
    if name != WeightedMixture.name:
      fields.update(sources.get(name).KEYS)
  return ('name', *sorted(fields - {'name'}))


class WeightedMixture(base.Source):
  """The ``mixture.Mixture`` of ``data.sources`` and the corpus of all its
  sources' captions."""

  name = 'mixture'
  KEYS = base.declared('sources')

  def train_records(self, config, data, where):
    entries = mixture.entries(self.value(data, 'sources') or {})
    if not entries:
      raise errors.ConfigError(f'{where}.sources is empty: name the sources '
                               "to mix, e.g. {'a': dict(name='digits', "
                               'weight=1.0)}')
    fields = entry_fields()
    for label, entry in entries:  # every entry checked before any reading
      unknown = sorted(set(entry) - set(fields) - {'weight'})
      if unknown or 'name' not in entry:
        raise errors.ConfigError(
            f'{where}.sources.{label} needs name and weight and may set '
            f'{", ".join(fields[1:])}; got '
            f'{", ".join(unknown) if unknown else "no name"}')
      if entry['name'] == self.name:
        raise errors.ConfigError(f'{where}.sources.{label}.name: a mixture '
                                 'holds sources, not another mixture')
    labels = [label for label, _ in entries]
    weights = [entry.get('weight') for _, entry in entries]
    mixture.check_weights(labels, weights)
    whole = data.to_dict() if hasattr(data, 'to_dict') else dict(data)
    records, corpora = [], []
    for label, entry in entries:
      own = {k: v for k, v in entry.items() if k != 'weight'}
      source, corpus = sources.train_records(
          config, {**whole, **own}, f'{where}.sources.{label}')
      records.append(source)
      corpora.append(corpus)
    return (mixture.Mixture(tuple(labels), tuple(records), tuple(weights)),
            lambda: [line for corpus in corpora for line in corpus()])
