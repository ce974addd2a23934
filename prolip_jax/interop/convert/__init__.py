"""Parameters <-> PyTorch state dicts (the ProLIP release / open_clip layout)
and config.json, for export, import and Hugging Face snapshots.

Three concerns, one module each; every name is importable from here
(``from prolip_jax.interop import convert``, then
``convert.params_to_state_dict(...)``):

* ``keys``: the key layout, a table of ``Entry``s from state-dict keys to
  the Flax parameter paths they are made of (``state_dict_entries``; the
  full table is in that module's docstring), the text layouts (``text.*``
  keys or open_clip CLIP's top-level ones) and nested-dict paths;
* ``arrays``: the array conversion, transposes, q/k/v fusion, dtype,
  scanned <-> unrolled block stacks, and the two conversions
  ``params_to_state_dict`` / ``state_dict_to_params`` (with its
  ``ConversionReport``);
* ``config_schema``: config.json <-> ``ModelConfig`` (``config_json``,
  ``model_dict_from_json``, ``hub_config``) and the model config's forms
  without JAX (``model_dict``, ``config_namespace``).

Everything is numpy; JAX is imported only by ``state_dict_to_params`` (to
build the parameter template) and ``model_config_from_json``.
"""

from prolip_jax.interop.convert.arrays import ConversionReport
from prolip_jax.interop.convert.arrays import is_scanned
from prolip_jax.interop.convert.arrays import params_to_state_dict
from prolip_jax.interop.convert.arrays import stack_layers
from prolip_jax.interop.convert.arrays import state_dict_to_params
from prolip_jax.interop.convert.arrays import to_layout
from prolip_jax.interop.convert.arrays import to_numpy
from prolip_jax.interop.convert.arrays import unstack_layers
from prolip_jax.interop.convert.config_schema import config_json
from prolip_jax.interop.convert.config_schema import config_namespace
from prolip_jax.interop.convert.config_schema import FORMAT_VERSION
from prolip_jax.interop.convert.config_schema import hub_config
from prolip_jax.interop.convert.config_schema import model_config_from_json
from prolip_jax.interop.convert.config_schema import model_dict
from prolip_jax.interop.convert.config_schema import model_dict_from_json
from prolip_jax.interop.convert.config_schema import PROJECT_KEY
from prolip_jax.interop.convert.config_schema import SIGLIP_HF_TOKENIZER
from prolip_jax.interop.convert.config_schema import UNC_BIAS_INIT
from prolip_jax.interop.convert.keys import CONV
from prolip_jax.interop.convert.keys import default_text_layout
from prolip_jax.interop.convert.keys import detect_text_layout
from prolip_jax.interop.convert.keys import Entry
from prolip_jax.interop.convert.keys import flatten
from prolip_jax.interop.convert.keys import LINEAR
from prolip_jax.interop.convert.keys import num_text_special
from prolip_jax.interop.convert.keys import QKV_BIAS
from prolip_jax.interop.convert.keys import QKV_WEIGHT
from prolip_jax.interop.convert.keys import SAME
from prolip_jax.interop.convert.keys import state_dict_entries
from prolip_jax.interop.convert.keys import state_dict_keys
from prolip_jax.interop.convert.keys import TEXT_LAYOUTS
from prolip_jax.interop.convert.keys import unflatten
