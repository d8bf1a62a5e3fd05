"""Export one stored version's consolidated state as a file tools without tierckpt read.

A version saved by one process or by many ranks (with DTensor shards) is written as the state a
consolidating restore returns: every DTensor whole, in its global shape; every other value as saved
rank 0 holds it. Two formats:

- ``safetensors``: the tensors by dotted key path (``{"model": {"layer.0.w": t}}`` gives
  ``"model.layer.0.w"``, list items by index: ``"optim.state.0.exp_avg"``). ``__metadata__`` holds
  ``"format": "pt"``, ``"tierckpt.step"``, the version's metadata as JSON (``"tierckpt.metadata"``)
  and the state's non-tensor values that are JSON (``"tierckpt.extra"``: ``{dotted name: value}``;
  bytes, NaN, dtypes and devices are left out).
- ``torch``: the whole state as saved (dicts, lists, tuples, plain CPU tensors, non-tensor values),
  for ``torch.load(path, weights_only=True)``; numpy arrays become tensors.

Memory is bounded by the largest tensor, not the state: one tensor at a time is read (every chunk
verified), written and dropped. The safetensors file is written here, header first (every shape and
dtype is known from the manifests), as ``safetensors.torch.save_file`` would need every tensor in
memory at once. ``torch.save`` does need the whole state, so each large tensor lands in a shared
mapping of an unlinked temporary file beside the output: the kernel can write its pages back and
reclaim them, and the save streams them from the page cache (the disk then briefly holds the state
twice).

Nothing is left behind on failure: the output is written to ``<out>.tmp-<random>`` and renamed into
place once complete and fsynced.

The package: :mod:`~tierckpt.export.driver` (:func:`export`), :mod:`~tierckpt.export.reader` (the
version, read one tensor at a time), :mod:`~tierckpt.export.safetensors_writer` and
:mod:`~tierckpt.export.torch_writer` (the two formats).
"""

from __future__ import annotations

from tierckpt.export.driver import FORMATS, ExportProgress, ExportSummary, OutputExistsError, export, format_for

__all__ = ["FORMATS", "ExportProgress", "ExportSummary", "OutputExistsError", "export", "format_for"]
