"""Example turnforge env plugin: two envs written against the public contract only
(``turnforge.Env``: ``reset(task, seed)`` and ``step(action)``), registered through the
``turnforge.envs`` entry-point group of this package's ``pyproject.toml``."""
