"""CI: `pip install -e .` into an environment that already has a JAX stack
changes none of it. Reads pip's --dry-run --report JSON.

  python .ci/beside_jax.py REPORT.json
"""

import json
import sys

STACK = {'jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'numpy',
         'ml-dtypes', 'tensorstore', 'jax-cuda12-plugin', 'jax-cuda13-plugin'}

with open(sys.argv[1], encoding='utf-8') as f:
  report = json.load(f)
changed = sorted(f"{i['metadata']['name']}=={i['metadata']['version']}"
                 for i in report['install']
                 if i['metadata']['name'].lower().replace('_', '-') in STACK)
if changed:
  print(f'error: installing the project would change the JAX stack: {changed}')
  sys.exit(1)
print('installing the project beside the existing JAX stack changes none of it')
