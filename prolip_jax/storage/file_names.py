"""The file names of an export / Hugging Face snapshot and of a workdir's
tokenizer, declared once.

An export (``tools/export_pytorch.py``) and a release snapshot on the Hub
share the first three; a workdir keeps its tokenizer as ``TOKENIZER_MODEL``
(whatever its kind) and an export copies it under that name, or as
``TOKENIZER_JSON`` for a tokenizer.json. Imports nothing, so every layer
(data, checkpoint, convert, hub, load, torch_reference, tools) may read
it.
"""

CONFIG_FILE = 'config.json'  # the release schema, see convert.config_json
WEIGHTS_FILE = 'model.safetensors'  # the release / open_clip state dict
# This project's metadata beside config.json (``--hub_compatible`` exports:
# the release's ProLIPHF would choke on it inside config.json).
PROJECT_FILE = 'prolip_jax.json'

# A sentencepiece model; also a workdir's tokenizer file, of either kind.
TOKENIZER_MODEL = 'tokenizer.model'
TOKENIZER_JSON = 'tokenizer.json'  # Hugging Face ``tokenizers``
SPIECE_MODEL = 'spiece.model'  # sentencepiece, in transformers' T5 repos
# Beside a tokenizer.json: they name its special tokens (transformers).
TOKENIZER_SIDE_FILES = ('tokenizer_config.json', 'special_tokens_map.json')
# The tokenizer files a snapshot may hold, in the order they are looked for.
TOKENIZER_FILES = (TOKENIZER_JSON, TOKENIZER_MODEL, SPIECE_MODEL)
