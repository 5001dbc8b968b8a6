"""The application layer: a config turned into a run.

- ``config``: a recipe and ``key=value`` overrides loaded into the typed schema, every variant name
  checked against its registry and every cross-key rule (``rules``) run, before any work;
- ``setup``: the checks that need the env and the model, the run directory, the policy, the engine;
- ``run``: the run's story top to bottom (``train``): BC -> evaluations -> flywheel -> RL -> evaluation;
- ``launch``, ``ray_ranks``: the launchers of a run on several trainer ranks (torchrun, Ray);
- ``reference``: every key of the config, as ``turnforge keys`` prints it.

    from turnforge.app.config import load_config
    from turnforge.app.run import train
    train(load_config("sokoban-tiny", ["rl.iterations=10"]), "runs/x")
"""
