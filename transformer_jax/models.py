"""`transformer_jax.models` as users import it (DESIGN.md's public interface): the module
moved to transformer_jax/model/models.py, and importing this name gives that module itself."""

import sys

from transformer_jax.model import models as _moved

sys.modules[__name__] = _moved
