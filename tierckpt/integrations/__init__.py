"""Adapters that put tierckpt behind the checkpoint seams of training frameworks.

One module per framework, each importing that framework: ``import tierckpt`` imports none of them.

- :mod:`tierckpt.integrations.lightning`: ``Trainer(plugins=[TierckptCheckpointIO("tiers.yaml")])``;
- :mod:`tierckpt.integrations.huggingface`: ``TierckptTrainer(..., tierckpt="tiers.yaml")`` in place of
  ``transformers.Trainer`` (or :class:`TierckptMixin` before a Trainer subclass);
- :mod:`tierckpt.integrations.torchtitan`: ``TierckptCheckpointManager.Config(...)`` as the trainer's
  ``checkpoint`` config;
- :mod:`tierckpt.integrations.deepspeed`: ``attach(engine, "tiers.yaml")`` after ``deepspeed.initialize``
  (DeepSpeed ZeRO's checkpoint engine);
- :mod:`tierckpt.integrations.saves`: what both share: one Checkpointer, and each checkpoint's path
  written once its step is durable; :mod:`tierckpt.integrations.pointer`: the file at that path.
"""
