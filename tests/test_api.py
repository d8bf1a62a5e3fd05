"""The public surface: names are a contract (ARCHITECTURE §5)."""

from __future__ import annotations

import inspect

import tierckpt
import tierckpt.errors
from tierckpt import Checkpointer, SaveHandle


def test_all_is_pinned() -> None:
    assert sorted(tierckpt.__all__) == [
        "CapacityError",
        "Checkpointer",
        "Config",
        "ConfigError",
        "CorruptCheckpointError",
        "FlushError",
        "LayoutError",
        "NoCheckpointError",
        "RankFailureError",
        "RestoreError",
        "Restored",
        "SaveHandle",
        "TierckptError",
        "UnsupportedStateError",
        "VersionInfo",
    ]
    for name in tierckpt.__all__:
        assert getattr(tierckpt, name) is not None


def test_async_methods_have_sync_twins() -> None:
    for name in ("save", "wait", "restore_latest", "restore", "close"):
        assert inspect.iscoroutinefunction(getattr(Checkpointer, name)), name
        twin = getattr(Checkpointer, f"{name}_sync")
        assert not inspect.iscoroutinefunction(twin)
        assert list(inspect.signature(twin).parameters) == list(inspect.signature(getattr(Checkpointer, name)).parameters)
    for name in ("captured", "committed"):
        assert inspect.iscoroutinefunction(getattr(SaveHandle, name))
        assert callable(getattr(SaveHandle, f"{name}_sync"))


def test_signatures_match_the_architecture() -> None:
    assert list(inspect.signature(Checkpointer.save).parameters)[:3] == ["self", "step", "state"]
    restore = inspect.signature(Checkpointer.restore_latest).parameters
    assert restore["template"].default is None
    one = inspect.signature(Checkpointer.restore).parameters
    assert list(one)[:3] == ["self", "step", "template"] and one["template"].default is None
    assert [one[k].kind for k in ("tier", "strict", "cast")] == [inspect.Parameter.KEYWORD_ONLY] * 3
    assert callable(Checkpointer.from_yaml)
    for name in ("attach", "versions", "wait_captured", "__enter__", "__exit__", "__aenter__", "__aexit__"):
        assert callable(getattr(Checkpointer, name)), name


def test_errors_inherit_the_matching_builtins() -> None:
    assert issubclass(tierckpt.ConfigError, ValueError)
    assert issubclass(tierckpt.UnsupportedStateError, TypeError)
    assert issubclass(tierckpt.errors.NoCheckpointError, FileNotFoundError)
    assert issubclass(tierckpt.RestoreError, ValueError)
    assert issubclass(tierckpt.FlushError, OSError)
    for name in tierckpt.__all__:
        obj = getattr(tierckpt, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, tierckpt.TierckptError)


def test_importing_tierckpt_imports_no_trainer_or_object_store_client() -> None:
    """The integrations and the object tier's client are optional extras: a fresh interpreter that
    imports tierckpt (and the integrations package) has loaded none of them."""
    import subprocess
    import sys

    code = (
        "import sys, tierckpt, tierckpt.integrations, tierckpt.restore\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'lightning', 'transformers', 'torchtitan', 'obstore'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
