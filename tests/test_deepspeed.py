"""DeepSpeed ZeRO through tierckpt.integrations.deepspeed: real DeepSpeed engines on CPU, 2 ranks on
gloo (tests/deepspeed_worker.py), saved every step, SIGKILLed on every rank, resumed; compared with
uninterrupted runs of DeepSpeed's own checkpoint engine, bitwise (losses as float.hex, every
parameter's fp32 master and Adam moments)."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("deepspeed")

from tierckpt.errors import CorruptCheckpointError, NoCheckpointError  # noqa: E402
from tierckpt.format import version_dirname  # noqa: E402
from tierckpt.integrations.deepspeed_tags import check_tag, every_rank_names, publish, tag_step, written  # noqa: E402
from tierckpt.integrations.deepspeed_values import from_plain, to_plain  # noqa: E402
from tierckpt.state import flatten, unflatten  # noqa: E402
from tierckpt.testing.ranks import failures, free_port, launch_ranks  # noqa: E402

from helpers import SHUFFLED_ZSTD, fs_tier, tier_config, tierckpt_cli  # noqa: E402

WORKER = Path(__file__).with_name("deepspeed_worker.py")
STEPS = 8

# The three setups: ZeRO-2 fp32 with a client torch.optim.AdamW (two parameter groups); ZeRO-3 bf16 with the config's
# optimizer, 2 micro-batches a step and sub-groups of 100 elements; ZeRO-1 fp32 with the config's optimizer.
ZERO2 = {"stage": 2}
ZERO3 = {"stage": 3, "bf16": True, "optimizer": "config", "accumulation": 2, "zero": {"sub_group_size": 100}}  # several sub-groups
ZERO1 = {"stage": 1, "optimizer": "config"}


def _tiers(root: Path, name: str, **nvme: Any) -> dict[str, Any]:
    return tier_config(fs_tier("nvme", root / f"nvme-{name}", keep={"last": 10}, **nvme), capacity="4MiB")


def _every_feature_tiers(root: Path, name: str) -> dict[str, Any]:
    """RAM, then an nvme tier storing delta versions compressed, then a pfs tier taking every 3rd step
    and keeping 2; an events file per rank and a metrics endpoint."""
    config = tier_config(fs_tier("nvme", root / f"nvme-{name}", keep={"last": 10}, compression=SHUFFLED_ZSTD, delta={"full_every": 3}),
                         fs_tier("pfs", root / f"pfs-{name}", flush={"every_steps": 3}, keep={"last": 2}), capacity="4MiB")
    return {**config, "events": str(root / f"events-{name}-{{rank}}.jsonl"), "metrics": {"port": 0}}


def _launch(root: Path, runs: list[dict[str, Any]], world: int = 2, killed: bool = False) -> None:
    root.mkdir(parents=True, exist_ok=True)
    job = root / f"job-{runs[0]['name']}.json"
    job.write_text(json.dumps({"runs": runs}))
    exits = launch_ranks([sys.executable, str(WORKER), str(root), str(job)], world, timeout_s=240,
                         env={"AWS_EC2_METADATA_DISABLED": "true"})
    failed = failures(exits, expect_dead=tuple(range(world)) if killed else ())
    assert not failed, failed


def _result(root: Path, name: str, rank: int) -> dict[str, Any]:
    return json.loads((root / f"{name}-{rank}.json").read_text())


def _tags(save_dir: Path) -> set[str]:
    return {p.name for p in save_dir.iterdir() if p.is_dir()}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every launch the slow tests look at, in five launches of 2 ranks:

    1. uninterrupted runs of DeepSpeed's own engine (ZeRO-2, ZeRO-3, ZeRO-1), a ZeRO-2 run whose
       copy of global_step2 is held (``held2``), a ZeRO-1 run through tierckpt saved every step
       to step 6 (``saved1``), and a ZeRO-2 and a ZeRO-3 run saved to step 4 (``saved2``, ``saved3``);
    2. ZeRO-2 saved every step, its file tier taking every 2nd step, SIGKILLed right after the save
       of global_step5 returned, once global_step4 was durable (``latest`` named it);
    3. ZeRO-3 saved every step, SIGKILLed right after the save of global_step4, once it was durable;
    4. resumes of both from ``load_checkpoint(save_dir)``, of ``saved1`` from its latest tag and
       from tag global_step3, a tag that is not there, a copy of ``saved1`` whose newest step's
       data file is damaged, one as a kill after the newest step's commit, before its pointers, left it,
       and a rollback of a copy of ``saved1`` to global_step3, saving on (``back1``);
    5. the resume of the rollback's copy from ``load_checkpoint(save_dir)`` (``again1``).
    """
    root = tmp_path_factory.mktemp("deepspeed")
    _launch(root, [
        {"name": "ref2", **ZERO2, "steps": STEPS},
        {"name": "ref3", **ZERO3, "steps": STEPS},
        {"name": "ref1", **ZERO1, "steps": STEPS},
        {"name": "held2", **ZERO2, "steps": 4, "save_every": 1, "hold_at": 1, "save_dir": "held2", "tiers": _tiers(root, "held2")},
        {"name": "saved1", **ZERO1, "steps": 6, "save_every": 1, "save_dir": "ckpts1", "tiers": _tiers(root, "1"), "save_16bit": True},
        {"name": "nolatest1", **ZERO1, "steps": 4, "save_every": 1, "save_latest_from": 3, "save_dir": "nolatest1", "tiers": _tiers(root, "nolatest1")},
        {"name": "saved2", **ZERO2, "steps": 4, "save_every": 2, "save_dir": "saved2", "tiers": _tiers(root, "saved2"), "load_back": True},
        {"name": "saved3", **ZERO3, "steps": 4, "save_every": 2, "save_dir": "saved3", "tiers": _tiers(root, "saved3")},
        {"name": "tiers2", **ZERO2, "steps": 6, "save_every": 1, "save_dir": "tiers2", "tiers": _every_feature_tiers(root, "tiers2"), "metrics": True},
    ])
    _launch(root, [{"name": "kill2", **ZERO2, "steps": STEPS, "save_every": 1, "save_dir": "ckpts2", "tiers": _tiers(root, "2", flush={"every_steps": 2}),
                    "kill_at": 4, "kill_when_latest": "global_step4"}], killed=True)
    _launch(root, [{"name": "kill3", **ZERO3, "steps": STEPS, "save_every": 1, "save_dir": "ckpts3", "tiers": _tiers(root, "3"),
                    "kill_at": 3, "kill_when_latest": "global_step4"}], killed=True)
    (root / "killed.json").write_text(json.dumps({n: {"latest": (root / n / "latest").read_text(), "tags": sorted(_tags(root / n))}
                                                  for n in ("ckpts2", "ckpts3")}))
    damaged = root / "damaged"
    shutil.copytree(root / "ckpts1", damaged / "ckpts1")
    shutil.copytree(root / "nvme-1", damaged / "nvme-1")
    # As a kill between global_step6's commit and its pointers leaves save_dir: latest names the tag before.
    unwritten = root / "unwritten"
    shutil.copytree(root / "ckpts1", unwritten / "ckpts1")
    shutil.copytree(root / "nvme-1", unwritten / "nvme-1")
    shutil.rmtree(unwritten / "ckpts1" / "global_step6")
    (unwritten / "ckpts1" / "latest").write_text("global_step5")
    # A rollback: back to global_step3, saving global_step4 and 5 again (the abandoned direction holds 6).
    rollback = root / "rollback"
    shutil.copytree(root / "ckpts1", rollback / "ckpts1")
    shutil.copytree(root / "nvme-1", rollback / "nvme-1")
    # tiers2's nvme tier lost (a node's disk gone): its pfs tier holds global_step6 and 3.
    lost = root / "lost"
    shutil.copytree(root / "tiers2", lost / "tiers2")
    shutil.copytree(root / "pfs-tiers2", lost / "pfs-tiers2")
    data = damaged / "nvme-1" / "step-000000000006" / "data-r00001.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    _launch(root, [
        {"name": "resume2", **ZERO2, "steps": STEPS, "resume": True, "save_dir": "ckpts2", "tiers": _tiers(root, "2", flush={"every_steps": 2})},
        {"name": "resume3", **ZERO3, "steps": STEPS, "resume": True, "save_dir": "ckpts3", "tiers": _tiers(root, "3")},
        {"name": "resume1", **ZERO1, "steps": STEPS, "resume": True, "save_dir": "ckpts1", "tiers": _tiers(root, "1")},
        {"name": "tag1", **ZERO1, "steps": STEPS, "resume": True, "tag": "global_step3", "save_dir": "ckpts1", "tiers": _tiers(root, "1")},
        {"name": "missing1", **ZERO1, "steps": STEPS, "expect_error": True, "tag": "global_step99", "save_dir": "ckpts1", "tiers": _tiers(root, "1")},
        {"name": "damaged1", **ZERO1, "steps": STEPS, "resume": True, "save_dir": "damaged/ckpts1", "tiers": _tiers(damaged, "1")},
        {"name": "resume-nolatest1", **ZERO1, "steps": STEPS, "resume": True, "save_dir": "nolatest1", "tiers": _tiers(root, "nolatest1")},
        {"name": "nooptim3", **ZERO3, "steps": STEPS, "expect_error": True, "load_kwargs": {"load_optimizer_states": False},
         "save_dir": "ckpts3", "tiers": _tiers(root, "3")},
        {"name": "unwritten1", **ZERO1, "steps": STEPS, "resume": True, "save_dir": "unwritten/ckpts1", "tiers": _tiers(unwritten, "1")},
        {"name": "resume-tiers2", **ZERO2, "steps": STEPS, "resume": True, "save_dir": "tiers2", "tiers": _every_feature_tiers(root, "tiers2")},
        {"name": "lost2", **ZERO2, "steps": STEPS, "resume": True, "save_dir": "lost/tiers2", "tiers": _every_feature_tiers(lost, "tiers2")},
        {"name": "back1", **ZERO1, "steps": 5, "resume": True, "tag": "global_step3", "save_every": 1, "save_dir": "rollback/ckpts1",
         "tiers": _tiers(rollback, "1")},
    ])
    _launch(root, [{"name": "again1", **ZERO1, "steps": STEPS, "resume": True, "save_dir": "rollback/ckpts1", "tiers": _tiers(rollback, "1")}])
    return root


def _assert_resumed_bitwise(root: Path, name: str, reference: str, resumed_at: int) -> None:
    """Each rank resumed after step index ``resumed_at`` (tag global_step{resumed_at + 1}), with its own
    client_state, and trained on bitwise as the uninterrupted run: the losses of every step after,
    and every parameter's fp32 master and Adam moments at the end."""
    for rank in (0, 1):
        got, want = _result(root, name, rank), _result(root, reference, rank)
        assert got["resumed"] == resumed_at, got["resumed"]
        assert got["client"] == {"step": resumed_at, "rank": rank, "note": f"rank {rank} step {resumed_at}", "t": [float(rank + resumed_at)] * 2}
        assert got["losses"] == {str(s): want["losses"][str(s)] for s in range(resumed_at + 1, STEPS)}
        assert got["digests"] == want["digests"]


@pytest.mark.slow
def test_a_save_returns_before_its_copy_and_only_the_optimizer_update_waits(jobs: Path) -> None:
    """global_step2's copy held on each rank: save_checkpoint returned, the next step's forward and
    backward ran, and engine.step() parked in the lazy barrier before the update (the fp32 partitions
    still those saved) until the copy was let go. The run's losses and final state are those of
    DeepSpeed's own engine."""
    for rank in (0, 1):
        got, want = _result(jobs, "held2", rank), _result(jobs, "ref2", rank)
        held = got["held"]
        assert held["returned_before_the_copy"] and held["parked"], held
        assert held["forwards_by_then"] == 1 and held["unchanged_by_then"], held
        assert got["losses"] == {str(s): want["losses"][str(s)] for s in range(4)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["saved2", "saved3"], ids=["zero2", "zero3-bf16"])
def test_export_of_a_deepspeed_version_gives_each_parameters_fp32_master_whole(jobs: Path, tmp_path: Path, name: str) -> None:
    """``tierckpt export`` of a DeepSpeed version gives what zero_to_fp32.py gives from DeepSpeed's own
    files: each parameter's fp32 master whole, by its name, put together from every rank's partitions
    (ZeRO-2 fp32; ZeRO-3 bf16, whose masters are fp32), bitwise the masters at that step."""
    from safetensors.torch import load_file

    out = tmp_path / "weights.safetensors"
    done = tierckpt_cli("export", str(jobs / f"nvme-{name}" / version_dirname(4)), str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    weights = load_file(out)
    masters = {key.removesuffix(".fp32"): digest for key, digest in _result(jobs, name, 0)["digests"].items() if key.endswith(".fp32")}
    assert masters and set(masters) <= set(weights), (sorted(masters), sorted(weights))
    for key, digest in masters.items():
        assert weights[key].dtype == torch.float32 and hashlib.sha256(weights[key].numpy().tobytes()).hexdigest() == digest, key
    assert masters == {key.removesuffix(".fp32"): d for key, d in _result(jobs, name, 1)["digests"].items() if key.endswith(".fp32")}


@pytest.mark.slow
def test_a_tag_just_saved_loads_back_in_the_same_process_by_a_relative_path(jobs: Path) -> None:
    """saved2's last tag, loaded right after its save (durable or not yet) with save_dir given
    relative to the working directory: the state saved, its client_state."""
    for rank in (0, 1):
        got = _result(jobs, "saved2", rank)
        assert got["loaded_back"] == {"path": "mp_rank_00_model_states.pt", "step": 3, "digests": got["digests"]}


@pytest.mark.slow
def test_zero2_killed_right_after_a_save_resumes_the_durable_tag_before_it_bitwise(jobs: Path) -> None:
    """The kill came right after save_checkpoint of global_step5 returned; its file tier takes every
    2nd step, so global_step4 was the newest durable: latest names it, no directory names a step
    that was not durable, and load_checkpoint(save_dir) resumes it."""
    killed = json.loads((jobs / "killed.json").read_text())["ckpts2"]
    assert killed["latest"] == "global_step4"
    assert killed["tags"] == ["global_step2", "global_step4"], killed
    assert sorted(p.name for p in (jobs / "ckpts2" / "global_step4").iterdir()) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    _assert_resumed_bitwise(jobs, "resume2", "ref2", resumed_at=3)


@pytest.mark.slow
def test_zero3_bf16_with_accumulation_killed_after_a_durable_save_resumes_it_bitwise(jobs: Path) -> None:
    killed = json.loads((jobs / "killed.json").read_text())["ckpts3"]
    assert killed["latest"] == "global_step4"
    assert {"global_step1", "global_step4"} <= set(killed["tags"]) <= {f"global_step{s}" for s in range(1, 5)}, killed
    assert sorted(p.name for p in (jobs / "ckpts3" / "global_step4").iterdir()) == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]
    _assert_resumed_bitwise(jobs, "resume3", "ref3", resumed_at=3)
    # Without the optimizer states DeepSpeed would gather ZeRO-3's weights from the files itself (torch.load): refused.
    for rank in (0, 1):
        error = _result(jobs, "nooptim3", rank)["error"]
        assert error.startswith("ConfigError: ") and "load_optimizer_states=True (the default) only" in error, error


@pytest.mark.slow
def test_zero1_resumes_its_latest_tag_or_a_named_one_and_a_missing_tag_is_named(jobs: Path) -> None:
    assert (jobs / "ckpts1" / "latest").read_text() == "global_step6"  # destroy() waited for the last save
    pointer = json.loads((jobs / "ckpts1" / "global_step6" / "mp_rank_00_model_states.pt").read_text())
    assert pointer == {"format": "tierckpt-pointer", "version": 1, "step": 6, "tier": "nvme"}
    _assert_resumed_bitwise(jobs, "resume1", "ref1", resumed_at=5)
    # save_16bit_model is an inference weights file, written by DeepSpeed's own torch.save where asked
    weights = torch.load(jobs / "saved1-weights" / "pytorch_model.bin", weights_only=True)
    assert sorted(weights) == ["inp.bias", "inp.weight", "norm.bias", "norm.weight", "out.bias", "out.weight"]
    _assert_resumed_bitwise(jobs, "tag1", "ref1", resumed_at=2)
    for rank in (0, 1):
        error = _result(jobs, "missing1", rank)["error"]
        assert error.startswith("NoCheckpointError: ") and "no checkpoint of tag 'global_step99' here" in error, error
        assert "holds tag(s) global_step1, global_step2, global_step3, global_step4, global_step5, global_step6" in error, error


@pytest.mark.slow
def test_a_deepspeed_job_uses_every_tier_feature_and_the_cli_reads_its_versions(jobs: Path) -> None:
    """tiers2 (ZeRO-2): delta versions compressed on nvme, every 3rd step on pfs keeping 2, an events file
    per rank and a metrics endpoint. It resumes bitwise from nvme's newest version (a delta), and from
    pfs once nvme is lost; tierckpt ls, verify and status read its versions."""
    _assert_resumed_bitwise(jobs, "resume-tiers2", "ref2", resumed_at=5)
    _assert_resumed_bitwise(jobs, "lost2", "ref2", resumed_at=5)
    nvme, pfs = jobs / "nvme-tiers2", jobs / "pfs-tiers2"
    listed = tierckpt_cli("ls", str(nvme))
    assert listed.returncode == 0, listed.stdout + listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()[1:]]
    assert rows[-1][:2] == [version_dirname(6), "6"] and any("delta of step 1" in line for line in listed.stdout.splitlines()), listed.stdout
    # pfs takes every 3rd step and keeps 2: global_step6, and none that is not a multiple of 3
    on_pfs = sorted(int(p.name.removeprefix("step-")) for p in pfs.iterdir() if p.name.startswith("step-"))
    assert on_pfs[-1] == 6 and len(on_pfs) <= 2 and all(s % 3 == 0 for s in on_pfs), on_pfs
    for directory in (nvme, pfs):
        checked = tierckpt_cli("verify", str(directory))
        assert checked.returncode == 0, checked.stdout + checked.stderr
    config = jobs / "tiers2.yaml"
    config.write_text(json.dumps(_every_feature_tiers(jobs, "tiers2")))  # JSON is YAML
    shown = tierckpt_cli("status", str(config))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    header, *lines = shown.stdout.split("\n\n")[0].splitlines()  # the table of versions, before the events' table
    column = {name: header.index(name) for name in ("VERSIONS", "NEWEST", "STORED")}
    table = {line.split()[0]: line for line in lines}
    cell = lambda tier, name, end: table[tier][column[name]:column[end]].strip()  # noqa: E731
    assert cell("nvme", "NEWEST", "STORED") == "6" and cell("nvme", "VERSIONS", "NEWEST").endswith("deltas)"), shown.stdout
    assert cell("pfs", "NEWEST", "STORED") == "6" and cell("pfs", "VERSIONS", "NEWEST") == str(len(on_pfs)), shown.stdout
    for rank in (0, 1):
        events = [json.loads(line) for line in (jobs / f"events-tiers2-{rank}.jsonl").read_text().splitlines()]
        flushed = [(e["tier"], e["step"]) for e in events if e["event"] == "flushed"]
        assert ("nvme", 6) in flushed and ("pfs", 6) in flushed, flushed
        assert [(e["tier"], e["step"]) for e in events if e["event"] == "restored"] == [("nvme", 6)]  # resume-tiers2
        lost = [json.loads(line) for line in (jobs / "lost" / f"events-tiers2-{rank}.jsonl").read_text().splitlines()]
        assert [(e["tier"], e["step"]) for e in lost if e["event"] == "restored"] == [("pfs", 6)]
        # the metrics endpoint counted what the events file holds
        metrics = dict(line.rsplit(" ", 1) for line in _result(jobs, "tiers2", rank)["metrics"])
        assert float(metrics["tierckpt_saves_total"]) == 6.0, metrics
        for tier in ("nvme", "pfs"):
            assert float(metrics[f'tierckpt_flushes_total{{tier="{tier}"}}']) == sum(1 for t, _ in flushed if t == tier), (tier, metrics)


@pytest.mark.slow
def test_after_a_rollback_load_checkpoint_resumes_the_new_direction(jobs: Path) -> None:
    """Back to global_step3 and on, saving global_step4 and 5 again: the next load_checkpoint(save_dir)
    resumes the new direction's global_step5, not the abandoned direction's global_step6, and latest
    names it."""
    assert (jobs / "rollback" / "ckpts1" / "latest").read_text() == "global_step5"
    for rank in (0, 1):
        back, again = _result(jobs, "back1", rank), _result(jobs, "again1", rank)
        assert back["resumed"] == 2 and again["resumed"] == 4, (back["resumed"], again["resumed"])
        assert again["loaded"] == back["digests"]  # the new direction's weights and moments, not the abandoned ones
        assert again["client"]["note"] == f"rank {rank} step 4"


@pytest.mark.slow
def test_a_save_without_save_latest_is_not_what_a_load_of_latest_resumes(jobs: Path) -> None:
    """global_step4 saved with save_latest=False: its tag directory is written, latest stays at
    global_step3, and load_checkpoint(save_dir) resumes global_step3 (DeepSpeed's meaning), bitwise."""
    save_dir = jobs / "nolatest1"
    assert (save_dir / "latest").read_text() == "global_step3" and tag_step(save_dir, "global_step4") == 4
    _assert_resumed_bitwise(jobs, "resume-nolatest1", "ref1", resumed_at=2)


@pytest.mark.slow
def test_a_damaged_data_file_falls_back_to_the_tag_before_with_a_warning(jobs: Path) -> None:
    """Rank 1's data file of global_step6 has a flipped byte: both ranks pass over the step (tierckpt
    warns, naming the file), load global_step5, warn that latest names another tag, and train on bitwise."""
    _assert_resumed_bitwise(jobs, "damaged1", "ref1", resumed_at=4)
    for rank in (0, 1):
        said = _result(jobs, "damaged1", rank)["warnings"]
        assert any("data-r00001.bin" in m for m in said), said
        assert any("names tag 'global_step6', but the newest tag the tiers can restore is 'global_step5'" in m for m in said), said


@pytest.mark.slow
def test_a_step_durable_before_its_pointers_were_written_resumes_and_gets_them(jobs: Path) -> None:
    """global_step6 committed, its directory not written and latest still naming global_step5: the
    load resumes global_step6 (the newest the tiers can restore), warning that latest named another
    tag, and writes the directory and latest it lacked."""
    _assert_resumed_bitwise(jobs, "unwritten1", "ref1", resumed_at=5)
    said = _result(jobs, "unwritten1", 0)["warnings"]
    assert any("names tag 'global_step5', but the newest tag the tiers can restore is 'global_step6'" in m for m in said), said
    save_dir = jobs / "unwritten" / "ckpts1"
    assert (save_dir / "latest").read_text() == "global_step6"
    assert tag_step(save_dir, "global_step6") == 6


@pytest.mark.slow
def test_setups_it_cannot_checkpoint_faithfully_are_refused_naming_the_setting(tmp_path: Path) -> None:
    """Each refused setup built for real on 1 rank; and a save_dir of DeepSpeed's own checkpoints,
    which the tiers know nothing of, is an error rather than a fresh start."""
    cases = ["stage0", "offload_optimizer", "offload_param", "elastic_checkpoint", "node_local_storage", "pipeline", "moe"]
    _launch(tmp_path, [
        {"name": "refusals", "refusals": cases, "tiers": _tiers(tmp_path, "r")},
        {"name": "own", **ZERO2, "steps": 1, "save_every": 1, "save_dir": "own"},  # DeepSpeed's own engine
        {"name": "own-load", **ZERO2, "steps": 1, "expect_error": True, "save_dir": "own", "tiers": _tiers(tmp_path, "own")},
    ], world=1)
    # Tiers that hold nothing while save_dir/latest names a tag of DeepSpeed's own: not a silent start over.
    error = _result(tmp_path, "own-load", 0)["error"]
    assert error.startswith("NoCheckpointError: ") and "names tag 'global_step1', saved by DeepSpeed's own checkpoint engine" in error, error
    assert "Load it once without attach()" in error
    said = _result(tmp_path, "refusals", 0)
    wanted = {
        "stage0": '"zero_optimization": {"stage": 0}: set zero_optimization.stage to 1, 2 or 3',
        "offload_optimizer": '"zero_optimization.offload_optimizer.device": "cpu"',
        "offload_param": '"zero_optimization.offload_param.device": "cpu"',
        "elastic_checkpoint": '"zero_optimization.elastic_checkpoint": true',
        "node_local_storage": '"checkpoint.use_node_local_storage": true',
        "pipeline": "pipeline parallelism",
        "moe": "MoE layers",
    }
    for case, words in wanted.items():
        assert said[case].startswith("tierckpt.integrations.deepspeed does not support ") and words in said[case], (case, said[case])
    assert not (tmp_path / "nvme-r").exists()  # refused before any Checkpointer was opened


@pytest.fixture(scope="module")
def resharded(jobs: Path) -> Path:
    """``saved2``, ``saved3`` and ``saved1`` (2 ranks) loaded by a job of 1 rank and by one of 3, each
    with the same ``load_checkpoint(save_dir)``, then trained on to step 8."""
    for world in (1, 3):
        _launch(jobs, [{"name": f"onto{world}-{n}", **setup, "steps": 8, "resume": True, "save_dir": save_dir, "tiers": _tiers(jobs, tiers)}
                       for n, setup, save_dir, tiers in (("2", ZERO2, "saved2", "saved2"), ("3", ZERO3, "saved3", "saved3"), ("1", ZERO1, "ckpts1", "1"))],
                world=world)
    return jobs


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("stage", ["1", "2", "3"])
def test_a_two_rank_save_loads_onto_another_number_of_ranks_bitwise(resharded: Path, stage: str, world: int) -> None:
    """Every rank of the new job has each parameter's fp32 master and Adam moments exactly as the
    2-rank job saved them (its state at its last save: global_step4, or global_step6 for ZeRO-1),
    with no offline step; the tag directory still names the 2 ranks that saved it, and training goes on."""
    saved = _result(resharded, "saved1" if stage == "1" else f"saved{stage}", 0)
    last = 6 if stage == "1" else 4
    for rank in range(world):
        got = _result(resharded, f"onto{world}-{stage}", rank)
        assert got["world"] == world and got["resumed"] == last - 1
        assert got["loaded"] == saved["digests"]
        assert sorted(map(int, got["losses"])) == list(range(last, STEPS)) and all(float.fromhex(v) < 1e3 for v in got["losses"].values())
    tag = resharded / ("ckpts1" if stage == "1" else f"saved{stage}") / f"global_step{last}"
    assert len([p for p in tag.iterdir() if p.name.endswith("model_states.pt")]) == (2 if stage == "3" else 1)


@pytest.mark.slow
def test_a_rank_killed_after_a_save_leaves_no_tag_that_is_not_durable_on_every_rank(tmp_path: Path) -> None:
    """Rank 1 SIGKILLed right after its save of global_step3 returned, rank 0 training on: the next
    backward's all-reduce fails on rank 0 (gloo), whose exit then waits for what it saved (at most
    distributed.timeout). Every tag directory, and latest, names a step committed on every rank."""
    tiers = _tiers(tmp_path, "k") | {"distributed": {"timeout": "3s"}}
    tmp_path.mkdir(parents=True, exist_ok=True)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"runs": [{"name": "kill1", **ZERO2, "steps": STEPS, "save_every": 1, "save_dir": "ckpts",
                                         "tiers": tiers, "kill_at": 2, "kill_ranks": [1]}]}))
    survivor, dead = launch_ranks([sys.executable, str(WORKER), str(tmp_path), str(job)], 2, timeout_s=240,
                                  env={"AWS_EC2_METADATA_DISABLED": "true"})
    assert dead.returncode == -9 and survivor.returncode not in (0, None), (survivor, dead)
    from tierckpt import Checkpointer

    with Checkpointer(_tiers(tmp_path, "k")) as ckpt:
        durable = {v.step for v in ckpt.versions() if v.tier == "nvme"}
    save_dir = tmp_path / "ckpts"
    tags = {tag_step(save_dir, p.name) for p in save_dir.iterdir() if p.is_dir()} if save_dir.is_dir() else set()
    assert tags <= durable <= {1, 2, 3}, (tags, durable)
    if (save_dir / "latest").exists():
        assert tag_step(save_dir, (save_dir / "latest").read_text()) in durable


@pytest.mark.slow
def test_the_hugging_face_trainers_deepspeed_is_still_refused_pointing_at_attach(tmp_path: Path) -> None:
    """TrainingArguments(deepspeed=...) makes accelerate save through DeepSpeed's engine: TierckptTrainer
    refuses it when built. In a process of its own: accelerate's DeepSpeed set-up starts torch.distributed."""
    pytest.importorskip("transformers")
    script = (
        "import torch\n"
        "from transformers import TrainingArguments\n"
        "from tierckpt.integrations.huggingface import TierckptTrainer\n"
        f"args = TrainingArguments(output_dir={str(tmp_path / 'out')!r}, use_cpu=True, report_to=[],\n"
        "                         deepspeed={'train_micro_batch_size_per_gpu': 'auto', 'zero_optimization': {'stage': 2}})\n"
        "try:\n"
        "    TierckptTrainer(model=torch.nn.Linear(2, 2), args=args, tierckpt={'tiers': [{'name': 'ram', 'type': 'memory'}]})\n"
        "except Exception as exc:\n"
        "    print(f'{type(exc).__name__}: {exc}')\n"
    )
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "AWS_EC2_METADATA_DISABLED": "true"}
    exits = launch_ranks([sys.executable, "-c", script], 0, env=env | {"MASTER_PORT": str(free_port())}, timeout_s=120)
    assert exits[0].returncode == 0, exits[0].output
    assert "ConfigError: TierckptTrainer supports DDP" in exits[0].output and "tierckpt.integrations.deepspeed.attach" in exits[0].output, exits[0].output


@pytest.mark.slow
def test_zero1_resharding_reads_only_the_saved_ranks_it_overlaps(tmp_path: Path) -> None:
    """A ZeRO-1 save of 4 ranks (one group of 209 elements: partitions of 54) loaded by 3 (partitions
    of 70): new rank 1 overlaps saved ranks 1 and 2, new rank 2 saved ranks 2 and 3, and each reads
    those and rank 0 (whose partition gives their size), no other; the fp32 masters and moments are
    those saved."""
    tiers = _tiers(tmp_path, "x4")
    _launch(tmp_path, [{"name": "saved", **ZERO1, "steps": 2, "save_every": 2, "tiers": tiers}], world=4)
    _launch(tmp_path, [{"name": "onto3", **ZERO1, "steps": 3, "resume": True, "tiers": tiers}], world=3)
    saved = _result(tmp_path, "saved", 0)
    for rank, read in ((0, "[0, 1]"), (1, "[0, 1, 2]"), (2, "[0, 2, 3]")):
        got = _result(tmp_path, "onto3", rank)
        assert got["loaded"] == saved["digests"] and got["resumed"] == 1
        assert got["reads"] == [f"tierckpt: DeepSpeed: resharding read the optimizer files of saved rank(s) {read}"], got["reads"]


# -- without DeepSpeed engines: its values stored without pickle, and save_dir's files ---------------


def test_lightnings_deepspeed_strategy_is_still_refused_pointing_at_attach() -> None:
    """Lightning's DeepSpeedStrategy saves through DeepSpeed's engine behind Lightning's back:
    TierckptCheckpointIO refuses it and names what covers DeepSpeed outside Lightning."""
    pytest.importorskip("lightning")
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from tierckpt.errors import ConfigError
    from tierckpt.integrations.lightning import TierckptCheckpointIO

    env = LightningEnvironment()
    env.set_world_size(2)
    with pytest.raises(ConfigError, match=r"DeepSpeedStrategy saves sharded states in a format of its own.*tierckpt\.integrations\.deepspeed\.attach"):
        TierckptCheckpointIO({"tiers": [{"name": "ram", "type": "memory"}]}).attach(DeepSpeedStrategy(stage=2, cluster_environment=env))


def _deepspeed_values() -> dict[str, Any]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return {
        "param_shapes": [OrderedDict([("w", torch.Size([16, 8])), ("b", torch.Size([16]))])],
        "optimizer_state_dict": {
            "loss_scaler": LossScaler(4.0), "dynamic": DynamicLossScaler(init_scale=2.0**8, scale_window=10, min_scale=1, delayed_shift=2, consecutive_hysteresis=False, dtype=torch.bfloat16),
            "zero_stage": ZeroStageEnum.gradients, "partition": torch.arange(4.0),
            "param_slice_mappings": [OrderedDict([("w", fragment_address(numel=46, start=0)), ("b", fragment_address(numel=16, start=46))])],
        },
        "pair": (torch.Size([2]), 3),
        "client": {"kind": "Size", "v": [1, 2]},  # a user's value shaped like one of the kinds: stays as it is
    }


def test_deepspeed_values_round_trip_through_a_stored_skeleton_without_pickle() -> None:
    state = _deepspeed_values()
    plain, kinds = to_plain(state)
    skeleton, leaves = flatten({"state": plain, "kinds": kinds})  # raises for anything tierckpt cannot store
    back = unflatten(skeleton, [leaf.value for leaf in leaves])
    rebuilt = from_plain(back["state"], back["kinds"])
    assert rebuilt["param_shapes"] == state["param_shapes"] and type(rebuilt["param_shapes"][0]["w"]) is torch.Size
    sd = rebuilt["optimizer_state_dict"]
    assert sd["param_slice_mappings"] == state["optimizer_state_dict"]["param_slice_mappings"]
    assert type(sd["loss_scaler"]).__name__ == "LossScaler" and vars(sd["loss_scaler"]) == vars(state["optimizer_state_dict"]["loss_scaler"])
    assert vars(sd["dynamic"]) == vars(state["optimizer_state_dict"]["dynamic"]) and sd["dynamic"].dtype is torch.bfloat16
    assert sd["zero_stage"] is state["optimizer_state_dict"]["zero_stage"]
    assert torch.equal(sd["partition"], state["optimizer_state_dict"]["partition"])
    assert rebuilt["pair"] == (torch.Size([2]), 3) and type(rebuilt["pair"][0]) is torch.Size
    assert rebuilt["client"] == {"kind": "Size", "v": [1, 2]}
    assert plain["optimizer_state_dict"]["partition"] is state["optimizer_state_dict"]["partition"]  # the live tensor, not a copy


@pytest.mark.parametrize("kinds", [
    [[["x"], "builtins.eval"]],                        # a kind not on the list
    [[["x"], "LossScaler"]],                           # its fields not a dict
    [[["missing"], "Size"]],                           # a path that is not in the state
    [[["x"], "ZeroStageEnum"]],
    "not a list",
], ids=["unknown-kind", "scaler-not-fields", "no-such-path", "stage-not-int", "not-a-list"])
def test_stored_kinds_that_do_not_fit_are_corrupt_never_constructed(kinds: Any) -> None:
    with pytest.raises(CorruptCheckpointError):
        from_plain({"x": "print('ran')"}, kinds)


def test_a_scaler_field_that_is_not_a_plain_value_is_corrupt() -> None:
    with pytest.raises(CorruptCheckpointError, match="field 'cur_scale' is not a plain value"):
        from_plain({"s": {"cur_scale": [1.0]}}, [[["s"], "LossScaler"]])


def test_every_ranks_file_names_come_from_rank_0s() -> None:
    assert every_rank_names(["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"], 3) == [
        "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "zero_pp_rank_2_mp_rank_00_optim_states.pt"]
    assert every_rank_names(["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"], 2) == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]


def test_a_published_tag_names_its_step_and_latest_names_the_tag(tmp_path: Path) -> None:
    names = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert not written(tmp_path, "global_step4")
    publish(tmp_path, "global_step4", 4, "nvme", names, latest=True)
    publish(tmp_path, "best", 4, "nvme", names, latest=False)
    assert written(tmp_path, "global_step4") and tag_step(tmp_path, "global_step4") == 4
    assert (tmp_path / "latest").read_text() == "global_step4"  # the save without save_latest left it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "global_step4", "latest"]  # no temporary file left
    publish(tmp_path, "global_step4", 5, "nvme", names, latest=True)  # the same tag saved again
    assert tag_step(tmp_path, "global_step4") == 5
    with pytest.raises(NoCheckpointError, match="no checkpoint of tag 'nope' here"):
        tag_step(tmp_path, "nope")
    torch.save({"module": {}}, tmp_path / "best" / "mp_rank_00_model_states.pt")  # DeepSpeed's own engine's file
    with pytest.raises(CorruptCheckpointError, match="without tierckpt.integrations.deepspeed.attach"):
        tag_step(tmp_path, "best")


@pytest.mark.parametrize("tag", ["", ".", "..", "a/b", ".hidden"])
def test_a_tag_that_is_not_one_directory_name_is_refused(tag: str) -> None:
    with pytest.raises(ValueError, match="one directory name"):
        check_tag(tag)


def test_attach_refuses_what_is_not_a_deepspeed_engine_before_opening_anything(tmp_path: Path) -> None:
    from tierckpt.errors import ConfigError
    from tierckpt.integrations.deepspeed import attach

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"takes the engine deepspeed.initialize returned \(a DeepSpeedEngine\), not a Linear"):
        attach(model, _tiers(tmp_path, "refused"))
    assert not (tmp_path / "nvme-refused").exists()  # no Checkpointer was opened


def _partitioned(params: dict[str, torch.Tensor], world: int, stage: int) -> list[list[torch.Tensor]]:
    """Each rank's flat fp32 partitions of one parameter group, as DeepSpeed lays them out: ZeRO-1/2
    the parameters end to end cut into ``world`` equal parts (the padding at the end, stripped), ZeRO-3
    ``ceil(numel / world)`` elements of each parameter a rank."""
    if stage == 3:
        pieces: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for value in params.values():
            part = -(-value.numel() // world)
            padded = torch.nn.functional.pad(value.reshape(-1), (0, part * world - value.numel()))
            for q in range(world):
                pieces[q].append(padded[q * part:(q + 1) * part])
        return [[torch.cat(p)] for p in pieces]
    flat = torch.cat([v.reshape(-1) for v in params.values()])
    size = -(-flat.numel() // world)
    return [[flat[q * size:(q + 1) * size]] for q in range(world)]


@pytest.mark.parametrize("stage", [2, 3])
def test_partitions_of_three_ranks_are_put_together_into_each_whole_parameter(stage: int) -> None:
    """The arithmetic of the export (tierckpt.export.zero) and of a ZeRO-3 resharding
    (integrations.deepspeed_reshard): parameters of uneven sizes cut as DeepSpeed cuts them come back whole."""
    from tierckpt.export import zero
    from tierckpt.integrations.deepspeed_reshard import _whole_stage3

    g = torch.Generator().manual_seed(stage)
    params = {"a.weight": torch.randn(3, 5, generator=g), "a.bias": torch.randn(7, generator=g), "b": torch.randn(1, generator=g)}
    shapes = [OrderedDict((name, tuple(value.shape)) for name, value in params.items())]
    partitions = _partitioned(params, 3, stage)
    put = zero._stage3(shapes, partitions, Path("v")) if stage == 3 else zero._stage12(shapes, partitions, Path("v"))
    assert put.keys() == params.keys() and all(torch.equal(put[k], params[k]) for k in params)
    if stage == 3:  # resharding puts the fp32 masters and each moment together the same way
        osds = [{"fp32_flat_groups": p, "optimizer_state_dict": {"state": {0: {"exp_avg": p[0] * 2, "step": 4}}}} for p in partitions]
        whole = _whole_stage3(shapes, osds)
        assert all(torch.equal(whole[k]["fp32"], params[k]) and torch.equal(whole[k]["exp_avg"], params[k] * 2) for k in params)
    with pytest.raises(CorruptCheckpointError, match="needs"):
        (zero._stage3 if stage == 3 else zero._stage12)(shapes, [[p[0][:-1]] for p in partitions], Path("v"))
