"""Tardigrade inside the frameworks people train with, through each one's extension points.

* :mod:`tardigrade.integrations.lightning`: a ``CheckpointIO`` plugin and a callback;
* :mod:`tardigrade.integrations.transformers`: a ``TrainerCallback`` for ``transformers.Trainer``;
* :mod:`tardigrade.integrations.accelerate`: ``Accelerator.save_state`` / ``load_state`` hooks.

Each module imports its framework when imported itself (install ``tardigrade-ckpt[lightning]``,
``tardigrade-ckpt[transformers]`` or ``tardigrade-ckpt[accelerate]``); ``import tardigrade``
imports none.
"""
