"""Configs: ``keys`` (every key, declared once), ``presets`` (model presets
and the base config), ``help`` (``--print_config``) and ``drift`` (what a
resumed run may change).

Import the modules under names that do not collide with a local ``config``
or the builtin ``help``: ``from prolip_jax.config import keys as
config_keys``, ``from prolip_jax.config import help as config_help``.
"""
