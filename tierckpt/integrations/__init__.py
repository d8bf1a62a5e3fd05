"""Adapters that put tierckpt behind the checkpoint seams of training frameworks.

One module per framework, each importing that framework: ``import tierckpt`` imports none of them.

- :mod:`tierckpt.integrations.lightning`: ``Trainer(plugins=[TierckptCheckpointIO("tiers.yaml")])``.
"""
