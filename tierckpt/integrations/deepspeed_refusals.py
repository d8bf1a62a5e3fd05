"""The DeepSpeed setups :func:`tierckpt.integrations.deepspeed.attach` refuses, each named with what to do.

Each is a setup whose checkpoint this integration would not store or restore faithfully: files of
their own (pipeline stages, MoE experts), state outside the state dicts DeepSpeed hands its
checkpoint engine (offload swap buffers), or a load that reads every rank's files itself.
"""

from __future__ import annotations

from typing import Any

from tierckpt.errors import ConfigError

__all__ = ["refuse_unsupported"]


def refuse_unsupported(engine: Any) -> None:
    """Raise :class:`ConfigError` for a DeepSpeed setup whose checkpoints this integration does not
    store or restore faithfully, naming the setting and what to do."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    def refused(setting: str, why: str) -> ConfigError:
        return ConfigError(f"tierckpt.integrations.deepspeed does not support {setting}: {why}")

    if not hasattr(engine, "_commit_decoupled_checkpoint"):
        import deepspeed

        raise ConfigError(f"tierckpt.integrations.deepspeed needs DeepSpeed 0.19 or newer (its decoupled checkpoint commit); this is {deepspeed.__version__}: pip install 'deepspeed>=0.19'")
    if isinstance(engine, PipelineEngine):
        raise refused("pipeline parallelism (a PipelineModule)", "its layers save files of their own; use DeepSpeed's own checkpoint engine for it")
    if getattr(engine, "has_moe_layers", False):
        raise refused("MoE layers", "their expert files are saved per expert-parallel rank; use DeepSpeed's own checkpoint engine for them")
    stage = engine.zero_optimization_stage()
    if not stage:
        raise refused('"zero_optimization": {"stage": 0}', "set zero_optimization.stage to 1, 2 or 3")
    offload = engine.zero_offload_optimizer()
    if offload is not None and str(getattr(offload.device, "value", offload.device)) != "none":
        raise refused(f'"zero_optimization.offload_optimizer.device": "{getattr(offload.device, "value", offload.device)}"',
                      "its optimizer state lives in host or NVMe swap buffers; remove offload_optimizer")
    param = engine.zero_offload_param()
    if param is not None and str(getattr(param.device, "value", param.device)) != "none":
        raise refused(f'"zero_optimization.offload_param.device": "{getattr(param.device, "value", param.device)}"', "remove offload_param")
    if engine.zero_elastic_checkpoint():
        raise refused('"zero_optimization.elastic_checkpoint": true', "every rank would read every rank's files; set it to false")
    if engine.use_node_local_storage():
        raise refused('"checkpoint.use_node_local_storage": true', "save_dir must be one directory every rank sees (a node's own disk is a tier: "
                      "scope: node in the tier config); set it to false")
    if engine.load_universal_checkpoint():
        raise refused('"checkpoint.load_universal": true', "tierckpt restores its own steps; set it to false")
    if getattr(engine, "mp_world_size", 1) > 1:
        raise refused(f"model (tensor) parallelism ({engine.mp_world_size} model-parallel ranks)", "use data parallelism with ZeRO only")
    if getattr(engine, "sequence_parallel_size", 1) > 1:
        raise refused(f"sequence parallelism ({engine.sequence_parallel_size} ranks)", "use data parallelism with ZeRO only")
