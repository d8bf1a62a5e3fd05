"""DeepSpeed ZeRO: ``attach(engine, "tiers.yaml")`` after ``deepspeed.initialize`` is all a user adds.

DeepSpeed builds its checkpoint's state dicts itself and hands each file's to a pluggable
``CheckpointEngine`` (``engine.checkpoint_engine``): ``create(tag)``, ``save(state_dict, path)`` per
file, then ``commit(tag)``. :class:`TierckptCheckpointEngine` is that engine:

- **Save.** ``engine.save_checkpoint(save_dir)`` runs DeepSpeed's own code, which hands this engine
  each file's state dict (the live tensors: ZeRO's flat fp32 partitions and Adam moments are views,
  not copies); when it returns, they are saved as one tierckpt step (``engine.global_steps``), every
  file under its name, and the call returns without waiting for the host copy. A *decoupled* engine
  is committed by DeepSpeed in the next ``engine.step()`` at the gradient-accumulation boundary,
  right before the optimizer's update: there, :meth:`~TierckptCheckpointEngine.commit` waits until
  the copy is done (the lazy barrier); the forward of modules that hold persistent buffers waits too
  (:meth:`~tierckpt.Checkpointer.attach`). So the next step's forward and backward run beside the copy.
- **Every rank holds the model states.** Under ZeRO-1/2 DeepSpeed writes ``mp_rank_00_model_states.pt``
  on data-parallel rank 0 only, and every rank reads it on load. Here every rank saves it (``attach``
  sets ``engine.save_non_zero_checkpoint``), the parameters stored once between the ranks
  (``replicated=``: ZeRO-1/2 keeps them the same on every rank), the rest per rank, so each rank
  restores its own: ``client_state`` comes back to each rank as that rank gave it.
- **On disk under save_dir** (:mod:`tierckpt.integrations.deepspeed_tags`): once the step is durable
  on every rank, ``save_dir/<tag>/`` gets a pointer at each file name DeepSpeed saved, then
  ``save_dir/latest`` names the tag (DeepSpeed's own ``latest``, written atomically; this engine
  tells DeepSpeed not to write it). DeepSpeed's ``zero_to_fp32.py`` copy is written as usual and
  cannot read pointers.
- **Load.** ``engine.load_checkpoint(save_dir)`` restores the newest step the tiers can restore
  (falling back, with a warning, past a damaged one), then runs DeepSpeed's own load of its tag,
  this engine handing back each file's state dict from the restored step. ``tag=`` loads that tag's
  step or raises naming it. Non-tensor values come back without pickle
  (:mod:`tierckpt.integrations.deepspeed_values`).
- **Durable at the end.** ``engine.destroy()`` (and, failing that, the interpreter's exit) waits
  until every save is durable and its pointers written, then closes the Checkpointer.

Refused with a :class:`~tierckpt.errors.ConfigError` at ``attach`` (:mod:`~tierckpt.integrations.deepspeed_refusals`): ZeRO stage 0, optimizer or
parameter offload (CPU, NVMe), pipeline parallelism, MoE, model (tensor) and sequence parallelism,
``elastic_checkpoint``, node-local checkpoint storage, and universal-checkpoint loading.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import logging
import os
import threading
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from tierckpt.checkpointer import Checkpointer
from tierckpt.config import Config
from tierckpt.errors import ConfigError, CorruptCheckpointError, NoCheckpointError, UnsupportedStateError
from tierckpt.integrations.deepspeed_refusals import refuse_unsupported
from tierckpt.integrations.deepspeed_tags import LATEST, check_tag, every_rank_names, latest, publish, refuse_unknown_latest, tag_step, tags, written
from tierckpt.integrations.deepspeed_values import from_plain, to_plain
from tierckpt.integrations.pointer import restore_named
from tierckpt.integrations.saves import DurableSaves
from tierckpt.restore import Restored

__all__ = ["TierckptCheckpointEngine", "attach"]

log = logging.getLogger("tierckpt")

WHO = "tierckpt.integrations.deepspeed"
NO_PICKLE_HINT = (
    "tierckpt stores checkpoints without pickle: pass save_checkpoint(client_state=...) values that are numbers, "
    "strings, lists, tuples, dicts or tensors"
)


def attach(engine: Any, config: Config | dict[str, Any] | str | os.PathLike[str]) -> TierckptCheckpointEngine:
    """Checkpoint ``engine`` (what ``deepspeed.initialize`` returned) through tierckpt's tiers: its
    ``save_checkpoint`` and ``load_checkpoint`` keep their signatures and go through the tiers. Call it
    on every rank, at the same point (it opens the Checkpointer: collective), before the first save or load.

    ``config``: a tier config (a YAML path, a dict or a :class:`~tierckpt.config.Config`).

    Returns the engine set as ``engine.checkpoint_engine``.

    Raises:
        ConfigError: a bad tier config, or a DeepSpeed setting this integration does not support
            (names the setting and what to do instead).

    Example::

        engine, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config)
        attach(engine, "tiers.yaml")
        engine.load_checkpoint("ckpts")          # the newest durable tag, if any
        ...
        engine.save_checkpoint("ckpts")          # returns at once; durable in the background
    """
    from deepspeed.runtime.engine import DeepSpeedEngine

    if not isinstance(engine, DeepSpeedEngine):
        raise ConfigError(f"attach() takes the engine deepspeed.initialize returned (a DeepSpeedEngine), not a {type(engine).__name__}: "
                          "engine, optimizer, _, _ = deepspeed.initialize(...); attach(engine, config)")
    coerced = Config.coerce(config)
    refuse_unsupported(engine)
    if isinstance(getattr(engine, "checkpoint_engine", None), TierckptCheckpointEngine):
        raise ConfigError("this DeepSpeed engine is attached to tierckpt already: call attach() once per engine")
    ours = TierckptCheckpointEngine(engine, coerced)
    engine.checkpoint_engine = ours
    # Every rank saves the model states (DeepSpeed: data-parallel rank 0 only), so each restores its own.
    engine.save_non_zero_checkpoint = True
    engine.save_checkpoint = ours.wrap_save(engine.save_checkpoint)
    engine.load_checkpoint = ours.wrap_load(engine.load_checkpoint)
    ours.checkpointer  # opened now, on every rank at once (collective), not at a first save some rank skips
    _at_exit(functools.partial(_close_at_exit, weakref.ref(ours)))
    return ours


def _at_exit(hook: Callable[[], None]) -> None:
    """Run ``hook`` at interpreter exit before the Checkpointer's own exit hook (it closes the
    Checkpointer, and the pointers of the last saves are written before that): in threading's exit
    hooks, which run newest first and before ``atexit``, where it has them (tierckpt.runtime registers there)."""
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(hook)
            return
    except RuntimeError:  # already shutting down
        return
    atexit.register(hook)


def _close_at_exit(ref: weakref.ref[TierckptCheckpointEngine]) -> None:
    ours = ref()
    if ours is None:
        return
    try:
        ours.cleanup()
    except Exception as exc:  # at interpreter exit there is nobody left to raise to
        log.error("tierckpt: DeepSpeed: closing at exit failed: %s", exc)


class TierckptCheckpointEngine(CheckpointEngine):
    """DeepSpeed's checkpoint engine through tierckpt (see the module docstring); made by :func:`attach`."""

    def __init__(self, engine: Any, config: Config) -> None:
        super().__init__(config_params=None)
        self.name = "tierckpt"
        self._engine = engine
        self._saves = DurableSaves(config, WHO)
        self._saving = False  # inside save_checkpoint (not save_16bit_model, which saves through this engine too)
        self._info: CheckpointCommitInfo | None = None  # the save being made (create() to save_checkpoint's return)
        self._files: dict[str, Any] = {}  # its files' state dicts, by file name
        self._commit: CheckpointCommitInfo | None = None  # a stored save whose copy the next update waits for
        self._loading: dict[str, Any] | None = None  # during load_checkpoint: the restored step's files
        self._decoded: dict[str, Any] = {}
        self._resharded: tuple[Any, Any] | None = None  # resharding: the model states and this rank's optimizer file to serve

    @property
    def checkpointer(self) -> Checkpointer:
        """The Checkpointer every save and load goes through."""
        return self._saves.checkpointer

    # -- DeepSpeed's CheckpointEngine ----------------------------------------------------------------

    def create(self, info: CheckpointCommitInfo) -> None:
        if self._saving:  # save_checkpoint's; save_16bit_model's goes to DeepSpeed's own engine (save())
            check_tag(info.tag)
            self._info, self._files = info, {}

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        # The tag's directory is made once its step is durable (deepspeed_tags.publish), not now: until
        # then it would name a checkpoint that is not there.
        info = self._info
        if self._saving and info is not None and os.path.abspath(path) == os.path.abspath(os.path.join(info.save_dir, info.tag)):
            return
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        if not self._saving or self._info is None:
            # Not a training checkpoint: save_16bit_model's weights file, for inference, written as
            # DeepSpeed's own engine writes it (torch.save), where the caller put it.
            from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

            TorchCheckpointEngine().save(state_dict, path)
            return
        self._files[os.path.basename(path)] = state_dict

    def load(self, path: str, map_location: Any = None) -> Any:
        if self._loading is None:
            raise RuntimeError(f"{WHO}: DeepSpeed loaded {path} outside load_checkpoint(); only load_checkpoint goes through tierckpt")
        name = os.path.basename(path)
        if self._resharded is not None:  # every rank asks for its own names, saved or not: serve by kind
            state = self._resharded[0] if name.endswith("model_states.pt") else self._resharded[1]
        elif name not in self._decoded:
            files, kinds = self._loading["files"], self._loading["kinds"]
            if name not in files:
                raise NoCheckpointError(f"{path}: the step restored for this tag holds no such file (it holds {', '.join(sorted(files))})")
            self._decoded[name] = state = from_plain(files[name], kinds.get(name, []))
        else:
            state = self._decoded[name]
        if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type != "cpu":
            return _to(state, torch.device(map_location))
        return state

    def commit(self, info: CheckpointCommitInfo) -> bool:
        # DeepSpeed calls it in engine.step(), right before the optimizer's update: the lazy barrier.
        self._saves.wait_captured()
        self._commit = None
        return True

    def is_decoupled(self) -> bool:
        return True  # committed in the next step, not in save_checkpoint

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        return self._commit

    def cleanup(self) -> None:
        """Wait until every save is durable and its pointers written; close the Checkpointer (DeepSpeed
        calls it from ``engine.destroy()``)."""
        self._saves.close()

    def preserves_storage_sharing(self) -> bool:
        return True  # the tensors are stored by their values: no clone before save

    # -- save_checkpoint and load_checkpoint ---------------------------------------------------------

    def wrap_save(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """DeepSpeed's ``save_checkpoint``, then the files it handed over saved as one step."""

        @functools.wraps(original)
        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            self._saving = True
            try:
                result = original(*args, **kwargs)
            finally:
                self._saving = False
                info, files = self._info, self._files
                self._info, self._files = None, {}
            if info is not None:
                self._store(info, files)
            return result

        return save_checkpoint

    def wrap_load(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """DeepSpeed's ``load_checkpoint``, its files served from the step restored for the tag."""

        signature = inspect.signature(original)

        @functools.wraps(original)
        def load_checkpoint(load_dir: Any, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
            save_dir = Path(os.path.abspath(os.fspath(load_dir)))  # as saves key their tags
            bound = signature.bind_partial(load_dir, tag, *args, **kwargs).arguments
            if self._engine.zero_optimization_stage() >= 3 and not bound.get("load_optimizer_states", True):
                # DeepSpeed then gathers the weights from the files with its zero_to_fp32 code (torch.load), not through this engine.
                raise ConfigError("tierckpt.integrations.deepspeed under ZeRO-3 loads with load_optimizer_states=True (the default) only: "
                                  "without it DeepSpeed reads the weights from the files with torch.load, which hold pointers")
            found = self._restore_newest(save_dir) if tag is None else (str(tag), self._restore_tag(save_dir, str(tag)))
            if found is None:
                refuse_unknown_latest(save_dir)
                log.warning("tierckpt: DeepSpeed load_checkpoint(%s): no checkpoint to resume from; starting from the initial state", save_dir)
                return None, None
            chosen, restored = found
            if not written(save_dir, chosen) and restored.tier in self._saves.durable_tiers:
                self._publish(save_dir, chosen, restored)  # durable, but a crash came before its pointers were written
            self._loading, self._decoded = restored.state, {}
            saved_world = int(_meta(restored).get("dp_world_size", self._engine.dp_world_size))
            try:
                if saved_world == self._engine.dp_world_size:
                    return original(os.fspath(load_dir), chosen, *args, **kwargs)
                return self._load_resharded(original, save_dir, chosen, restored, saved_world, *args, **kwargs)
            finally:
                self._loading, self._decoded, self._resharded = None, {}, None

        return load_checkpoint

    def _store(self, info: CheckpointCommitInfo, files: dict[str, Any]) -> None:
        engine = self._engine
        step = int(engine.global_steps)
        save_dir = Path(os.path.abspath(info.save_dir))
        plain: dict[str, Any] = {}
        kinds: dict[str, Any] = {}
        for name, state_dict in files.items():
            plain[name], kinds[name] = to_plain(state_dict)
        meta = {"tag": info.tag, "save_dir": str(save_dir), "save_latest": bool(info.save_latest), "files": sorted(files),
                "dp_world_size": int(engine.dp_world_size), "zero_stage": int(engine.zero_optimization_stage())}
        world = self.checkpointer.world_size
        names = every_rank_names(sorted(files), world)

        def then(tier: str) -> None:  # rank 0, once the step is committed on every rank
            publish(save_dir, info.tag, step, tier, names, latest=info.save_latest)

        self._saves.guard(engine.module)  # the forward of modules with saved buffers waits for the copy
        try:
            saved = self._saves.save(str(save_dir / info.tag), step, {"files": plain, "kinds": kinds}, then,
                                     metadata={"deepspeed": meta}, replicated=self._replicated(plain), lazy=True)
        except UnsupportedStateError as exc:
            raise UnsupportedStateError(f"{exc}. {NO_PICKLE_HINT}", key=exc.key) from exc
        if saved:
            # DeepSpeed writes save_dir/latest after a commit with save_latest: tierckpt writes it, once durable.
            self._commit = CheckpointCommitInfo(tag=info.tag, save_dir=info.save_dir, save_latest=False)
        else:
            log.warning("tierckpt: DeepSpeed checkpoint %s (step %d) was skipped: the host memory was full (host.on_full)", info.tag, step)

    def _replicated(self, files: dict[str, Any]) -> list[tuple[str, ...]]:
        """The key paths of values the same on every rank: under ZeRO-1/2 the parameters in the model
        states (all-gathered after every update); not the buffers, which DeepSpeed does not keep alike."""
        if self._engine.zero_optimization_stage() >= 3 or self.checkpointer.world_size <= 1:
            return []
        params = {name for name, _ in self._engine.module.named_parameters()}
        paths: list[tuple[str, ...]] = []
        for name, state_dict in files.items():
            module = state_dict.get("module") if name.endswith("model_states.pt") and isinstance(state_dict, dict) else None
            if isinstance(module, dict):
                paths.extend(("files", name, "module", key) for key, value in module.items() if key in params and isinstance(value, torch.Tensor))
        return paths

    def _load_resharded(self, original: Callable[..., Any], save_dir: Path, tag: str, restored: Restored, saved_world: int,
                        *args: Any, **kwargs: Any) -> Any:
        """DeepSpeed's load of ``tag`` saved by ``saved_world`` data-parallel ranks, into this engine's
        layout (:mod:`tierckpt.integrations.deepspeed_reshard`): the saved ranks' optimizer files it
        needs are read from a filesystem tier, this rank's new one cut from them, and DeepSpeed loads that."""
        from tierckpt.export.part import read_part
        from tierckpt.integrations.deepspeed_reshard import resharded

        engine = self._engine
        files, kinds = restored.state["files"], restored.state["kinds"]
        model_name = next((n for n in sorted(files) if n.endswith("model_states.pt")), None)
        if model_name is None:
            raise CorruptCheckpointError(f"tag {tag!r} (step {restored.step}) holds no DeepSpeed model states", step=restored.step)
        version = self._version_dir(restored)

        def optimizer_file(rank: int) -> Any:
            part = read_part(version, rank, keep=lambda key: "optim_states.pt'" in key)
            name = next((n for n in part["files"] if "optim_states" in n), None)
            if name is None:
                raise CorruptCheckpointError(f"{version}: rank {rank}'s part holds no DeepSpeed optimizer file", step=restored.step)
            return from_plain(part["files"][name], part["kinds"].get(name, []))

        model_states = from_plain(files[model_name], kinds.get(model_name, []))
        read: dict[int, Any] = {}  # each saved rank's optimizer file, read once, only if needed
        self._resharded = resharded(engine, model_states, lambda q: read[q] if q in read else read.setdefault(q, optimizer_file(q)), saved_world)
        log.info("tierckpt: DeepSpeed: resharding read the optimizer files of saved rank(s) %s", sorted(read))
        log.info("tierckpt: DeepSpeed tag %r (step %d) saved by %d data-parallel ranks, resharded onto %d", tag, restored.step, saved_world, engine.dp_world_size)
        # DeepSpeed globs this rank's model-states file, which a rank the saving job did not have has
        # no pointer for: for this load, it finds the one the saved rank this rank restored has.
        engine._get_all_ckpt_names = lambda path, tag_: [os.path.join(path, str(tag_), model_name)]
        try:
            return original(os.fspath(save_dir), tag, *args, **kwargs)
        finally:
            del engine._get_all_ckpt_names

    def _version_dir(self, restored: Restored) -> Path:
        """A filesystem tier's directory of the restored step, which resharding reads every rank's part from."""
        held = [v for v in self.checkpointer.versions() if v.step == restored.step and v.path is not None and v.valid and not v.abandoned]
        held.sort(key=lambda v: v.tier != restored.tier)
        if not held:
            raise NoCheckpointError(
                f"step {restored.step} was saved by another number of data-parallel ranks: resharding it reads every rank's part "
                "from a filesystem tier, and none holds it", step=restored.step)
        return Path(held[0].path)  # type: ignore[arg-type]

    def _restore_tag(self, save_dir: Path, tag: str) -> Restored:
        """The step of ``tag`` (saved by this process, its pointers written or not yet, or named by its pointers).

        Raises:
            NoCheckpointError, CorruptCheckpointError: no such tag, or its step cannot be restored; names the tag.
        """
        check_tag(tag)
        step = self._saves.saved_step(str(save_dir / tag))
        if step is None:
            try:
                step = tag_step(save_dir, tag)
            except NoCheckpointError as exc:
                held = tags(save_dir)
                raise NoCheckpointError(f"{exc}; {save_dir} holds tag(s) {', '.join(held)}" if held else f"{exc}; {save_dir} holds no tag") from None
        return restore_named(self.checkpointer, save_dir / tag, step, instead="pass load_checkpoint(tag=) another tag")

    def _restore_newest(self, save_dir: Path) -> tuple[str, Restored] | None:
        """The newest step the tiers can restore, saved with ``save_latest``, and its tag; None when there is none."""
        ckpt = self.checkpointer
        restored = ckpt.restore_latest_sync()
        if restored is None:
            return None
        if not _meta(restored).get("save_latest", True):  # saved with save_latest=False: not what latest names
            older = sorted({(v.serial, v.step) for v in ckpt.versions() if v.valid and not v.abandoned and v.step != restored.step}, reverse=True)
            for _, step in older:
                try:
                    candidate = ckpt.restore_sync(step)
                except (CorruptCheckpointError, NoCheckpointError) as exc:
                    log.warning("tierckpt: DeepSpeed: step %d cannot be restored (%s); trying the one before", step, exc)
                    continue
                if _meta(candidate).get("save_latest", True):
                    restored = candidate
                    break
            else:
                return None
        tag = _meta(restored).get("tag")
        if not isinstance(tag, str):
            raise CorruptCheckpointError(f"step {restored.step} on tier {restored.tier!r} was not saved by tierckpt.integrations.deepspeed (its metadata names no tag)", step=restored.step)
        named = latest(save_dir)
        if named is not None and named != tag:
            log.warning("tierckpt: DeepSpeed: %s names tag %r, but the newest tag the tiers can restore is %r (step %d): loading %r",
                        save_dir / LATEST, named, tag, restored.step, tag)
        return tag, restored

    def _publish(self, save_dir: Path, tag: str, restored: Restored) -> None:
        """Write ``tag``'s pointers (and ``latest``, for a save that asked for it) from a restored step,
        on every rank at once: its own glob must find them, and each file is written atomically."""
        meta = _meta(restored)
        names = every_rank_names(meta.get("files", sorted(restored.state["files"])), int(meta.get("dp_world_size", 1)))
        publish(save_dir, tag, restored.step, restored.tier, names, latest=bool(meta.get("save_latest", True)))


def _meta(restored: Restored) -> dict[str, Any]:
    meta = restored.metadata.get("deepspeed")
    return meta if isinstance(meta, dict) else {}


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return type(value)((k, _to(v, device)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to(v, device) for v in value)
    return value
